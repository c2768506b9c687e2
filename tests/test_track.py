"""Tracking: the null object for `track=none` and non-logging ranks, wandb offline writing into the run dir,
and the progress display (lines when not a terminal)."""

from __future__ import annotations

import io

from dsaflow.config.schema import DSAFlowConfig
from dsaflow.track import NullTracker, Progress, make_tracker


def _cfg(**track) -> DSAFlowConfig:
    cfg = DSAFlowConfig()
    for k, v in track.items():
        setattr(cfg.track, k, v)
    return cfg


def test_null_tracker_for_none_disabled_and_other_ranks(tmp_path):
    assert isinstance(make_tracker(_cfg(backend="none"), str(tmp_path), True), NullTracker)
    assert isinstance(make_tracker(_cfg(mode="disabled"), str(tmp_path), True), NullTracker)
    assert isinstance(make_tracker(_cfg(), str(tmp_path), is_logging_rank=False), NullTracker)
    t = NullTracker()
    t.log_config({"a": 1}, {"b": 2})
    t.log({"loss": 1.0}, step=1)
    t.finish()
    assert list(tmp_path.iterdir()) == []


def test_wandb_offline_writes_its_run_into_the_run_dir(tmp_path):
    cfg = _cfg(run_name="unit")
    tracker = make_tracker(cfg, str(tmp_path), is_logging_rank=True)
    tracker.log_config({"train": {"lr": 0.1}}, {"num_layers": 2})
    for step in (1, 2):
        tracker.log({"loss": 1.0 / step, "tokens_per_s": 10.0}, step=step)
    tracker.finish()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    wandb_file = list(runs[0].glob("run-*.wandb"))
    assert len(wandb_file) == 1 and wandb_file[0].stat().st_size > 0
    run_id = (tmp_path / "wandb" / "run_id").read_text()
    assert wandb_file[0].name == f"run-{run_id}.wandb"
    # a resumed attempt continues the same wandb run id
    again = make_tracker(cfg, str(tmp_path), is_logging_rank=True, resume=True)
    assert again.run_id == run_id
    again.finish()


def test_progress_prints_lines_when_not_a_tty():
    buf = io.StringIO()
    p = Progress(total=4, mode="auto", stream=buf)
    assert p.mode == "lines"
    for step in range(1, 5):
        p.update(step, {"loss": 2.0 / step, "acc": 0.5}, print_line=step % 2 == 0)
    p.close()
    lines = buf.getvalue().splitlines()
    assert lines == ["step 2/4 loss=1 acc=0.5", "step 4/4 loss=0.5 acc=0.5"]
    off = io.StringIO()
    q = Progress(total=4, enabled=False, stream=off)
    q.update(1, {"loss": 1.0}, print_line=True)
    assert off.getvalue() == ""


def test_rich_progress_keeps_eval_history_and_fits_120_columns(monkeypatch):
    import io

    from dsaflow.track import Progress

    monkeypatch.setenv("COLUMNS", "120")
    buf = io.StringIO()
    p = Progress(300, mode="rich", stream=buf)
    for step in range(1, 301):
        m = {
            "loss": 2.0 - step / 300,
            "acc": step / 300,
            "tokens_per_s": 5512.3,
            "indexer_loss": 0.01,
            "lr": 3e-3,
            "mfu": 0.1,
        }
        if step % 100 == 0:
            m.update(eval_loss=1.5, eval_acc=step / 400)
        p.update(step, m, print_line=True)
    p.close()
    lines = buf.getvalue().splitlines()
    evals = [l for l in lines if "eval_acc" in l]
    assert [l.split()[1] for l in evals] == ["100/300", "200/300", "300/300"]  # every eval stays on screen, in order
    assert "eval_acc=0.25" in evals[0] and "eval_acc=0.75" in evals[2]
    assert max(len(l) for l in lines) <= 120
