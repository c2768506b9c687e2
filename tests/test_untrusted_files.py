"""Run dirs and checkpoints hold files dsaflow did not write: links planted into them, FIFOs, stray weight files,
another run's checkpoints, corrupted records, hostile headers. Nothing is written or read outside the run dir or
checkpoint, nothing hangs, nothing is lost, and each case is one paragraph (a PlanError: exit status 2)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import threading
from pathlib import Path

import pytest
import torch
from train_harness import tiny_cfg

from dsaflow.checkpoint.store import newest_good_checkpoint, pinned, prune, read_run_id, verify_checkpoint
from dsaflow.errors import CheckpointError, PlanError
from dsaflow.files import UnsafeFile, atomic_write, read_text
from dsaflow.rundir.folder import MANIFEST, checkpoint_dir, list_checkpoints

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")


@pytest.fixture(scope="module")
def model():
    from dsaflow.pipeline.stages import stage_module
    from dsaflow.plan import build_plan

    cfg = tiny_cfg(1, None, "1F1B")
    return cfg, [stage_module(cfg.model, build_plan(cfg), 0, seed=0)]


def _save(run: Path, step: int, modules, keep=None) -> bool:
    from dsaflow.checkpoint.training_state import save_checkpoint

    return save_checkpoint(checkpoint_dir(run, step), modules, None, 0, step, keep=keep)


def _snapshot(root: Path) -> dict:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() and not p.is_symlink() else None)
        for p in sorted(root.rglob("*"))
    }


# --- data loss ----------------------------------------------------------------------------------------------------


def test_pruning_deletes_only_good_checkpoints_of_this_run(tmp_path, model):
    """A foreign checkpoint (another run's id) and a bad one at higher steps survive; the run keeps its newest good
    checkpoint instead of losing every real one to them."""
    _, modules = model
    run = tmp_path / "run"
    assert _save(run, 1, modules) and _save(run, 2, modules)
    foreign = checkpoint_dir(run, 99)
    shutil.copytree(checkpoint_dir(run, 2), foreign)
    m = json.loads((foreign / MANIFEST).read_text())
    m["run_id"] = "0" * 32
    (foreign / MANIFEST).write_text(json.dumps(m))
    bad = checkpoint_dir(run, 98)
    bad.mkdir()
    (bad / "__0_0.distcp").write_bytes(b"junk")
    before = {p: _snapshot(p) for p in (foreign, bad)}
    assert _save(run, 3, modules, keep=1)
    assert [s for s, _ in list_checkpoints(run)] == [99, 98, 3]
    assert {p: _snapshot(p) for p in (foreign, bad)} == before, "another run's and a bad folder are never touched"
    skipped = []
    assert newest_good_checkpoint(run, skipped.append)[0] == 3
    assert any("another run" in s and "step-000099" in s for s in skipped), skipped


def test_a_bad_folder_of_the_same_step_is_replaced_after_the_new_save_verifies(tmp_path, model):
    _, modules = model
    run = tmp_path / "run"
    assert _save(run, 2, modules)
    shard = next(checkpoint_dir(run, 2).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-9] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError):
        verify_checkpoint(checkpoint_dir(run, 2))
    assert _save(run, 2, modules), "a corrupted checkpoint of this step must be saved again, not skipped"
    verify_checkpoint(checkpoint_dir(run, 2))
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")], "no partial or trash left"


def test_disk_full_during_a_save_leaves_no_partial_folder(tmp_path, model, monkeypatch):
    from dsaflow.checkpoint import training_state as ck

    _, modules = model
    run = tmp_path / "run"
    assert _save(run, 1, modules)
    good = _snapshot(run)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck, "save_file", full)
    with pytest.raises(CheckpointError, match="disk is full.*partial save was removed.*train.resume=true"):
        _save(run, 2, modules)
    assert _snapshot(run) == good, "the failed save left something behind or touched step 1"


def test_run_dir_inside_a_checkpoint_or_run_is_refused(tmp_path, model):
    from dsaflow.rundir.folder import check_run_dir

    cfg, modules = model
    run = tmp_path / "run"
    (run).mkdir()
    (run / "config.yaml").write_text("x: 1\n")
    assert _save(run, 1, modules)
    for inside in (checkpoint_dir(run, 1), checkpoint_dir(run, 1) / "sub", run / "nested"):
        cfg.run_dir = str(inside)
        with pytest.raises(PlanError, match="lies inside"):
            check_run_dir(cfg, None)


# --- writing where it should not ----------------------------------------------------------------------------------


def test_writes_never_follow_links_planted_in_a_run_dir(tmp_path):
    from dsaflow.train.metrics import RunRecords

    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.yaml.tmp", ".config.yaml.tmp-1-0", "plan.txt.tmp"):
        (run / name).symlink_to(outside)
    atomic_write(run / "config.yaml", "a: 1\n")
    (run / "plan.txt").symlink_to(outside)
    atomic_write(run / "plan.txt", "table\n")  # replaces the link, does not write through it
    assert not (run / "plan.txt").is_symlink() and (run / "plan.txt").read_text() == "table\n"
    (run / "metrics.jsonl").symlink_to(outside)
    rec = RunRecords(run, enabled=False)
    rec.enabled = True
    with pytest.raises(UnsafeFile, match="symbolic link"):
        rec.metrics({"step": 1})
    (run / "train.log").symlink_to(outside)
    with pytest.raises(UnsafeFile, match="symbolic link"):
        RunRecords(run, enabled=True)
    assert outside.read_text() == "precious\n"


# --- reading what it should not -----------------------------------------------------------------------------------


def test_serving_reads_only_the_weight_files_the_manifest_lists(tmp_path, model):
    from dsaflow.checkpoint.safetensors_io import save_file
    from dsaflow.checkpoint.weights import load_model_weights

    _, modules = model
    run = tmp_path / "run"
    assert _save(run, 1, modules)
    ck = checkpoint_dir(run, 1)
    poisoned = {k: torch.full_like(v, 7.0) for k, v in modules[0].state_dict().items()}
    save_file(poisoned, ck / "model-rank5.safetensors")  # a stray file, not in the manifest
    target = {0: _fresh(model)}
    load_model_weights(target, ck)
    for k, v in modules[0].state_dict().items():
        assert torch.equal(target[0].state_dict()[k], v), k


def _fresh(model):
    from dsaflow.pipeline.stages import stage_module
    from dsaflow.plan import build_plan

    cfg, _ = model
    return stage_module(cfg.model, build_plan(cfg), 0, seed=123)


def test_a_listed_file_replaced_by_a_link_is_refused(tmp_path, model):
    from dsaflow.checkpoint.weights import load_model_weights
    from dsaflow.errors import ServeError

    _, modules = model
    run = tmp_path / "run"
    assert _save(run, 1, modules)
    ck = checkpoint_dir(run, 1)
    real = ck / "model-rank0.safetensors"
    moved = tmp_path / "elsewhere.safetensors"
    real.rename(moved)
    real.symlink_to(moved)  # same bytes, same hash: only the link rule refuses it
    with pytest.raises(CheckpointError, match="symbolic link"):
        verify_checkpoint(ck)
    with pytest.raises(ServeError):
        load_model_weights({0: _fresh(model)}, ck)


@needs_fifo
def test_a_fifo_in_a_checkpoint_is_refused_without_blocking(tmp_path, model):
    _, modules = model
    run = tmp_path / "run"
    assert _save(run, 1, modules)
    ck = checkpoint_dir(run, 1)
    (ck / "model-rank0.safetensors").unlink()
    os.mkfifo(ck / "model-rank0.safetensors")
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("skipped", newest_good_checkpoint(run, print)), daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "reading a FIFO blocked"
    assert result["skipped"] is None


def test_hostile_manifests_and_safetensors_headers_are_refused(tmp_path, model):
    from dsaflow.checkpoint.safetensors_io import SafetensorsError, read_header

    _, modules = model
    run = tmp_path / "run"
    assert _save(run, 1, modules)
    ck = checkpoint_dir(run, 1)
    good = (ck / MANIFEST).read_text()
    for text in (
        "[" * 100000 + "]" * 100000,
        '{"files": {".metadata": {"size": ' + "9" * 5000 + "}}}",
        '{"files": {"../x": {"size": 1, "sha256": "00"}, ".metadata": {}}}',
        "null",
        "\0\0",
    ):
        (ck / MANIFEST).write_text(text)
        with pytest.raises(CheckpointError):
            verify_checkpoint(ck)
    (ck / MANIFEST).write_text(good)
    bad = tmp_path / "h.safetensors"
    for header in (
        b"[" * 50000 + b"]" * 50000,
        b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}',
        b'{"a": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 4]}}',
        b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
        b'"b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
    ):
        bad.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
        with pytest.raises(SafetensorsError):
            read_header(bad)
    bad.write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    with pytest.raises(SafetensorsError, match="does not fit"):
        read_header(bad)


@needs_fifo
def test_safe_reads_name_fifos_folders_and_links(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    (tmp_path / "target").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    for name, what in (("fifo", "FIFO"), ("dir", "folder"), ("link", "symbolic link"), ("nope", "does not exist")):
        with pytest.raises(UnsafeFile, match=what):
            read_text(tmp_path / name)
    with pytest.raises(UnsafeFile, match="not a file directly inside"):
        read_text(tmp_path / "target", inside=tmp_path / "dir")


# --- two processes, one run dir -----------------------------------------------------------------------------------


def test_a_second_holder_of_a_run_dir_is_refused_naming_the_first(tmp_path):
    from dsaflow.rundir.lock import RunDirBusy, run_dir_lock

    with run_dir_lock(tmp_path, "train"):
        with pytest.raises(RunDirBusy, match=rf"in use by `dsaflow train` \(pid {os.getpid()} on host"):
            with run_dir_lock(tmp_path, "train"):
                pass
    with run_dir_lock(tmp_path, "train"):  # released on exit
        pass


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    from dsaflow.rundir.lock import LOCK, run_dir_lock

    (tmp_path / LOCK).write_text(json.dumps({"pid": 999999999, "host": "gone", "job": "train", "since": 1.0}))
    said = []
    with run_dir_lock(tmp_path, "train", said.append):
        pass
    assert said and "stale lock" in said[0] and "999999999" in said[0] and "gone" in said[0]


def test_pruning_skips_a_checkpoint_a_reader_has_pinned(tmp_path, model):
    _, modules = model
    run = tmp_path / "run"
    for step in (1, 2):
        assert _save(run, step, modules)
    with pinned(checkpoint_dir(run, 1)):
        assert prune(run, 1) == []
        assert checkpoint_dir(run, 1).is_dir()
    assert prune(run, 1) == [1] and not checkpoint_dir(run, 1).exists()
    assert read_run_id(run) is not None


# --- corrupted records --------------------------------------------------------------------------------------------


def test_corrupted_run_dir_files_are_named(tmp_path):
    from dsaflow.config.compose import compose, load_config
    from dsaflow.plan import build_plan, render_table
    from dsaflow.rundir.folder import read_metrics, read_run_dir, write_run_dir

    cfg = compose(["track=none", f"run_dir={tmp_path / 'run'}"])
    run = write_run_dir(cfg, build_plan(cfg), render_table(build_plan(cfg), cfg))
    read_run_dir(run)
    (run / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n{"ste')
    assert [r["step"] for r in read_metrics(run)] == [1, 3], "a torn last line and a bad line are skipped"
    with pytest.raises(PlanError, match="line 2"):
        read_metrics(run, strict=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2')
    assert [r["step"] for r in read_metrics(run, strict=True)] == [1], "a torn last line is a kill, not corruption"
    plan = json.loads((run / "plan.json").read_text())
    plan["pipeline"]["ranks"] = 64
    (run / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(PlanError, match="is not the plan of"):
        read_run_dir(run)
    (run / "plan.json").write_text("{" * 10000)
    with pytest.raises(PlanError, match="plan.json"):
        read_run_dir(run)
    bomb = (
        "a: &a [1,1,1,1,1,1,1,1,1]\n"
        + "".join(f"{b}: &{b} [{','.join(['*' + a] * 9)}]\n" for a, b in zip("abcd", "bcde"))
        + "extra: [*e,*e,*e,*e]\n"
    )
    for text, needle in (
        ("", "is empty"),
        ("model: [", "not valid YAML"),
        ("12", "not a YAML mapping"),
        (bomb, "sane size"),
    ):
        (run / "config.yaml").write_text(text)
        with pytest.raises(PlanError, match=needle):
            load_config(run / "config.yaml")


def test_memory_check_counts_a_folder_corpus_and_maps_a_single_file(tmp_path):
    import numpy as np

    from dsaflow.config.compose import compose
    from dsaflow.data.corpus import load_tokens
    from dsaflow.launch.resources import rank_memory
    from dsaflow.plan import build_plan

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_bytes(b"x" * 100_000)
    cfg = compose(["track=none", "data=text", f"data.path={tmp_path / 'c'}", "train.seq_len=32"])
    need = rank_memory(cfg, build_plan(cfg), 0, "cpu", "train")
    corpus = [v for k, v in need.items() if k.startswith("training corpus")]
    assert corpus == [2 * 100_001]
    assert isinstance(load_tokens("text", tmp_path / "c" / "a.txt"), np.memmap)
