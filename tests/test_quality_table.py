"""scripts/quality_table.py: its CPU preset end to end (train, search, every4, results JSON, resume, collect), the
time budget, the paired statistics of collect, and the GPU recipes composing into runnable configs."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math

import pytest
from script_helpers import load_script

from dsaflow.config.compose import compose
from dsaflow.data import BatchSource
from dsaflow.plan import build_plan

qt = load_script("quality_table")
ROW_FIELDS = {"task", "seed", "pattern", "roles", "num_f", "loss", "acc", "train", "eval_batches", "recipe"}


# The CPU preset's `run` with a two-stage curriculum (`--pre-stage`, as the GPU recipe trains retrieval_long) and the
# continued row: every row of the table, each from a real `dsaflow train` / `dsaflow search` / eval-run subprocess
# (seconds of imports each). The first call stops at the every4 step (as at a time budget), the second finishes it,
# the third has nothing to do; then collect. Both tests below read this one sequence, run once.
CURRICULUM_STAGES = ["--pre-stage", "2:48", "--pre-stage", "2:56"]


@pytest.fixture(scope="module")
def preset_run(tmp_path_factory):
    """-> {out, logs: the three `run` calls' stdout, rcs, results (row files after the second call with their mtimes),
    curriculum dirs and whether each was finished after the first call, collect's JSON and markdown}."""
    tmp = tmp_path_factory.mktemp("quality")
    out = tmp / "q"
    run = ["run", "--device", "cpu", "--seeds", "0", "--out", str(out), "--continued-steps", "2", *CURRICULUM_STAGES]
    curriculum = [out / "runs" / f"retrieval_long-s0-{qt.CURRICULUM}-pre{i}" for i in (0, 1)]
    got: dict = {"out": out, "curriculum": curriculum, "logs": [], "rcs": []}
    real_every4 = qt.STEPS["every4"]
    buf = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(buf):
        mp.setitem(qt.STEPS, "every4", (lambda *args: False, real_every4[1]))  # stopped, e.g. at the budget
        got["rcs"].append(qt.main(run))
    got["logs"].append(buf.getvalue())
    got["finished_after_stop"] = [qt.finished(d) for d in curriculum]
    for _ in range(2):  # the rest of the work, then nothing left to do
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            got["rcs"].append(qt.main(run))
        got["logs"].append(buf.getvalue())
        if len(got["logs"]) == 2:
            files = sorted((out / "results").glob("*.json"))
            got["stamps"] = {f.name: f.stat().st_mtime_ns for f in files}
    md = tmp / "quality.md"
    md.write_text(f"# title\n\n{qt.BEGIN}\nold table\n{qt.END}\n\nafter\n")
    got["collect_rc"] = qt.main(["collect", str(out), "--json", str(tmp / "q.json"), "--md", str(md)])
    got["collected"] = json.loads((tmp / "q.json").read_text())["rows"]
    got["md"] = md.read_text()
    return got


def test_cpu_preset_end_to_end_then_resume_and_collect(preset_run):
    """Every row of the table from the CPU preset (`preset_run`); a rerun once all is done trains and rewrites
    nothing; collect merges the rows into the JSON and the markdown between its markers."""
    out = preset_run["out"]
    assert preset_run["rcs"] == [qt.EXIT_WORK_LEFT, 0, 0]
    files = sorted((out / "results").glob("*.json"))
    assert [f.name for f in files] == sorted(f"retrieval_long-s0-{qt.slug(p)}.json" for p in qt.ORDER)
    rows = {r["pattern"]: r for r in (json.loads(f.read_text()) for f in files)}
    for r in rows.values():
        assert ROW_FIELDS <= set(r) and r["task"] == "retrieval_long" and r["seed"] == 0
        assert math.isfinite(r["loss"]) and 0.0 <= r["acc"] <= 1.0 and r["num_f"] == r["roles"].count("F")
        assert r["train"]["step"] == (2 if r["pattern"] == "every4 continued" else 4)  # its final evaluation came along
    assert rows["all-F"]["roles"] == "F" * 8 and rows["uniform 1/4"]["roles"] == "FSSSFSSS"
    assert rows["every4 trained"]["roles"] == "FSSSFSSS" and rows["searched 1/4"]["num_f"] == 2
    cont = rows["every4 continued"]  # the all-F model trained on with every4 (train.init_from), 2 more steps
    assert cont["roles"] == "FSSSFSSS" and cont["train"]["step"] == 2
    assert any(o.startswith("train.init_from=") and o.endswith("all_full") for o in cont["overrides"])
    assert not list(out.glob("runs/*/checkpoints")), "checkpoints are deleted once a step's rows are written"
    assert set(json.loads((out / "timings.json").read_text())) == {"retrieval_long/base", "retrieval_long/every4"}

    log = preset_run["logs"][2]  # resume: nothing to do
    assert "retrieval_long s0 base: done already" in log and "retrieval_long s0 every4: done already" in log
    assert "training" not in log and {f.name: f.stat().st_mtime_ns for f in files} == preset_run["stamps"]

    assert preset_run["collect_rc"] == 0
    got = preset_run["collected"]
    assert [r["pattern"] for r in got] == list(qt.ORDER)
    for r in got:
        assert {"pattern", "task", "seeds", "acc_mean", "acc_sd", "loss_mean", "loss_sd"} <= set(r)
        assert r["seeds"] == [0] and r["acc_sd"] is None  # one seed: no spread to report
    doc = preset_run["md"]
    assert "old table" not in doc and doc.startswith("# title") and doc.rstrip().endswith("after")
    assert "| every4 trained | 1 |" in doc and "| every4 continued | 1 |" in doc


def test_budget_stops_before_a_step_that_cannot_finish(tmp_path, capsys):
    rc = qt.main(["run", "--device", "cpu", "--seeds", "0", "--out", str(tmp_path), "--budget-s", "5"])
    assert rc == qt.EXIT_WORK_LEFT
    log = capsys.readouterr().out
    assert "s0 base: not started, " in log and "2 step(s) left" in log and not (tmp_path / "runs").exists()


def test_parallel_steps_map_to_gpus_per_gpu_at_a_time(tmp_path, capsys, monkeypatch):
    """--parallel N over the visible GPUs, --per-gpu steps sharing each: too few GPUs exits 2 before any run and
    says both fixes; enough slots run each step with the GPU of its slot."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    args = ["run", "--device", "cuda", "--seeds", "0", "--out", str(tmp_path), "--parallel", "2"]
    assert qt.main(args) == 2
    err = capsys.readouterr().err
    assert "needs 2 GPUs at --per-gpu 1" in err and "raise --per-gpu" in err and not (tmp_path / "runs").exists()
    seen = []
    monkeypatch.setitem(
        qt.STEPS, "base", (lambda a, r, out, task, seed, budget, env: seen.append(env) or True, ("all-F",))
    )
    monkeypatch.setitem(
        qt.STEPS, "every4", (lambda a, r, out, task, seed, budget, env: seen.append(env) or True, ("all-F",))
    )
    assert qt.main([*args, "--per-gpu", "2"]) == 0
    assert seen == [{"CUDA_VISIBLE_DEVICES": "3"}] * 2


def _row(task, seed, pattern, loss, acc=None):
    r = {"task": task, "seed": seed, "pattern": pattern, "roles": "FS", "num_f": 1, "loss": loss, "acc": acc}
    if task == "text":
        r["bpb"] = loss / math.log(2)
    return r


def test_collect_pairs_each_pattern_with_all_f_of_the_same_seed(tmp_path):
    for d, rows in {
        "a": [_row("retrieval_long", 0, "all-F", 1.0, 0.90), _row("retrieval_long", 0, "uniform 1/4", 1.5, 0.80)],
        "b": [_row("retrieval_long", 1, "all-F", 2.0, 0.70), _row("retrieval_long", 1, "uniform 1/4", 2.1, 0.66)],
        "c": [_row("text", 0, "all-F", 1.0), _row("text", 0, "searched 1/4", 1.2)],
    }.items():
        (tmp_path / d / "results").mkdir(parents=True)
        for r in rows:
            (tmp_path / d / "results" / f"{r['task']}-s{r['seed']}-{qt.slug(r['pattern'])}.json").write_text(
                json.dumps(r)
            )
    got = {(r["task"], r["pattern"]): r for r in qt.collect_rows([tmp_path / d for d in "abc"])}
    u = got[("retrieval_long", "uniform 1/4")]
    assert u["seeds"] == [0, 1] and u["acc_mean"] == pytest.approx(0.73)
    assert u["acc_sd"] == pytest.approx(math.sqrt(2 * 0.07**2))
    assert u["d_acc_points_mean"] == pytest.approx(-7.0) and u["d_acc_points_sd"] == pytest.approx(math.sqrt(18))
    assert u["d_loss_mean"] == pytest.approx(0.3) and "bpb_mean" not in u
    t = got[("text", "searched 1/4")]
    assert t["bpb_mean"] == pytest.approx(1.2 / math.log(2)) and t["d_bpb_mean"] == pytest.approx(0.2 / math.log(2))
    assert t["acc_mean"] is None


@pytest.mark.parametrize("task", ["retrieval_long", "text"])
def test_gpu_recipes_compose_plan_and_make_batches(task, tmp_path):
    """The commands `run --device cuda` issues are valid configs whose data holds the task (no GPU needed): the
    curriculum's stages (retrieval_long) and the task-length runs."""
    a = argparse.Namespace(device="cuda", preset=None, text_path=None, track="none", set=[], every4_steps=None)
    for k in ("steps", "seq_len", "topk", "batch_size", "lr", "warmup", "eval_batches", "calib_batches"):
        setattr(a, k, None)
    a.task, a.pre_stages = task, None
    r = qt.recipe(a)
    for st in r["pre_stages"]:  # each stage dense at its own length, its overrides last (as pre_stages() runs it)
        rs = dict(r, seq_len=st["seq_len"], topk=st["seq_len"])
        cfg = compose(qt.train_overrides(a, rs, task, 0, "all_full", tmp_path / "pre", 2) + st["overrides"])
        assert build_plan(cfg).num_layers == 12 and cfg.model.index_topk == cfg.train.seq_len == st["seq_len"]
        x, _ = BatchSource(cfg.data, cfg.train.seq_len, 2, 0, cfg.model.vocab_size).val_batch(0)
        assert x.shape == (2, st["seq_len"])
    if task == "retrieval_long":
        first, last = r["pre_stages"][0], r["pre_stages"][-1]
        assert "data.copy_chars=mixed" in first["overrides"] and last["seq_len"] == r["seq_len"]
    else:
        assert r["pre_stages"] == []
    a.pre_stages = [None]  # `--pre-stage none`
    assert qt.recipe(a)["pre_stages"] == []
    for index in ("all_full", "every4"):
        cfg = compose(qt.train_overrides(a, r, task, 0, index, tmp_path / "run", r["steps"]))
        plan = build_plan(cfg)
        assert plan.num_layers == 12 and cfg.model.index_topk * 16 == cfg.train.seq_len  # 1/16 of the keys
        data = BatchSource(cfg.data, cfg.train.seq_len, 2, 0, cfg.model.vocab_size)
        x, y = data.val_batch(0)
        assert x.shape == (2, cfg.train.seq_len)
    if task == "text":
        assert data.corpus.ranges[1][1] - data.corpus.ranges[1][0] > 100_000  # held-out stdlib files
    else:
        assert int((y[:, 1] != -100).sum()) == 2 * 4  # 4 queries x 1 answer digit per sequence


@pytest.mark.gpu
def test_cpu_sized_preset_end_to_end_on_cuda(tmp_path):
    """The GPU path of the script (bf16 training, search and eval on cuda, wandb offline) at the CPU preset's size."""
    out = tmp_path / "q"
    args = ["run", "--device", "cuda", "--preset", "cpu", "--seeds", "0", "--out", str(out), "--track", "offline"]
    args += ["--continued-steps", "2"]  # every row of the table, the continued one included
    assert qt.main(args) == 0
    rows = [json.loads(f.read_text()) for f in sorted((out / "results").glob("*.json"))]
    assert sorted(r["pattern"] for r in rows) == sorted(qt.ORDER)
    assert all(math.isfinite(r["loss"]) and 0.0 <= r["acc"] <= 1.0 for r in rows)
    assert list(out.glob("runs/*/wandb/offline-run-*")), "the trainings logged to wandb offline"


def test_probe_pre_stages_chain_then_task_length_from_the_last(tmp_path, capsys):
    """--pre-stage twice: two dense short runs, each from the previous one's weights and with its own overrides,
    then the task-length run from the last (train.init_from); the pre-stage run dirs are gone once the probe is
    done, their logs stay."""
    from omegaconf import OmegaConf

    out = tmp_path / "p"
    stages = ["--pre-stage", "2:32:data.num_pairs=2 data.num_queries=1 data.copy_len=8", "--pre-stage", "2:48"]
    assert qt.main(["probe", "--device", "cpu", "--out", str(out), "--steps", "2", *stages]) == 0
    log = capsys.readouterr().out
    assert (
        "pre-stage 0 index=all_full, 2 steps at 32 tokens" in log and "pre-stage 1 index=all_full, 2 steps at 48" in log
    )
    assert "done; {'step': 2" in log
    (main_dir,) = [d for d in (out / "runs").iterdir() if d.is_dir()]
    cfg = OmegaConf.load(main_dir / "config.yaml")
    assert cfg.train.init_from == f"{main_dir}-pre1" and cfg.train.seq_len == 64 and cfg.model.index_topk == 8
    assert cfg.data.num_pairs == 8 and cfg.data.copy_len == 0  # the task's data, not the first stage's
    for i in (0, 1):
        assert not (out / "runs" / f"{main_dir.name}-pre{i}").exists()
        assert (out / "runs" / f"{main_dir.name}-pre{i}.log").is_file()
    first = (out / "runs" / f"{main_dir.name}-pre0.log").read_text()
    second = (out / "runs" / f"{main_dir.name}-pre1.log").read_text()
    assert "data.copy_len=8" in first and f"train.init_from={main_dir}-pre0" in second


def test_run_shares_one_curriculum_per_seed_and_keeps_it_across_an_interruption(preset_run):
    """`run --pre-stage` (`preset_run`): the all-F and every4 models of a seed start from the same curriculum,
    trained once. A step that stops leaves the finished pre-stages in place; the rerun reuses them, and they go once
    the seed is done. The continued row trains on from the all-F model, not from the curriculum."""
    from omegaconf import OmegaConf

    out, curriculum = preset_run["out"], preset_run["curriculum"]
    log = preset_run["logs"][0]
    assert preset_run["rcs"][0] == qt.EXIT_WORK_LEFT
    assert log.count("pre-stage 0 index=all_full") == 1 and log.count("pre-stage 1 index=all_full") == 1
    assert preset_run["finished_after_stop"] == [True, True], "the finished pre-stages outlive the interruption"

    log = preset_run["logs"][1]
    assert preset_run["rcs"][1] == 0
    assert "pre-stage" not in log and "training index=every4" in log
    for index in ("all_full", "every4"):
        cfg = OmegaConf.load(out / "runs" / f"retrieval_long-s0-{index}" / "config.yaml")
        assert cfg.train.init_from == str(curriculum[1]) and cfg.train.seq_len == 64
    cfg = OmegaConf.load(out / "runs" / "retrieval_long-s0-every4_continued" / "config.yaml")
    assert cfg.train.init_from == str(out / "runs" / "retrieval_long-s0-all_full")
    assert not any(d.exists() for d in curriculum) and not list(out.glob("runs/*/checkpoints"))


@pytest.mark.parametrize("bad", ["64", "x:64", "0:64", "10:1"])
def test_a_malformed_pre_stage_exits_2(bad, capsys):
    with pytest.raises(SystemExit) as e:
        qt.main(["probe", "--device", "cpu", "--pre-stage", bad])
    assert e.value.code == 2 and "--pre-stage" in capsys.readouterr().err
