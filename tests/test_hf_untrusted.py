"""A Hugging Face checkpoint folder is untrusted input: nothing is read from outside it by any path (index entries,
links), its weights are checked against their headers (dtype, presence, FP8 scales) before anything loads, and an
export claims its out_dir atomically and copies nothing from outside the folder. Each refusal is a PlanError (exit
2) naming the file, the tensor or field, what was found and what is expected; the bytes on disk are unchanged.

The rule on both sides: a plain folder's files (links between its own files allowed), and a Hugging Face cache
snapshot whose files are links into `blobs/` of its repo folder `models--*/`, load as before."""

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from bad_input_helpers import snapshot
from safetensors import safe_open
from safetensors.torch import save_file

from dsaflow.checkpoint.hf_config import hf_model, read_config_json
from dsaflow.checkpoint.hf_export import CLAIM, claim_out_dir, write_hf_checkpoint
from dsaflow.checkpoint.hf_weights import check_hf_weights, load_hf_weights
from dsaflow.cli import main
from dsaflow.config.compose import compose
from dsaflow.errors import CheckpointError, ConfigError, PlanError
from dsaflow.model import build_model
from tests.script_helpers import load_script

HF = load_script("hf_tiny_checkpoint")
INDEX = "model.safetensors.index.json"
SECRET = b"SECRET-token-do-not-copy"
FIXTURES = Path(__file__).parent / "fixtures" / "hf"


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    folder = HF.save_checkpoint("deepseek_v32", tmp_path_factory.mktemp("bf16") / "ckpt")
    HF.save_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def fp8(bf16, tmp_path_factory):
    return HF.write_fp8_copy(bf16, tmp_path_factory.mktemp("fp8") / "ckpt")


def weight_map(folder: Path) -> dict:
    return json.loads((folder / INDEX).read_text())["weight_map"]


def set_weight_map(folder: Path, wm: dict) -> None:
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": wm}))


def model_of(folder: Path):
    hf = hf_model(read_config_json(folder))
    return hf, build_model(hf.model, roles=hf.roles).float().eval()


def load(folder: Path, model_folder: Path = None):
    """(state_dict after loading, bytes read) of the model config.json of `model_folder` describes."""
    hf, model = model_of(model_folder or folder)
    nbytes = load_hf_weights({0: model}, folder, hf.model, report=lambda m: None)
    return model.state_dict(), nbytes


def refused(folder: Path, good: Path, *needles: str) -> str:
    """Loading `folder` raises a PlanError naming every needle, the stages untouched, the checkpoint's bytes (and
    the good copy's) unchanged; the header check the parent runs before workers refuses it the same way."""
    hf, model = model_of(good)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    disk = snapshot(folder.parent)
    with pytest.raises(PlanError) as e:
        check_hf_weights({0: model}, folder, hf.model)
    with pytest.raises(PlanError) as again:
        load_hf_weights({0: model}, folder, hf.model, report=lambda m: None)
    msg = str(e.value)
    assert str(again.value) == msg
    assert all(n in msg for n in needles) and "Fix:" in msg and "\n" not in msg, msg
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert snapshot(folder.parent) == disk
    return msg


# --- class 1: nothing outside the folder ---------------------------------------------------------------------------


def _outside_copy(good: Path, tmp_path: Path, how: str) -> Path:
    """A copy of `good` whose first shard is replaced by a reference to an identical shard outside the folder."""
    folder = tmp_path / "box" / "ckpt"
    shutil.copytree(good, folder)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    wm = weight_map(folder)
    shard = sorted(set(wm.values()))[0]
    shutil.move(folder / shard, outside / shard)
    if how == "absolute":
        set_weight_map(folder, {k: str(outside / shard) if v == shard else v for k, v in wm.items()})
    elif how == "dotdot":
        set_weight_map(folder, {k: f"../../elsewhere/{shard}" if v == shard else v for k, v in wm.items()})
    else:  # a link in the folder that leads outside
        os.symlink(outside / shard, folder / shard)
    return folder


@pytest.mark.parametrize("how", ["absolute", "dotdot", "link"])
def test_a_shard_outside_the_folder_is_never_opened(bf16, tmp_path, how):
    folder = _outside_copy(bf16, tmp_path, how)
    if how == "absolute":
        msg = refused(folder, bf16, INDEX, "not a file name relative to the checkpoint folder")
    else:
        msg = refused(folder, bf16, str(tmp_path / "elsewhere"), "outside", "neither read nor copied")
    shard = sorted(set(weight_map(bf16).values()))[0]
    first = next(k for k, v in weight_map(bf16).items() if v == shard)  # the first tensor the index puts there
    assert f"shard of tensor {first} in {INDEX}" in msg


def test_config_json_that_leads_outside_exits_2_without_showing_it(bf16, tmp_path, capsys):
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"model_type": "deepseek_v32", "token": SECRET.decode()}))
    folder = tmp_path / "ckpt"
    shutil.copytree(bf16, folder)
    (folder / "config.json").unlink()
    os.symlink(secret, folder / "config.json")
    assert main(["plan", "model=hf", f"model.hf_path={folder}"]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and "outside" in err and SECRET.decode() not in err and "Traceback" not in err


def test_a_fifo_or_folder_as_a_shard_is_refused_without_blocking(bf16, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(bf16, folder)
    shard = sorted(set(weight_map(folder).values()))[0]
    (folder / shard).unlink()
    os.mkfifo(folder / shard)
    refused(folder, bf16, shard, "a FIFO (named pipe), not a regular file")


def hf_cache_snapshot(src: Path, cache: Path, name: str = "models--org--tiny") -> Path:
    """`src` laid out as the Hugging Face cache does: every file a blob under models--org--tiny/blobs/, and
    snapshots/<rev>/<file> a relative link ../../blobs/<sha256>."""
    repo = cache / name
    snap = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo / "blobs" / digest)
        os.symlink(f"../../blobs/{digest}", snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return snap


def test_an_hf_cache_snapshot_loads_through_its_blob_links(bf16, fp8, tmp_path, capsys):
    for src in (bf16, fp8):
        snap = hf_cache_snapshot(src, tmp_path / src.parent.name / "hub")
        got, nbytes = load(snap)
        want, nbytes_direct = load(src)
        assert nbytes == nbytes_direct > 0
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert main(["plan", "model=hf", f"model.hf_path={snap}"]) == 0
    assert "model=hf: 3 layers" in capsys.readouterr().out


def test_an_hf_cache_snapshot_link_out_of_its_repo_folder_is_refused(bf16, tmp_path):
    snap = hf_cache_snapshot(bf16, tmp_path / "hub")
    other = hf_cache_snapshot(bf16, tmp_path / "hub", "models--other--repo")
    shard = sorted(set(weight_map(snap).values()))[0]
    (snap / shard).unlink()
    os.symlink(os.path.relpath(other / shard, snap), snap / shard)  # into another repo of the same cache
    refused(snap, bf16, shard, "outside", str(tmp_path / "hub" / "models--org--tiny"))


def test_an_index_entry_into_the_folder_s_own_subfolder_or_sibling_link_is_allowed(bf16, tmp_path):
    """Links and names that stay inside the folder are the folder's own files."""
    folder = tmp_path / "ckpt"
    shutil.copytree(bf16, folder)
    wm = weight_map(folder)
    first, second = sorted(set(wm.values()))[:2]
    (folder / "shards").mkdir()
    shutil.move(folder / first, folder / "shards" / first)
    shutil.move(folder / second, folder / "shards" / second)
    os.symlink(f"shards/{second}", folder / second)
    set_weight_map(folder, {k: f"shards/{first}" if v == first else v for k, v in wm.items()})
    got, _ = load(folder)
    want, _ = load(bf16)
    assert all(torch.equal(got[k], want[k]) for k in want)


# --- class 2: weights against their header -------------------------------------------------------------------------


def rewrite(folder: Path, name: str, make) -> str:
    """Replace tensor `name` in its shard by make(old tensor) (other tensors kept); returns the shard's file name."""
    shard = weight_map(folder)[name]
    with safe_open(str(folder / shard), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    new = make(tensors.pop(name))
    if new is not None:
        tensors[name] = new
    save_file(tensors, str(folder / shard), metadata={"format": "pt"})
    return shard


Q_B = "model.layers.1.self_attn.q_b_proj.weight"
EMBED = "model.embed_tokens.weight"


def as_int16(t):
    return (t.float() * 1000).to(torch.int16)


def as_e5m2(t):
    return t.float().to(torch.float8_e5m2)


def as_e4m3(t):
    return t.float().clamp(-448, 448).to(torch.float8_e4m3fn)


HEADER_BREAKS = [  # (checkpoint, tensor, new tensor, what the message names)
    ("bf16", EMBED, as_int16, ["stored as I16", "BF16, F16 or F32"]),
    ("bf16", Q_B, lambda t: t.to(torch.bool), ["stored as BOOL"]),
    ("bf16", Q_B, as_e4m3, ["stored as F8_E4M3", "needs config.json's quantization_config"]),
    ("fp8", Q_B, as_e5m2, ["stored as F8_E5M2", "or F8_E4M3 with 128x128 block scales"]),
    ("fp8", EMBED, as_e4m3, ["FP8 tensor", f"has no {EMBED}_scale_inv"]),  # e4m3 is read with its block scales
    ("fp8", Q_B + "_scale_inv", lambda t: torch.ones(7, 5), ["F32 [7, 5]", "F32 (or BF16 / F16) [1, 1]"]),
    ("fp8", Q_B + "_scale_inv", lambda t: t.to(torch.int32), ["I32 [1, 1]", "block scales"]),
    ("fp8", Q_B + "_scale_inv", lambda t: torch.full_like(t, float("nan")), ["holds nan", "finite and positive"]),
    ("fp8", Q_B + "_scale_inv", lambda t: torch.full_like(t, float("inf")), ["holds inf", "finite and positive"]),
    ("fp8", Q_B + "_scale_inv", lambda t: torch.zeros_like(t), ["holds 0.0", "finite and positive"]),
    ("fp8", Q_B, lambda t: None, ["lists tensor " + Q_B, "holds no such tensor"]),
]


@pytest.mark.parametrize("which, name, make, needles", HEADER_BREAKS, ids=lambda x: getattr(x, "__name__", None))
def test_a_tensor_unlike_its_header_s_promise_is_refused_before_loading(request, tmp_path, which, name, make, needles):
    good = request.getfixturevalue(which)
    folder = tmp_path / "bad"
    shutil.copytree(good, folder)
    shard = rewrite(folder, name, make)
    refused(folder, good, shard, name.removesuffix("_scale_inv"), *needles)


@pytest.mark.parametrize(
    "value, needles",
    [
        (7, ["weight_map[", "=7 is not a shard file name"]),
        (["a.safetensors"], ['=["a.safetensors"] is not a shard file name']),
        (None, ["=null is not a shard file name"]),
        ({"file": "x"}, ['={"file": "x"}']),
    ],
)
def test_a_weight_map_value_that_is_not_a_string_is_refused(bf16, tmp_path, value, needles):
    folder = tmp_path / "bad"
    shutil.copytree(bf16, folder)
    wm = weight_map(folder)
    wm[Q_B] = value
    set_weight_map(folder, wm)
    refused(folder, bf16, INDEX, Q_B, *needles)


@pytest.mark.parametrize("index", [[], {"weight_map": [1]}, {"weight_map": "x"}, {}, "weights"])
def test_an_index_without_a_weight_map_object_is_refused(bf16, tmp_path, index):
    folder = tmp_path / "bad"
    shutil.copytree(bf16, folder)
    (folder / INDEX).write_text(json.dumps(index))
    refused(folder, bf16, INDEX, "weight_map")


# --- class 1 and 5: export ------------------------------------------------------------------------------------------


def source_folder(tmp_path: Path, bf16: Path) -> Path:
    """The model.hf_path of an export: the tiny checkpoint's config and tokenizer files."""
    folder = tmp_path / "src"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bf16 / name, folder / name)
    return folder


def tiny_moe(hf_path: Path):
    cfg = compose(["model=tiny_moe"]).model
    cfg.hf_path = str(hf_path)
    return cfg, build_model(cfg, seed=1).state_dict()


def test_export_copies_tokenizer_files_and_refuses_one_that_leads_outside(bf16, tmp_path):
    src = source_folder(tmp_path, bf16)
    cfg, state = tiny_moe(src)
    write_hf_checkpoint(state, cfg, tmp_path / "good", report=lambda m: None)
    assert (tmp_path / "good" / "tokenizer.json").read_bytes() == (bf16 / "tokenizer.json").read_bytes()
    assert not (tmp_path / "good" / CLAIM).exists()
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    os.symlink(secret, src / "generation_config.json")
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError, match="generation_config.json .* leads to .*secret, outside") as e:
        write_hf_checkpoint(state, cfg, tmp_path / "out", report=lambda m: None)
    assert SECRET.decode() not in str(e.value)
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()


def test_export_from_an_hf_cache_snapshot_copies_the_blobs_contents(bf16, tmp_path):
    snap = hf_cache_snapshot(source_folder(tmp_path, bf16), tmp_path / "hub")
    cfg, state = tiny_moe(snap)
    write_hf_checkpoint(state, cfg, tmp_path / "out", report=lambda m: None)
    out = tmp_path / "out" / "tokenizer.json"
    assert not out.is_symlink() and out.read_bytes() == (bf16 / "tokenizer.json").read_bytes()


def test_a_second_export_into_a_claimed_or_filled_out_dir_exits_2(bf16, tmp_path):
    cfg, state = tiny_moe(source_folder(tmp_path, bf16))
    out = tmp_path / "out"
    claim_out_dir(out)  # another export is writing here
    with pytest.raises(ConfigError, match="being written by another export"):
        write_hf_checkpoint(state, cfg, out, report=lambda m: None)
    assert sorted(os.listdir(out)) == [CLAIM]
    os.unlink(out / CLAIM)
    write_hf_checkpoint(state, cfg, out, report=lambda m: None)
    done = snapshot(out)
    with pytest.raises(ConfigError, match="is not empty"):
        write_hf_checkpoint(state, cfg, out, report=lambda m: None)
    assert snapshot(out) == done


def test_two_racing_exports_one_wins_whole_and_the_other_exits_2(bf16, tmp_path):
    src = source_folder(tmp_path, bf16)
    out = tmp_path / "out"
    cfg = compose(["model=tiny_moe"]).model  # composed here: Hydra's global state is not for threads
    cfg.hf_path = str(src)
    states = {seed: build_model(cfg, seed=seed).state_dict() for seed in (1, 2)}
    results, start = {}, threading.Barrier(2, timeout=60)

    def export(seed: int) -> None:
        start.wait()
        try:
            write_hf_checkpoint(states[seed], cfg, out, report=lambda m: None)
            results[seed] = "ok"
        except PlanError as exc:
            results[seed] = str(exc)

    threads = [threading.Thread(target=export, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    winners = [s for s, r in results.items() if r == "ok"]
    assert len(winners) == 1, results
    loser = results[3 - winners[0]]
    assert "export.out_dir" in loser and ("another export" in loser or "not empty" in loser), loser
    want = states[winners[0]]["embed.weight"]
    with safe_open(str(out / weight_map(out)["model.embed_tokens.weight"]), "pt") as f:
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"), want)  # the winner's bytes, whole
    assert not (out / CLAIM).exists()


def test_a_failure_while_writing_leaves_nothing_and_an_unwritable_out_dir_exits_2(bf16, tmp_path, monkeypatch):
    import dsaflow.checkpoint.hf_export as hf_export

    cfg, state = tiny_moe(source_folder(tmp_path, bf16))

    def disk_full(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_export, "atomic_write", disk_full)
    with pytest.raises(OSError):
        write_hf_checkpoint(state, cfg, tmp_path / "out", report=lambda m: None)
    assert not (tmp_path / "out").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(OSError):
        write_hf_checkpoint(state, cfg, tmp_path / "empty", report=lambda m: None)
    assert os.listdir(tmp_path / "empty") == []  # a folder it did not create is kept, emptied of its files
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="export.out_dir=/dev/null/x has a file where a folder should be"):
        write_hf_checkpoint(state, cfg, "/dev/null/x", report=lambda m: None)


# --- export against the run's checkpoint rotation -------------------------------------------------------------------


@pytest.fixture
def run_with_two_checkpoints(tmp_path):
    """A tiny_moe run dir with checkpoints step 1 (weights of seed 1) and step 2 (seed 2)."""
    from dsaflow.checkpoint.training_state import save_checkpoint
    from dsaflow.pipeline.stages import stage_module
    from dsaflow.plan import build_plan, render_table
    from dsaflow.rundir.folder import checkpoint_dir, write_run_dir

    run = tmp_path / "run"
    cfg = compose(["model=tiny_moe", "track=none", f"run_dir={run}"])
    plan = build_plan(cfg)
    write_run_dir(cfg, plan, render_table(plan, cfg))
    embeds = {}
    for step in (1, 2):
        module = stage_module(cfg.model, plan, 0, seed=step)
        assert save_checkpoint(checkpoint_dir(run, step), [module], None, 0, step)
        embeds[step] = module.state_dict()["embed.weight"].clone()
    return run, embeds


def _prune_after_resolving(monkeypatch):
    """Rotation striking between export's choice of a checkpoint and its pin: the first one resolved is removed."""
    from dsaflow.checkpoint import export_run
    from dsaflow.checkpoint.store import remove_checkpoint

    real, pruned = export_run.resolve_checkpoint, []

    def resolve_then_prune(path, **kw):
        found = real(path, **kw)
        if not pruned:
            pruned.append(found)
            assert remove_checkpoint(found)
        return found

    monkeypatch.setattr(export_run, "resolve_checkpoint", resolve_then_prune)
    return pruned


def test_export_of_a_run_takes_the_next_checkpoint_when_rotation_prunes_the_newest(
    run_with_two_checkpoints, tmp_path, monkeypatch
):
    from dsaflow.checkpoint.export_run import export_hf
    from dsaflow.rundir.folder import checkpoint_dir

    run, embeds = run_with_two_checkpoints
    pruned = _prune_after_resolving(monkeypatch)
    export_hf(str(run), str(tmp_path / "hf"))
    assert pruned == [checkpoint_dir(run, 2)] and not pruned[0].exists()
    with safe_open(str(tmp_path / "hf" / weight_map(tmp_path / "hf")["model.embed_tokens.weight"]), "pt") as f:
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"), embeds[1])  # step 1's weights, whole


def test_export_of_a_checkpoint_folder_pruned_while_opened_exits_2(run_with_two_checkpoints, tmp_path, monkeypatch):
    from dsaflow.checkpoint.export_run import export_hf
    from dsaflow.rundir.folder import checkpoint_dir

    run, _ = run_with_two_checkpoints
    _prune_after_resolving(monkeypatch)
    with pytest.raises(CheckpointError, match=r"export.checkpoint=.*step-000001: checkpoint .* was removed \(pruned\)"):
        export_hf(str(checkpoint_dir(run, 1)), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


def test_pinning_a_checkpoint_removed_under_the_lock_is_refused(run_with_two_checkpoints, tmp_path):
    from dsaflow.checkpoint.store import CheckpointGone, pinned
    from dsaflow.rundir.folder import checkpoint_dir

    run, _ = run_with_two_checkpoints
    ckpt = checkpoint_dir(run, 2)
    with pinned(ckpt):
        pass  # a checkpoint in place pins
    os.rename(ckpt, tmp_path / "moved")  # what pruning does before deleting
    with pytest.raises(CheckpointGone, match="was removed"):
        with pinned(ckpt):
            pass
