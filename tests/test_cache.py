"""Serving caches: prefill chunks + token-by-token decode reproduce the full forward; bookkeeping; graph safety."""

import pytest
import torch
from model_helpers import planned_sharp
from torch.utils._python_dispatch import TorchDispatchMode

from dsaflow.model import IndexCacheError
from dsaflow.pipeline.stages import build_stages, stage_cache

V = 256


def run(stages, caches, x, pos, attn="sparse"):
    """Every stage in order: `forward_train` where its cache is None, else a decode step (T == 1) or a prefill pass."""
    for s, c in zip(stages, caches):
        if c is None:
            x = s.forward_train(x, pos, attn=attn)
        elif x.shape[1] == 1:
            x = s.forward_decode(x, pos, c, attn=attn)
        else:
            x = s.forward_prefill(x, pos, c, attn=attn)
    return x


def allocate(model, plan, max_batch, max_context, max_tokens, poison=True):
    caches = [stage_cache(model, plan, i, max_batch, max_context, max_tokens) for i in range(plan.num_stages)]
    if poison:  # rows a query must never see (unwritten, stale or trash) hold NaN
        for c in caches:
            for t in (*c.kv.values(), *c.index_k.values()):
                t.fill_(float("nan"))
    return caches


@pytest.mark.parametrize("attn,topk", [("sparse", 6), ("dense", 16)])
@torch.no_grad()
def test_chunked_prefill_then_decode_reproduces_full_logits_at_every_position(attn, topk):
    """Two sequences of different prompt and total lengths, prefill in chunks of 8 (padded with position -1),
    then one token per step; every real position's logits equal the full-sequence forward of that sequence."""
    model, plan = planned_sharp("FSSS|FSS", "model.num_layers=7", f"model.index_topk={topk}")
    stages = build_stages(model, plan, seed=1)
    g = torch.Generator()
    g.manual_seed(0)
    lengths, prompts, chunk = [29, 21], [19, 12], 8
    seqs = [torch.randint(0, V, (n,), generator=g) for n in lengths]
    full = [run(stages, [None] * 2, s.unsqueeze(0), None, attn)[0] for s in seqs]  # [n, V] each
    caches = allocate(model, plan, max_batch=3, max_context=32, max_tokens=chunk)
    got = [torch.full((n, V), float("nan")) for n in lengths]

    def step(spans):  # spans[b] = positions this step feeds for sequence b (may be empty)
        T = max(len(p) for p in spans)
        x = torch.zeros(2, T, dtype=torch.long)
        pos = torch.full((2, T), -1)
        for b, p in enumerate(spans):
            x[b, : len(p)], pos[b, : len(p)] = seqs[b][p], torch.tensor(p, dtype=torch.long)
        out = run(stages, caches, x, pos, attn)
        for b, p in enumerate(spans):
            got[b][p] = out[b, : len(p)]

    for c0 in range(0, max(prompts), chunk):
        step([list(range(c0, min(c0 + chunk, P))) for P in prompts])
    for t in range(max(prompts), max(lengths)):
        step([[t - max(prompts) + P] if t - max(prompts) + P < n else [] for P, n in zip(prompts, lengths)])
    for b in range(2):
        assert torch.isfinite(got[b]).all()
        torch.testing.assert_close(got[b], full[b], rtol=1e-4, atol=1e-4)


def test_allocation_shapes_and_reset():
    model, plan = planned_sharp("FSSS|FSSS")
    c = stage_cache(model, plan, 1, max_batch=2, max_context=10, max_tokens=4)
    assert sorted(c.kv) == [4, 5, 6, 7] and sorted(c.index_k) == [4]  # indexer K cache on F layers only
    assert c.kv[5].shape == (2, 11, model.kv_lora_rank + model.qk_rope_head_dim)  # + one trash row
    assert c.index_k[4].shape == (2, 11, model.index_head_dim)
    assert c.index.shape == (2, 4, model.index_topk) and c.index.dtype == torch.int32
    stage = build_stages(model, plan)[1]
    with torch.no_grad():
        stage.forward_prefill(torch.randn(2, 3, model.dim), torch.arange(3).expand(2, 3), c)
    assert c.index_writer == 4 and (c.index[:, :3] >= 0).any() and c.kv[5][:, :3].abs().sum() > 0
    c.reset()
    assert c.index_writer is None and (c.index == -1).all() and all((t == 0).all() for t in c.kv.values())


@torch.no_grad()
def test_padding_queries_never_touch_real_rows():
    model, plan = planned_sharp("FSSS|FSSS")
    stage = build_stages(model, plan)[1]
    c = stage_cache(model, plan, 1, max_batch=2, max_context=6, max_tokens=4)
    stage.forward_prefill(torch.randn(2, 4, model.dim), torch.arange(4).expand(2, 4), c)
    before = {i: t.clone() for i, t in (*c.kv.items(), *((f"k{i}", t) for i, t in c.index_k.items()))}
    pos = torch.tensor([[4, -1, -1, -1], [-1, -1, -1, 7]])  # one real new token; padding and an out-of-range slot
    stage.forward_prefill(torch.randn(2, 4, model.dim), pos, c)
    for key, t in (*c.kv.items(), *((f"k{i}", t) for i, t in c.index_k.items())):
        changed = (t != before[key]).any(-1)  # [max_batch, rows]
        expect = torch.zeros_like(changed)
        expect[0, 4] = True
        expect[:, -1] = changed[:, -1]  # the trash row may change
        assert torch.equal(changed, expect), key


def test_s_layer_whose_source_did_not_write_raises_naming_both_layers():
    model, plan = planned_sharp("FSSS|FSSS")
    stage = build_stages(model, plan)[1]
    c = stage_cache(model, plan, 1, max_batch=1, max_context=8, max_tokens=4)
    stage.eval()
    x, pos = torch.randn(1, 2, model.dim), torch.arange(2).view(1, 2)
    layer6 = stage.layers["6"]
    from dsaflow.model.context import CachedContext
    from dsaflow.model.rope import rope_angles

    ctx = CachedContext(pos, rope_angles(pos, 8, 1e4), rope_angles(pos, 8, 1e4), "sparse", c.index_slot, c)
    c.index_slot.begin()
    with pytest.raises(IndexCacheError, match=r"S layer 6 .* source F layer 4.* no layer has written it"):
        layer6(x, ctx)
    c.index_slot.write(0, torch.zeros(1, 2, model.index_topk, dtype=torch.int32))  # a layer of another stage wrote
    with pytest.raises(IndexCacheError, match=r"S layer 6 .* source F layer 4.* last written by layer 0"):
        layer6(x, ctx)
    with torch.no_grad():  # the whole stage in order is fine, and records the writer
        stage.forward_prefill(x, pos, c)
    assert c.index_writer == 4


def test_chunk_larger_than_the_index_cache_is_a_clear_error():
    model, plan = planned_sharp("FSSS|FSSS")
    stage = build_stages(model, plan)[1]
    c = stage_cache(model, plan, 1, max_batch=1, max_context=16, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens >= 6"), torch.no_grad():
        stage.forward_prefill(torch.randn(1, 6, model.dim), torch.arange(6).view(1, 6), c)


class RecordOps(TorchDispatchMode):
    """Records (op, output shapes) and fails on ops that force a host sync or have data-dependent shapes."""

    FORBIDDEN = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "equal", "is_nonzero", "item")

    def __init__(self):
        super().__init__()
        self.trace = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        assert not any(name.startswith(f) or f"_{f}" in name for f in self.FORBIDDEN), f"host sync op {name}"
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else [out]
        self.trace.append((name, tuple(tuple(o.shape) for o in outs if isinstance(o, torch.Tensor))))
        return out


@torch.no_grad()
def test_forward_with_cache_has_no_host_sync_and_static_shapes():
    """The CPU stand-in for CUDA-graph safety: no op that reads tensor values on the host, and the same op sequence
    with the same shapes whatever the positions hold (decode and prefill chunk shapes)."""
    model, plan = planned_sharp("FSSS|FSSS")
    stages = build_stages(model, plan)
    for T, pos_a, pos_b in [
        (1, [[3], [0]], [[9], [-1]]),
        (4, [[0, 1, 2, 3], [5, 6, -1, -1]], [[8, 9, 10, 11], [-1] * 4]),
    ]:
        run(stages, allocate(model, plan, 2, 12, 4, poison=False), torch.randint(0, V, (2, T)), torch.tensor(pos_a))
        traces = []  # after one forward: the per-device constants (RoPE frequencies) are made on first use
        for pos in (pos_a, pos_b):
            caches = allocate(model, plan, max_batch=2, max_context=12, max_tokens=4, poison=False)
            x = torch.randint(0, V, (2, T))
            with RecordOps() as rec:
                run(stages, caches, x, torch.tensor(pos))
            traces.append(rec.trace)
        assert traces[0] == traces[1] and len(traces[0]) > 50


def _chained(stages, forward, x, positions=None, caches=None, **kw):
    """x through `forward(stage)` of every stage in order, cross-stage indices handed on: called as (x, positions,
    cache, indices_in=, **kw) with caches, else as (x, indices_in=, **kw)."""
    indices = None
    for i, s in enumerate(stages):
        received = indices if s.incoming_source is not None else None
        args = () if caches is None else (positions, caches[i])
        x = forward(s)(x, *args, indices_in=received, **kw)
        indices = s.take_indices(x)
    return x


@pytest.mark.parametrize("model_name", ["tiny", "tiny_moe"])
@torch.no_grad()
def test_the_three_forwards_agree_where_their_jobs_overlap(model_name):
    """forward_prefill of a 9-token prompt, then forward_decode of its next two tokens: the logits equal
    forward_train's over the 11 tokens at every position, across two stages whose second one opens on S layers
    (cross-stage indices; top-k 4 < 9, so the selection matters). A token-major forward_prefill of the prompt gives
    the same logits."""
    model, plan = planned_sharp(
        "FSS|SSFSS", f"model={model_name}", "model.index_topk=4", "pipeline.cross_stage_indices=true"
    )
    stages = [s.eval() for s in build_stages(model, plan, seed=1)]
    assert stages[1].incoming_source == 0
    seq = torch.randint(0, V, (1, 11), generator=torch.Generator().manual_seed(5))
    train = _chained(stages, lambda s: s.forward_train, seq)[0]  # [11, V]

    def serve(prefill, decode, **kw):
        caches = allocate(model, plan, max_batch=1, max_context=16, max_tokens=9)
        outs = [_chained(stages, prefill, seq[:, :9], torch.arange(9).view(1, 9), caches, **kw)[0]]
        for t in (9, 10):
            outs.append(_chained(stages, decode, seq[:, t : t + 1], torch.tensor([[t]]), caches)[0])
        return torch.cat(outs)

    got = serve(lambda s: s.forward_prefill, lambda s: s.forward_decode)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, train, rtol=1e-4, atol=1e-4)
    rows = torch.zeros(1, 9, dtype=torch.long)  # a token-major pass of one row's tokens
    major = serve(lambda s: s.forward_prefill, lambda s: s.forward_decode, token_rows=rows)
    torch.testing.assert_close(major, train, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="forward_decode runs one token per row"):
        stages[0].forward_decode(seq[:, :2], torch.arange(2).view(1, 2), allocate(model, plan, 1, 16, 9)[0])
