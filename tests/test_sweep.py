"""`dsaflow ... -m`: Hydra's sweeper and launcher run one job per combination, each planned and launched on its own;
a failing job is recorded and the sweep goes on; the summary lands in the sweep dir. Also the Hydra flags
(--cfg, --info, --help) and the single-run handling of sweep syntax and hydra.* overrides. Processes are never
started here: `launch` is replaced by a fake that writes a metrics.jsonl (the real path is test_launch.py's)."""

import csv
import json
from pathlib import Path

import pytest

from dsaflow import cli
from dsaflow.config.compose import quote_layout_overrides


@pytest.fixture
def fake_launch(monkeypatch, tmp_path):
    """cwd = tmp_path; launch(cfg, plan, job) records the call, writes 2 metric records, fails for index=every4."""
    import dsaflow.launch.launch as launch_mod

    monkeypatch.chdir(tmp_path)
    calls = []

    def fake(cfg, plan, job):
        calls.append((cfg, plan, job))
        rd = Path(cfg.run_dir or "runs/single")
        rd.mkdir(parents=True, exist_ok=True)
        recs = [
            {"step": 1, "loss": 3.0, "indexer_loss": 0.5, "tokens_per_s": 100.0},
            {
                "step": 2,
                "loss": 2.5 - cfg.train.lr,
                "indexer_loss": 0.25,
                "tokens_per_s": 120.0,
                "eval_loss": 2.4,
                "eval_acc": 0.5,
            },
        ]
        (rd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        return 3 if cfg.index.name == "every4" else 0

    monkeypatch.setattr(launch_mod, "launch", fake)
    return calls


def test_multirun_runs_every_job_and_writes_the_summary(fake_launch, tmp_path, capsys):
    code = cli.main(
        ["train", "-m", "index=all_full,every4", "train.lr=1e-3,3e-3", "train.steps=2", "hydra.sweep.dir=sw"]
    )
    out = capsys.readouterr().out
    assert code == 1  # a job failed: reported, not fatal
    assert len(fake_launch) == 4
    dirs = [Path(c[0].run_dir) for c in fake_launch]
    assert len(set(dirs)) == 4 and all(d.parent == (tmp_path / "sw").resolve() for d in dirs)
    assert {c[0].track.group for c in fake_launch} == {"sw"}
    assert [c[0].train.steps for c in fake_launch] == [2, 2, 2, 2]
    rows = list(csv.DictReader((tmp_path / "sw" / "summary.csv").open()))
    assert [r["index"] for r in rows] == ["all_full", "all_full", "every4", "every4"]
    assert [r["train.lr"] for r in rows] == ["0.001", "0.003", "0.001", "0.003"]  # as Hydra writes them
    assert "train.steps" not in rows[0]  # the same in every job: not a column
    assert [r["status"] for r in rows] == ["ok", "ok", "failed (exit 3)", "failed (exit 3)"]
    assert rows[0]["loss"] == "2.499" and rows[0]["eval_acc"] == "0.5" and rows[0]["tokens_per_s"] == "120"
    assert (tmp_path / "sw" / "summary.md").read_text().count("\n| ") >= 5
    assert (tmp_path / "sw" / "multirun.yaml").is_file()
    assert "2/4 jobs ok" in out and "| every4 | 0.003 |" in out


def test_a_plan_error_in_one_job_does_not_stop_the_sweep(fake_launch, tmp_path, capsys):
    code = cli.main(["train", "-m", "pipeline.stages=9,1", "hydra.sweep.dir=sw"])
    cap = capsys.readouterr()
    assert code == 1 and len(fake_launch) == 1 and fake_launch[0][1].num_stages == 1
    rows = list(csv.DictReader((tmp_path / "sw" / "summary.csv").open()))
    assert [r["status"] for r in rows] == ["plan error", "ok"]
    assert "pipeline.stages=9 is more than" in cap.err and "Traceback" not in cap.err


def test_ranges_and_layout_sweeps(fake_launch, capsys):
    assert cli.main(["plan", "-m", "train.seed=range(0,3)", "hydra.sweep.dir=sw"]) == 0
    assert fake_launch == []  # plan jobs print, they launch nothing
    assert capsys.readouterr().out.count("stages") >= 3
    assert cli.main(["train", "-m", "layout=FSSS|SSFS,FFFF|FSFS", "hydra.sweep.dir=sw2"]) == 0
    assert [[l.role for l in c[1].layers] for c in fake_launch] == [list("FSSSFSFS"), list("FFFFFSFS")]


def test_plan_sweeps_leave_nothing_on_disk(fake_launch, tmp_path, capsys):
    assert cli.main(["plan", "-m", "index=all_full,every4"]) == 0
    assert cli.main(["plan", "-m", "train.seed=0,1", "hydra.sweep.dir=sw"]) == 0
    assert list(tmp_path.iterdir()) == []  # no job folders, no multirun.yaml, no summary of blank columns
    out = capsys.readouterr().out
    assert "planned 2/2 jobs" in out and "summary" not in out and "| loss |" not in out


def test_the_summary_names_a_wandb_group_only_when_jobs_track_with_wandb(fake_launch, capsys):
    assert cli.main(["train", "-m", "train.seed=0,1", "track=none", "hydra.sweep.dir=sw"]) == 0
    assert "wandb group" not in capsys.readouterr().out
    assert cli.main(["train", "-m", "train.seed=0,1", "hydra.sweep.dir=sw2"]) == 0
    assert "(wandb group sw2)" in capsys.readouterr().out


def test_metric_columns_no_job_has_are_left_out(tmp_path):
    from dsaflow.app import JobResult
    from dsaflow.track.sweep_summary import summary_rows

    served = [JobResult(i, [f"serve.seed={i}"], str(tmp_path / str(i)), "ok", 0) for i in range(2)]
    assert list(summary_rows(served)[0]) == ["job", "serve.seed", "status", "run_dir"]


def test_a_mistake_in_any_job_stops_the_sweep_before_it_starts(fake_launch, tmp_path, capsys):
    assert cli.main(["train", "-m", "model=tiny,huge", "hydra.sweep.dir=sw"]) == 2
    err = capsys.readouterr().err
    assert "no option 'huge'" in err and "Fix:" in err
    assert fake_launch == [] and not (tmp_path / "sw").exists()
    for bad, needle in (
        (["run_dir=x"], "every job of the sweep into one run dir"),
        (["hydra.run.dir=x"], "hydra.sweep.dir"),
        (["hydra.job.chdir=true"], "relative"),
    ):
        assert cli.main(["train", "-m", "index=all_full,every4", *bad]) == 2
        assert needle in capsys.readouterr().err


def test_single_run_sweep_syntax_and_hydra_overrides(fake_launch, capsys):
    assert cli.main(["train", "train.lr=1e-3,3e-3"]) == 2
    err = capsys.readouterr().err
    assert err.count("dsaflow: error:") == 1 and "add -m (--multirun)" in err and "train.lr=[a,b]" in err
    assert cli.main(["train", "hydra.run.dir=mine"]) == 0
    assert fake_launch[-1][0].run_dir == "mine"
    assert cli.main(["train", "hydra.sweep.dir=x"]) == 2
    assert "add -m" in capsys.readouterr().err
    assert cli.main(["train", "hydra.verbose=true"]) == 2
    assert "silently ignored" in capsys.readouterr().err
    assert cli.main(["train", "--bogus"]) == 2
    assert "unrecognized option '--bogus'" in capsys.readouterr().err


def test_hydra_flags(capsys):
    assert cli.main(["plan", "--cfg", "job", "model=small"]) == 0
    out = capsys.readouterr().out
    assert "num_layers: 12" in out and "hydra:" not in out
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "dsaflow train -m index=all_full,every4" in out and "--multirun" in out and "--nproc" in out
    assert "dsaflow plan" not in out  # train examples, not plan examples
    assert cli.main(["--version"]) == 0 and capsys.readouterr().out.startswith("dsaflow 0.")
    assert cli.main(["plan", "--format", "json", "model=tiny"]) == 0
    assert json.loads(capsys.readouterr().out)["num_layers"] == 8
    assert cli.main(["train", "--info", "defaults"]) == 0  # last: Hydra's --info leaves its logging verbose
    assert "model/tiny" in capsys.readouterr().out


def test_layout_values_are_quoted_part_by_part():
    assert quote_layout_overrides(["layout=FSSS|SSFS,FFFF|FFFF"]) == ["layout='FSSS|SSFS','FFFF|FFFF'"]
    assert quote_layout_overrides(["layout=(FS)*4"]) == ["layout='(FS)*4'"]


def test_optuna_sweeper_through_the_same_path(fake_launch, tmp_path):
    """A sweeper plugin from the registry (pip install hydra-optuna-sweeper): jobs return their final eval loss."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    code = cli.main(
        [
            "train",
            "-m",
            "hydra/sweeper=optuna",
            "hydra.sweeper.n_trials=2",
            "train.lr=interval(0.001,0.01)",
            "hydra.sweep.dir=opt",
        ]
    )
    assert code == 0 and len(fake_launch) == 2
    assert "best_value: 2.4" in (tmp_path / "opt" / "optimization_results.yaml").read_text()
    assert len(list(csv.DictReader((tmp_path / "opt" / "summary.csv").open()))) == 2


def test_generate_without_checkpoint_warns_loudly(fake_launch, capsys):
    assert cli.main(["generate"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "WARNING" in err and "RANDOM" in err and "serve.checkpoint=" in err
    assert cli.main(["generate", "serve.checkpoint=runs/x"]) == 0
    assert capsys.readouterr().err == ""


def test_run_dirs_written_with_nproc_and_format_keys_still_load(tmp_path):
    """nproc and format moved from the config to the command line; older run dirs keep loading."""
    from dsaflow.config.compose import load_config, to_yaml
    from dsaflow.config.schema import DSAFlowConfig

    p = tmp_path / "config.yaml"
    p.write_text(to_yaml(DSAFlowConfig()) + "nproc: null\nformat: table\n")
    assert load_config(p).model.name == "tiny"


def test_a_second_sweep_into_a_sweep_dir_is_refused_and_changes_nothing(fake_launch, tmp_path, capsys):
    from dsaflow.rundir.lock import run_dir_lock

    assert cli.main(["train", "-m", "train.lr=1e-3,3e-3", "hydra.sweep.dir=sw"]) == 0
    before = {p: p.read_bytes() for p in (tmp_path / "sw").rglob("*") if p.is_file()}
    capsys.readouterr()
    assert cli.main(["train", "-m", "train.lr=5e-3,7e-3", "hydra.sweep.dir=sw"]) == 2
    err = capsys.readouterr().err
    assert "hydra.sweep.dir=sw already holds another sweep" in err and "Traceback" not in err
    assert {p: p.read_bytes() for p in (tmp_path / "sw").rglob("*") if p.is_file()} == before
    assert len(fake_launch) == 2
    (tmp_path / "live").mkdir()
    with run_dir_lock(tmp_path / "live", "sweep"):  # a sweep running in it right now
        assert cli.main(["train", "-m", "train.lr=5e-3,7e-3", "hydra.sweep.dir=live"]) == 2
    assert "in use by another sweep" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "live").iterdir()] == [".lock"] and len(fake_launch) == 2


@pytest.mark.parametrize("where", ["launcher", "between jobs"])
def test_a_stop_signal_ends_the_sweep_and_the_summary_marks_the_rest(fake_launch, monkeypatch, tmp_path, capsys, where):
    import os
    import signal
    import time

    import dsaflow.launch.launch as launch_mod

    fake = launch_mod.launch

    def interrupted_second_job(cfg, plan, job):
        rc = fake(cfg, plan, job)
        if len(fake_launch) == 2:
            if where == "launcher":
                return 130  # the launcher stopped the job's process tree and said so
            os.kill(os.getpid(), signal.SIGTERM)  # lands in Python code: the sweep's own handler
            time.sleep(5)
        return rc

    monkeypatch.setattr(launch_mod, "launch", interrupted_second_job)
    try:
        code = cli.main(["train", "-m", "train.seed=range(0,3000)", "hydra.sweep.dir=sw"])
    finally:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
    cap = capsys.readouterr()
    assert code == (130 if where == "launcher" else 143) and len(fake_launch) == 2, cap.err
    assert "no further job started" in cap.err and "Traceback" not in cap.err
    rows = list(csv.DictReader((tmp_path / "sw" / "summary.csv").open()))
    assert len(rows) == 3000 and rows[0]["status"] == "ok" and rows[1]["status"].startswith("interrupted")
    assert {r["status"] for r in rows[2:]} == {"not run"} and rows[2]["train.seed"] == "2"
    assert sorted(p.name for p in (tmp_path / "sw").iterdir() if p.is_dir()) == ["0", "1"]


def test_a_long_sweep_composes_a_few_jobs_before_it_starts():
    from dsaflow.launch.sweep_guard import representative_jobs

    jobs = [[f"train.seed={i}", f"index={x}"] for x in ("all_full", "every4") for i in range(3000)]
    reps = representative_jobs(jobs)
    assert reps == [jobs[0], jobs[2999], jobs[3000]]  # the first; seed's largest; every4's first


def test_a_generate_sweep_over_checkpoints_takes_each_runs_model_and_layout(fake_launch, tmp_path, capsys):
    from dsaflow.config.compose import compose, to_yaml

    for name, index in (("a", "every4"), ("b", "every2")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text(to_yaml(compose([f"index={index}", "model.num_layers=4"])))
    args = ["generate", "-m", "serve.checkpoint=a,b", "serve.prompts=[hi]", "hydra.sweep.dir=sw"]
    assert cli.main(args) == 1  # the fake launch fails index=every4 jobs
    assert [(c[0].index.name, c[0].model.num_layers) for c in fake_launch] == [("every4", 4), ("every2", 4)]
    assert "wandb group" not in capsys.readouterr().out  # generate jobs log to no tracker
