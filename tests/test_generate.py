"""Serving on CPU, in one process: chunked prefill + decode vs a full forward, stage splits, padding through the graph
manager (with a fake capturer), batching, EOS, prompts/outputs files, checkpoints, and every serve-config error."""

import json

import pytest
import torch
from test_graphs_cpu import FakeCapturer

from dsaflow.config.compose import compose
from dsaflow.errors import PlanError, ServeError
from dsaflow.model.cache import StageCache
from dsaflow.pipeline.stages import build_stages
from dsaflow.plan import build_plan
from dsaflow.serve.generate import build_engine, check_serve, load_prompts, write_outputs

PROMPTS = ["hello", "hi there, friend", "abc", "x"]


def setup(overrides=(), edit=None):
    base = [
        "mode=serve",
        "track=none",
        "model.num_layers=4",
        "layout=FSFF",
        "serve.max_new_tokens=5",
        "serve.prefill_chunk=4",
        "serve.max_context=40",
    ]
    cfg = compose(base + list(overrides))
    if edit:
        edit(cfg)
    return cfg, build_plan(cfg)


def ids_of(prompts):
    return [list(p.encode()) for p in prompts]


def run(cfg, plan, prompts=PROMPTS, record=False, **kw):
    eng = build_engine(cfg, plan, 0, "cpu", all_stages=True, **kw)
    eng.capture()
    eng.record_logits = record
    return eng.generate(ids_of(prompts)), eng


def flat(log):
    """The engine's logits log {request: [V] per token} as one list, request by request."""
    return [t for r in sorted(log) for t in log[r]]


def same_logits(log_a, log_b):
    return sorted(log_a) == sorted(log_b) and all(
        len(log_a[r]) == len(log_b[r]) and all(torch.equal(a, b) for a, b in zip(log_a[r], log_b[r])) for r in log_a
    )


def greedy_reference(cfg, plan, prompt, steps):
    """Greedy continuation by full forwards without any cache (the model's training-mode path)."""
    stages = build_stages(cfg.model, plan, seed=cfg.train.seed)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            h = torch.tensor([seq])
            for s in stages:
                h = s(h)
            seq.append(int(h[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_chunked_prefill_then_decode_matches_full_forward(chunk):
    cfg, plan = setup([f"serve.prefill_chunk={chunk}", "layout=FSFS"])
    out, _ = run(cfg, plan)
    for p, o in zip(ids_of(PROMPTS), out):
        assert o == greedy_reference(cfg, plan, p, 5)


def test_two_local_stages_equal_one_stage_with_sampling():
    sampled = ["serve.temperature=0.8", "serve.top_p=0.9", "serve.seed=5"]
    cfg1, plan1 = setup(["layout=FSFF", *sampled])
    cfg2, plan2 = setup(["layout=FS|FF", *sampled])
    assert plan2.num_stages == 2
    out1, e1 = run(cfg1, plan1, record=True)
    out2, e2 = run(cfg2, plan2, record=True)
    assert out1 == out2 and e2.groups == 2  # two local stages keep two groups in flight
    assert same_logits(e1.logits_log, e2.logits_log)
    greedy, _ = run(*setup(["layout=FSFF"]))
    assert out1 != greedy  # temperature sampling really sampled


def _graph_cfg(cache=True):
    def edit(cfg):
        cfg.serve.prefill_chunk, cfg.serve.max_batch = 8, 4
        cfg.graphs.blocks[0].shape_classes = [1, 2, 4]
        cfg.graphs.blocks[1].shape_classes = [2, 8]
        cfg.graphs.cache = cache
        cfg.serve.microbatches = 1
        cfg.serve.batching = "fixed"  # prefill graphs over the group's full rows only (no top-row classes)

    return setup(["graphs=decode_prefill", "layout=FS|FF"], edit)


def test_padded_graph_path_matches_plain_eager():
    """n=3 prompts run as decode class 4 and prefill rows = max_batch (4), token classes 2/8: same tokens, logits."""
    cfg, plan = _graph_cfg()
    cap = FakeCapturer()
    out_g, eg = run(cfg, plan, PROMPTS[:3], record=True, capturer=cap)
    assert cap.calls == 2 * (3 + 2)  # decode 1,2,4 and prefill 2,8 on each of 2 stages, captured at setup only
    assert {(r.block, r.shape_class, r.stage) for r in eg.graphs.report().records} == {
        (b, c, s) for s in (0, 1) for b, cs in (("decode", (1, 2, 4)), ("prefill", (2, 8))) for c in cs
    }
    cfg_e, plan_e = setup(["layout=FS|FF", "serve.prefill_chunk=8", "serve.microbatches=1"])
    out_e, ee = run(cfg_e, plan_e, PROMPTS[:3], record=True)
    assert out_g == out_e
    assert len(flat(eg.logits_log)) == len(flat(ee.logits_log)) == 3 * 5
    for a, b in zip(flat(eg.logits_log), flat(ee.logits_log)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the force-eager reference runs the identical padded shapes: bit-identical
    out_f, ef = run(cfg, plan, PROMPTS[:3], record=True, force_eager=True)
    assert out_f == out_g and same_logits(eg.logits_log, ef.logits_log)


def test_graph_cache_bypass_is_bit_identical():
    (cfg_on, plan_on), (cfg_off, plan_off) = _graph_cfg(True), _graph_cfg(False)
    cap_on, cap_off = FakeCapturer(), FakeCapturer()
    out_on, e_on = run(cfg_on, plan_on, PROMPTS[:3], record=True, capturer=cap_on)
    out_off, e_off = run(cfg_off, plan_off, PROMPTS[:3], record=True, capturer=cap_off)
    assert out_on == out_off and same_logits(e_on.logits_log, e_off.logits_log)
    assert cap_off.calls > cap_on.calls  # the bypass captured afresh on every call


def test_batch_composition_does_not_change_a_prompt():
    cfg, plan = setup(["serve.max_batch=2"])
    together, eng = run(cfg, plan, PROMPTS[:3])  # 3 prompts in batches of 2 and 1
    assert eng.serve.max_batch == 2
    alone, _ = run(cfg, plan, [PROMPTS[1], PROMPTS[0], PROMPTS[2]], record=False)  # other partners, other order
    assert [alone[1], alone[0], alone[2]] == together


def test_eos_stops_every_row_early():
    cfg, plan = setup(["serve.max_new_tokens=8"])
    free, _ = run(cfg, plan, PROMPTS[:1])
    eos = free[0][2]
    cfg2, plan2 = setup(["serve.max_new_tokens=8", f"serve.eos_id={eos}"])
    out, eng = run(cfg2, plan2, PROMPTS[:1])
    assert out[0] == free[0][: free[0].index(eos) + 1]
    # the flags reach the host one pass late (Scheduler.end): the row decodes once more, and that token is dropped
    assert eng.timings["decode_steps"] == free[0].index(eos) + 1
    assert eng.stats["tokens"] == free[0].index(eos) + 1


def test_prompts_file_and_output_file(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "one"}\n\n{"prompt": "two"}\n')
    cfg, _ = setup([f"serve.prompts_file={f}"])
    assert load_prompts(cfg.serve) == ["one", "two"]
    out = tmp_path / "o" / "out.jsonl"
    write_outputs(["one", "two"], [[104, 105], [33]], str(out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [
        {"prompt": "one", "completion": "hi", "tokens": [104, 105]},
        {"prompt": "two", "completion": "!", "tokens": [33]},
    ]
    write_outputs(["one"], [[104, 105]], None)
    assert "hi" in capsys.readouterr().out


def test_checkpoint_weights_are_served(tmp_path):
    """A checkpoint in the trainer's layout written from seed-1 weights serves like a seed-1 model."""
    from dsaflow.checkpoint.training_state import save_checkpoint

    cfg1, plan1 = setup(["layout=FS|FF", "train.seed=1"])
    ckpt = tmp_path / "checkpoints" / "step-000001"
    save_checkpoint(ckpt, build_stages(cfg1.model, plan1, seed=1), None, 0, 1)
    want, _ = run(cfg1, plan1)
    cfg0, plan0 = setup(["layout=FS|FF", f"serve.checkpoint={tmp_path}"])  # a run dir: latest checkpoint
    got, _ = run(cfg0, plan0)
    plain, _ = run(*setup(["layout=FS|FF"]))
    assert got == want and got != plain
    # a run dir records its model: serving it with another model is caught in the parent
    from dsaflow.config.compose import to_yaml

    (tmp_path / "config.yaml").write_text(to_yaml(cfg1))
    check_serve(*setup(["layout=FS|FF", "serve.prompts=[a]", f"serve.checkpoint={tmp_path}"]), "cpu")
    cfg_bad, plan_bad = setup(["layout=FS|FF", "model.inter_dim=96", f"serve.checkpoint={tmp_path}"])
    with pytest.raises(ServeError, match="model.inter_dim: trained 128 vs now 96"):
        check_serve(cfg_bad, plan_bad, "cpu")
    with pytest.raises(ServeError, match="neither a checkpoint folder nor a run dir holding a good"):
        check_serve(*setup([f"serve.checkpoint={tmp_path / 'checkpoints'}"]), "cpu")


def test_checkpoint_with_other_roles_is_a_clear_error(tmp_path):
    from dsaflow.checkpoint.training_state import save_checkpoint

    cfg1, plan1 = setup(["layout=FSSS"])
    save_checkpoint(tmp_path / "ck", build_stages(cfg1.model, plan1), None, 0, 1)
    cfg, plan = setup(["layout=FFFF", f"serve.checkpoint={tmp_path / 'ck'}"])
    with pytest.raises(ServeError, match="has no weights for .*indexer"):
        build_engine(cfg, plan, 0, "cpu", all_stages=True)


ERRORS = [
    (["serve.prompts=[]"], "no prompts"),
    (["serve.prompts=[]", "serve.prompts_file=/nonexistent.jsonl"], "does not exist"),
    (["serve.max_context=9"], r"no request fits: prompt 0 is 5 tokens.*serve.max_context=9. Fix: serve.max_context=10"),
    (["serve.microbatches=9"], r"serve.microbatches=9 must be between 1 and serve.max_batch=8"),
    (["serve.eos_id=999"], "serve.eos_id=999"),
    (["serve.checkpoint=/nope"], "serve.checkpoint=/nope does not exist"),
    (["graphs=decode", "serve.max_batch=4"], r"shape_classes=\[1, 2, 4, 8\] go beyond serve.max_batch=4"),
    (["graphs=decode_prefill"], r"largest prefill class must equal serve.prefill_chunk=4"),
    (["graphs.transfers=true"], r"graphs.transfers=true pads .* graphs=off has no decode block"),
    (["graphs=decode", "graphs.transfers=true"], r"graphs.transfers=true replays .* one rank. Fix: .*pipeline=pp2"),
]


# single-field ranges and choices are the schema's: refused at compose
COMPOSE_ERRORS = [
    (["serve.max_new_tokens=0"], "serve.max_new_tokens=0 is out of range"),
    (["serve.top_p=0"], r"serve.top_p=0 is out of range: allowed \(0, 1\]"),
    (["serve.temperature=-1"], "serve.temperature=-1 is out of range"),
    (["serve.microbatches=0"], r"serve.microbatches=0 is out of range"),
    (["serve.dtype=fp16"], "serve.dtype='fp16' is not a valid choice. Fix: use one of auto, fp32, bf16"),
]


@pytest.mark.parametrize("overrides,match", COMPOSE_ERRORS)
def test_serve_field_errors_at_compose(overrides, match):
    from dsaflow.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        setup(['serve.prompts=["hello"]', *overrides])


@pytest.mark.parametrize("overrides,match", ERRORS)
def test_serve_config_errors(overrides, match):
    cfg, plan = setup(['serve.prompts=["hello","hi there, friend"]', *overrides])
    with pytest.raises(ServeError, match=match):
        check_serve(cfg, plan, "cuda")


def test_more_serve_errors(tmp_path):
    cfg, plan = setup(["serve.prompts=[a]", f"serve.prompts_file={tmp_path}/x"])
    with pytest.raises(ServeError, match="both serve.prompts"):
        check_serve(cfg, plan)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no"}\n')
    cfg, plan = setup([f"serve.prompts_file={bad}"])
    with pytest.raises(ServeError, match="line 2"):
        check_serve(cfg, plan)
    cfg, plan = setup(["serve.prompts=[a]", "graphs=decode"], lambda c: setattr(c.serve, "max_batch", 8))
    with pytest.raises(ServeError, match="workers run on cpu"):
        check_serve(cfg, plan, "cpu")
    cfg, plan = setup(["serve.prompts=[a]", "graphs=decode", "graphs.on_failure=eager"])
    check_serve(cfg, plan, "cpu")  # explicit eager on CPU is allowed (and reported as eager)
    cfg, plan = setup(["serve.prompts=[a]", "graphs=decode", "graphs.on_failure=eager", "graphs.transfers=true"])
    with pytest.raises(ServeError, match="graphs.transfers=true replays NCCL transfers .* run on cpu"):
        check_serve(cfg, plan, "cpu")
    with pytest.raises(PlanError, match="graphs.transfers=true replays serving transfers .* mode=train"):
        build_plan(compose(["graphs.transfers=true", "track=none"]))

    def head_block(c):
        c.graphs.blocks[0].kind = "head"

    with pytest.raises(PlanError, match="kind=head exists in the plan but is never captured"):
        setup(["serve.prompts=[a]", "graphs=decode"], head_block)


CROSS = ["pipeline.cross_stage_indices=true", "model.num_layers=8", "serve.max_new_tokens=6"]


@pytest.mark.parametrize("split", ["FS|SS|FSSS", "FS|SS|FS|SS"])
def test_cross_stage_indices_generate_what_one_stage_does(split, monkeypatch):
    """Stages that open on S read the previous stage's indices in prefill chunks and decode steps: the same greedy
    tokens and logits as one stage, eager and through the padded graph path."""
    cfg1, plan1 = setup(["layout=FSSSFSSS", *CROSS])
    out1, e1 = run(cfg1, plan1, record=True)
    cfg, plan = setup([f"layout={split}", "serve.microbatches=1", *CROSS])  # the same rows per pass: bit-equal
    assert plan.index_boundaries and not any(l.promoted for l in plan.layers)
    out, e = run(cfg, plan, record=True)
    assert out == out1 and same_logits(e.logits_log, e1.logits_log)
    cfg_mb, plan_mb = setup([f"layout={split}", *CROSS])  # one group per stage, each with its own index buffer
    out_mb, e_mb = run(cfg_mb, plan_mb, record=True)
    assert e_mb.groups == plan_mb.num_stages > 1 and out_mb == out1

    def graphs(c):
        c.serve.prefill_chunk, c.serve.max_batch = 8, 4 * plan_mb.num_stages  # 4 rows per group
        c.graphs.blocks[0].shape_classes = [1, 2, 4]
        c.graphs.blocks[1].shape_classes = [2, 8]

    cfg_g, plan_g = setup(["graphs=decode_prefill", f"layout={split}", *CROSS], graphs)
    out_g, eg = run(cfg_g, plan_g, PROMPTS[:3], record=True, capturer=FakeCapturer())
    out_e, ee = run(*setup(["layout=FSSSFSSS", "serve.prefill_chunk=8", *CROSS]), PROMPTS[:3], record=True)
    assert out_g == out_e
    assert len(flat(eg.logits_log)) == len(flat(ee.logits_log)) == 3 * 6
    for a, b in zip(flat(eg.logits_log), flat(ee.logits_log)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    # continuous batching: refills move rows and prefill through top-row graphs; the received indices land there
    moved = []
    real_move = StageCache.move_rows
    monkeypatch.setattr(StageCache, "move_rows", lambda self, a, b, n: moved.append(len(a)) or real_move(self, a, b, n))
    cfg_c, plan_c = setup(["graphs=decode_prefill", f"layout={split}", "serve.batching=continuous", *CROSS], graphs)
    prompts, limits = ids_of(PROMPTS * 8), [1 + (5 * i) % 6 for i in range(32)]
    eng_c = build_engine(cfg_c, plan_c, 0, "cpu", all_stages=True, capturer=FakeCapturer())
    eng_c.capture()
    eng_1 = build_engine(*setup(["layout=FSSSFSSS", "serve.prefill_chunk=8", *CROSS]), 0, "cpu", all_stages=True)
    eng_1.capture()
    assert eng_c.row_classes and eng_c.generate(prompts, limits) == eng_1.generate(prompts, limits) and moved


def test_request_that_does_not_fit_is_rejected_by_line_and_the_rest_served(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        '{"prompt": "hello"}\n{"prompt": "hi there, friend", "max_new_tokens": 30}\n'
        '{"prompt": "abc", "max_new_tokens": 2}\n'
    )
    cfg, plan = setup([f"serve.prompts_file={f}"])
    reqs = check_serve(cfg, plan, "cpu")
    assert reqs.served == [0, 2] and reqs.max_new == [5, 30, 2]
    assert reqs.rejected[1].startswith(f"serve.prompts_file={f} line 2 is 16 tokens; with max_new_tokens=30")
    assert "Fix: serve.max_context=46" in reqs.rejected[1]
    eng = build_engine(cfg, plan, 0, "cpu", all_stages=True)
    eng.capture()
    from dsaflow.serve.generate import serve_requests

    rows = serve_requests(eng, reqs)
    assert rows[0]["tokens"] == run(cfg, plan, ["hello"])[0][0]
    assert rows[2]["tokens"] == run(cfg, plan, ["abc"])[0][0][:2]  # its own limit, the same greedy tokens
    assert [sorted(r) for r in rows] == [
        ["completion", "num_tokens", "prompt", "tokens", "tpot_s", "ttft_s"],
        ["error", "prompt"],
        ["completion", "num_tokens", "prompt", "tokens", "tpot_s", "ttft_s"],
    ]
    assert rows[0]["num_tokens"] == 5 and rows[0]["ttft_s"] > 0 and rows[0]["tpot_s"] > 0
    assert rows[2]["ttft_s"] > 0 and rows[2]["num_tokens"] == 2 and rows[1]["error"] == reqs.rejected[1]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok", "max_new_tokens": 0}\n')
    with pytest.raises(ServeError, match=r"line 1: max_new_tokens=0 is not a whole number in \[1, "):
        check_serve(*setup([f"serve.prompts_file={bad}"]), "cpu")
