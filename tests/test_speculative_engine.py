"""Speculative decoding in the pipeline engine (serve.speculative_tokens, dsaflow/serve/speculative_engine.py):
greedy tokens with K = 1..3 drafts equal those without speculation on one stage (K = 3), pp4 with four groups in
flight (K = 1), two ranks joined by a link with fixed batches (K = 3) and pp2 with EOS (K = 2), with continuous
batching refills and per-request limits; a tiny model whose MTP layer learned a few steps, so that drafts are both
accepted and rejected; the unsupported combinations are refused with exit status 2; `dsaflow generate` reports the
acceptance."""

import json
import subprocess
import sys

import pytest
import torch
from test_speculative_reference import V, arithmetic, train_on_arithmetic  # V = 16 tokens of a 32-token vocabulary

from dsaflow.config.compose import compose
from dsaflow.errors import ServeError
from dsaflow.model import load_full_state_dict
from dsaflow.plan import build_plan
from dsaflow.serve.generate import build_engine, check_serve

MODEL = [
    "model.num_layers=4",
    "model.dim=32",
    "model.inter_dim=64",
    "model.vocab_size=32",
    "model.mtp_layers=1",
    "model.index_topk=4",
    "index.pattern=FS",
    "track=none",
]
SERVE = ["serve.max_batch=6", "serve.max_context=64", "serve.prefill_chunk=8"]


def config(pipeline: str, *extra):
    # stages that open on an S layer read the indices of the previous stage (the roles of every split are the same)
    cross = [] if pipeline == "single" else ["pipeline.cross_stage_indices=true"]
    return compose(["mode=serve", f"pipeline={pipeline}", *MODEL, *SERVE, *cross, *extra])


@pytest.fixture(scope="module")
def trained():
    """The whole model's state dict after 20 Adam steps on `arithmetic` (LM + MTP loss)."""
    cfg = config("single")
    plan = build_plan(cfg)
    return train_on_arithmetic(cfg.model, "".join(plan.layer(i).role for i in range(cfg.model.num_layers)))


def engine(state, pipeline: str, *extra):
    cfg = config(pipeline, *extra)
    eng = build_engine(cfg, build_plan(cfg), 0, "cpu", all_stages=True)
    for stage in eng.stages.values():
        load_full_state_dict(stage, state)
    eng.capture()
    return eng


def workload():
    """Prompts of the learned pattern and some without one (drafts rejected), more than max_batch (refills)."""
    g = torch.Generator().manual_seed(5)
    prompts = [row[:n].tolist() for row, n in zip(arithmetic(5, 14, g), (6, 9, 4, 14, 3))]
    prompts += [torch.randint(0, V, (n,), generator=g).tolist() for n in (7, 2)]
    return prompts, [10, 8, 12, 6, 1, 9, 7]


@pytest.fixture(scope="module")
def plain(trained):
    """workload()'s greedy tokens without speculation (one stage)."""
    prompts, limits = workload()
    out = engine(trained, "single").generate(prompts, limits)
    assert [len(o) for o in out] == limits
    return out


def check_stats(eng, k, tokens):
    spec = eng.stats["speculation"]
    assert eng.stats["tokens"] == tokens
    assert 0 < spec["acceptance_rate"] < 1, spec  # drafts both accepted and rejected
    assert spec["mean_accept_length"] == pytest.approx(1 + k * spec["acceptance_rate"])


@pytest.mark.parametrize("pipeline,k", [("single", 3), ("pp4", 1)])
def test_speculative_tokens_equal_plain_greedy(trained, plain, pipeline, k):
    """One stage, and pp4 with four groups in flight (stages opening on S read the indices sent with the
    activations); continuous batching refills rows as requests finish (7 requests on 6 rows)."""
    prompts, limits = workload()
    eng = engine(trained, pipeline, f"serve.speculative_tokens={k}")
    assert eng.generate(prompts, limits) == plain
    check_stats(eng, k, sum(limits))


def test_pp2_ranks_read_the_accepted_counts_from_the_last_stage(trained, plain):
    """Two ranks (threads joined by an in-memory link, as torchrun's processes by gloo): the last stage's message
    reaches rank 0, which feeds the drafts, and both ranks advance their scheduler alike, with fixed batches."""
    import queue

    from test_ticks import QueueLink, run_ranks

    cfg = config("pp2", "serve.speculative_tokens=3", "serve.batching=fixed")
    plan = build_plan(cfg)
    queues = {(0, 1): queue.Queue(), (1, 0): queue.Queue()}
    prompts, limits = workload()
    got, engines = {}, {}

    def rank_main(rank):
        eng = build_engine(cfg, plan, rank, "cpu", link=QueueLink(rank, queues))
        for stage in eng.stages.values():
            load_full_state_dict(stage, trained)
        eng.capture()
        engines[rank] = eng
        got[rank] = eng.generate(prompts, limits)

    run_ranks((0, 1), rank_main, timeout=300)
    assert got[0] is None and got[1] == plain
    for eng in engines.values():
        check_stats(eng, 3, sum(limits))


def test_speculation_ends_rows_at_eos_and_keeps_the_tokens(trained, plain):
    """serve.eos_id: a row's accepted run is cut after its first EOS (the tokens after it are dropped), on pp2 with
    groups in flight; the outputs are the plain greedy tokens cut after EOS."""
    prompts, limits = workload()
    eos = max(range(V), key=lambda t: sum(t in o[:-1] for o in plain))
    cut = [o[: o.index(eos) + 1] if eos in o else o for o in plain]
    assert sum(len(c) < len(o) for c, o in zip(cut, plain)) >= 2
    eng = engine(trained, "pp2", "serve.speculative_tokens=2", f"serve.eos_id={eos}")
    assert eng.generate(prompts, limits) == cut
    assert eng.stats["tokens"] == sum(map(len, cut))


REFUSED = [
    (["model.mtp_layers=0"], "model.mtp_layers=0"),
    (["serve.temperature=0.7"], "serve.temperature=0.7"),
    (["serve.max_pass_tokens=64", "serve.short_prefill=false"], "serve.max_pass_tokens=64"),
    (["graphs=decode", "serve.max_batch=8"], "graphs=off"),
    (["parallel.dp=2"], "parallel.dp=2"),
]


@pytest.mark.parametrize("extra,needle", REFUSED, ids=[n for _, n in REFUSED])
def test_unsupported_speculation_is_refused_before_launch(extra, needle):
    cfg = config("single", "serve.speculative_tokens=2", "serve.prompts=[hi]", *extra)
    with pytest.raises(ServeError, match=needle.replace(".", r"\.")) as err:
        check_serve(cfg, build_plan(cfg), "cpu", hf_headers=False)
    assert "serve.speculative_tokens=2" in str(err.value) and "Fix:" in str(err.value)


def test_the_cli_exits_2_without_an_mtp_layer(tmp_path, capsys):
    """`dsaflow generate` refuses speculation on a model without MTP layers in the parent: exit 2, one message
    naming both fields, no traceback, no run dir written (in process, through the CLI's own entry)."""
    from dsaflow.cli import main

    args = ["generate", *MODEL, "model.mtp_layers=0", "serve.speculative_tokens=2", "serve.prompts=[hi]"]
    assert main([*args, f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "serve.speculative_tokens=2" in err and "model.mtp_layers=0" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_generate_cli_speculates_and_reports_the_acceptance(tmp_path):
    """`dsaflow generate serve.speculative_tokens=2` (seeded random weights: drafts mostly rejected) writes the
    tokens of the engine without speculation and says how many drafts its verify passes accepted."""
    extra = ["serve.max_new_tokens=6", "serve.prompts=[[1,2,3,4,5],[7,7,7]]"]
    cfg = config("single", *extra)
    want = build_engine(cfg, build_plan(cfg), 0, "cpu", all_stages=True).generate([[1, 2, 3, 4, 5], [7, 7, 7]])
    out = tmp_path / "out.jsonl"
    args = ["generate", *MODEL, *SERVE, *extra, "serve.speculative_tokens=2", f"serve.output_file={out}"]
    r = subprocess.run(
        [sys.executable, "-m", "dsaflow.cli", *args, f"run_dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert [json.loads(line)["tokens"] for line in out.read_text().splitlines()] == want
    assert "speculation: 2 MTP drafts per verify pass" in r.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("pipeline", ["single", "pp2"])
def test_speculative_tokens_equal_plain_greedy_on_a_gpu(trained, pipeline):
    """The same identity with the CUDA kernels (fp32; pp2: both stages in this process, two groups in flight):
    verify passes of K + 1 tokens run the prefill kernels, plain decoding the decode kernels."""

    def gpu_engine(*extra):
        cfg = config(pipeline, "serve.dtype=fp32", *extra)
        eng = build_engine(cfg, build_plan(cfg), 0, "cuda", all_stages=True)
        for stage in eng.stages.values():
            load_full_state_dict(stage, trained)
        eng.capture()
        return eng

    prompts, limits = workload()
    want = gpu_engine().generate(prompts, limits)
    for k in (1, 2, 3):
        eng = gpu_engine(f"serve.speculative_tokens={k}")
        assert eng.generate(prompts, limits) == want, k
        check_stats(eng, k, sum(limits))
