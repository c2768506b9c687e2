"""`dsaflow generate` end to end on CPU: parent plan + torchrun + 2 gloo workers (one stage each) + p2p between
stages, against the same model served by one process with one stage. Plus the CLI's user-error exits."""

import json
import os
import subprocess
import sys

import pytest
import torch

from dsaflow.cli import main
from dsaflow.config.compose import compose
from dsaflow.plan import build_plan
from dsaflow.serve.generate import build_engine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = [
    "model.num_layers=4",
    "serve.max_new_tokens=5",
    "serve.prefill_chunk=4",
    "serve.max_context=40",
    "serve.temperature=0.9",
    "serve.top_p=0.8",
    "serve.seed=3",
    "track=none",
]
PROMPTS = ["hello", "hi there, friend", "abc"]


def dsaflow(*args, timeout=240):
    cmd = [sys.executable, "-c", "from dsaflow.cli import main; main()", "generate", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_two_stage_pipeline_generates_the_same_tokens_as_one_stage(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.jsonl"
    res = dsaflow(
        "layout=FS|FF",
        f"serve.prompts_file={prompts}",
        f"serve.output_file={out}",
        f"run_dir={tmp_path / 'run'}",
        *COMMON,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == PROMPTS
    # both ranks wrote a capture report (nothing requested on CPU) and a log
    for r in (0, 1):
        assert json.loads((tmp_path / "run" / f"graphs_rank{r}.json").read_text())["rank"] == r
        assert (tmp_path / "run" / f"serve_rank{r}.log").is_file()
    # the last rank's summary names the schedule: two groups in flight, continuous batching (the defaults)
    assert "2 microbatch groups, continuous batching" in (tmp_path / "run" / "serve_rank1.log").read_text()
    cfg = compose(["mode=serve", "layout=FSFF", *COMMON])
    eng = build_engine(cfg, build_plan(cfg), 0, "cpu")
    eng.capture()
    want = eng.generate([list(p.encode()) for p in PROMPTS])
    assert [r["tokens"] for r in rows] == want
    assert all(len(t) == 5 for t in want)


@pytest.mark.parametrize(
    "args,match",
    [
        (["serve.prompts=[]"], "no prompts"),
        (["serve.prompts=[hi]", "graphs=decode"], "workers run on cpu"),
        (["serve.prompts=[hi]", "serve.top_p=2"], "serve.top_p=2"),
    ],
)
def test_user_errors_exit_2_without_traceback(args, match, tmp_path, capsys):
    """In this process (the parent's checks start no process; a fresh interpreter would spend seconds importing)."""
    assert main(["generate", *args, f"run_dir={tmp_path / 'run'}", "track=none"]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # stopped before any run dir or process


@pytest.mark.slow
def test_serves_a_checkpoint_written_by_dsaflow_train(tmp_path):
    """Train 2 steps on 2 gloo stages, then serve the run's checkpoint from 1 stage: the worker loads the trained
    weights (not the init), and its tokens equal an in-process engine that loads the same checkpoint."""
    model = ["model.num_layers=4", "track=none"]
    train = [
        sys.executable,
        "-c",
        "from dsaflow.cli import main; main()",
        "train",
        *model,
        "layout=FS|FF",
        "train.steps=2",
        "train.eval_every=0",
        f"run_dir={tmp_path / 'train'}",
    ]
    res = subprocess.run(train, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = tmp_path / "out.jsonl"
    serve = [
        "layout=FSFF",
        f"serve.checkpoint={tmp_path / 'train'}",
        "serve.max_new_tokens=4",
        "serve.max_context=40",
        "serve.prompts=[hello]",
    ]
    res = dsaflow(*model, *serve, f"serve.output_file={out}", f"run_dir={tmp_path / 'serve'}")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads(out.read_text())["tokens"]
    cfg = compose(["mode=serve", *model, *serve])
    plan = build_plan(cfg)
    eng = build_engine(cfg, plan, 0, "cpu")
    init = build_engine(compose(["mode=serve", *model, *serve[:1], *serve[2:]]), plan, 0, "cpu")
    trained_w = eng.stages[0].layers["0"].attn.wq_a.weight
    assert not torch.equal(trained_w, init.stages[0].layers["0"].attn.wq_a.weight)
    eng.capture()
    assert eng.generate([list(b"hello")]) == [got]


@pytest.mark.slow
@pytest.mark.parametrize("split", ["FSSS|SFSS", "FS|SS|FS|SS"])
def test_cross_stage_indices_pp2_pp4_generate_the_one_stage_greedy_tokens(tmp_path, split):
    """Stages open on S and read the indices the previous rank sends with the hidden state (p2p, gloo)."""
    greedy = [
        "model.num_layers=8",
        "pipeline.cross_stage_indices=true",
        "serve.temperature=0",
        *COMMON[1:4],
        "track=none",
    ]
    out = tmp_path / "out.jsonl"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    res = dsaflow(
        f"layout={split}",
        f"serve.prompts_file={prompts}",
        f"serve.output_file={out}",
        f"run_dir={tmp_path / 'run'}",
        *greedy,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    cfg = compose(["mode=serve", "layout=" + split.replace("|", ""), *greedy])
    eng = build_engine(cfg, build_plan(cfg), 0, "cpu")
    eng.capture()
    want = eng.generate([list(p.encode()) for p in PROMPTS])
    assert [json.loads(line)["tokens"] for line in out.read_text().splitlines()] == want


def test_prompts_that_carry_an_answer_are_marked_and_counted(tmp_path, capsys):
    """docs/retrieval_prompts.jsonl carries an "answer" per prompt: each output row says whether the completion
    starts with it, the printout marks it, and one line gives the count."""
    from dsaflow.serve.generate import accuracy_line, check_serve, output_rows, write_outputs

    cfg = compose(["mode=serve", f"serve.prompts_file={REPO}/docs/retrieval_prompts.jsonl", "track=none"])
    reqs = check_serve(cfg, build_plan(cfg), "cpu")
    assert reqs.answers == list("71233185")
    rows = output_rows(reqs, {i: list(b"7") if i else list(b"5") for i in range(8)})
    assert not any(r["correct"] for r in rows) and rows[0]["answer"] == "7"
    assert accuracy_line(rows).startswith("answers: 0 of 8 right (0.000")
    rows = output_rows(reqs, {i: list(a.encode()) for i, a in enumerate("71233100")})
    assert accuracy_line(rows).startswith("answers: 6 of 8 right (0.750")
    write_outputs(reqs.prompts, [], None, rows)
    assert "(answer 8: wrong)" in capsys.readouterr().out
    plain = compose(["mode=serve", "serve.prompts=[hello]", "track=none"])
    unmarked = output_rows(check_serve(plain, build_plan(plain), "cpu"), {0: list(b"x")})
    assert "correct" not in unmarked[0] and accuracy_line(unmarked) is None
