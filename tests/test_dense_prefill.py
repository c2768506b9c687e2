"""Short-context prefill (dsaflow.model.dense_prefill): the host rule, the attention against a naive fp32
reference and against the absorbed sparse path, chunked prefill through stages with NaN-poisoned caches, padding rows
and S layers (then decode on the keys the dense path wrote), and the serving engine with the rule on and off.

GPU tests (`-m gpu`): both paths against the naive reference in bf16 with NaN-poisoned cache rows, and the stage in
bf16 against its sparse path; graph replay == eager for the prefill blocks of every path."""

import math

import pytest
import torch
from model_helpers import planned_sharp

import dsaflow.model.dense_prefill as dp
from dsaflow.config.compose import compose
from dsaflow.model.context import causal_indices
from dsaflow.model.dense_prefill import (
    QUERY_BLOCK,
    PrefillHint,
    graph_classes,
    graph_hint,
    plan_prefill,
    prefill_attention,
    prefill_path,
    rotate_query_pe_,
    zero_padding,
)
from dsaflow.model.mla import MLA
from dsaflow.model.rope import rope_angles
from dsaflow.ops.rope import rope_naive
from dsaflow.pipeline.stages import build_stages, stage_cache

V = 256


# ---- the rule ----
def test_rule_picks_dense_then_masked_then_sparse():
    assert prefill_path(1, 5, 16, min_tokens=1) == "sparse"  # decode
    assert prefill_path(8, 16, 16, min_tokens=8) == "dense"
    assert prefill_path(7, 16, 16, min_tokens=8) == "sparse"  # too few queries to amortise the key up-projection
    assert prefill_path(8, 17, 16, max_keys=64, min_tokens=2) == "masked"
    assert prefill_path(8, 64, 16, max_keys=64, min_tokens=2) == "masked"
    assert prefill_path(8, 65, 16, max_keys=64, min_tokens=2) == "sparse"
    assert prefill_path(8, 17, 16, max_keys=0, min_tokens=2) == "sparse"  # masked path off
    assert prefill_path(dp.MIN_PREFILL_TOKENS, 2048, 2048) == "dense"
    assert prefill_path(dp.MIN_PREFILL_TOKENS - 1, 2048, 2048) == "sparse"


def test_plan_prefill_bounds_every_query_block_and_detects_aligned_passes():
    pos = [[0, 1, 2, 3, 4, -1], [0, 1, 2, -1, -1, -1], [-1] * 6]
    rule = dict(min_tokens=1)
    h = plan_prefill(pos, topk=16, cache_rows=41, block=4, **rule)
    assert h == PrefillHint("dense", 4, (16, 16), causal=True)
    h = plan_prefill([[20, 21, 22, 23, 24, 25], [-1] * 6], topk=16, cache_rows=100, max_keys=64, block=2, **rule)
    assert h.path == "masked" and h.ends == (32, 32, 32) and not h.causal
    assert plan_prefill([[5, 6, 7]], topk=16, cache_rows=41, **rule).causal is False  # a later chunk: by position
    assert plan_prefill([[50, 51]], topk=16, cache_rows=100, max_keys=32, **rule) is None
    assert plan_prefill([[7], [3]], topk=16, cache_rows=41, **rule) is None  # T == 1
    assert plan_prefill([[0, 1]], topk=16, cache_rows=10, **rule).ends == (10,)  # clamped to the cache rows
    assert plan_prefill(pos, topk=16, cache_rows=41) is None  # 6 columns < MIN_PREFILL_TOKENS


def test_plan_prefill_splits_the_first_chunk_of_a_long_prompt():
    """An aligned pass longer than top-k: columns [0, topk) dense (causal), then masked query blocks while their key
    extent is within max_keys, the rest sparse; never for a later chunk, a graph pass (split=False) or a top-k
    below min_tokens."""
    first = [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, -1, -1], [-1] * 6]
    h = plan_prefill(first, topk=4, cache_rows=41, min_tokens=2)
    assert h == PrefillHint("split", 4, (4,), causal=True, dense_cols=4) and h.short_cols == 4
    assert plan_prefill(first, topk=4, cache_rows=41, min_tokens=2, split=False) is None
    assert plan_prefill([[4, 5, 6, 7, 8, 9]], topk=4, cache_rows=41, min_tokens=2) is None  # a later chunk
    assert plan_prefill(first, topk=4, cache_rows=41, min_tokens=5) is None  # 4 dense columns: not worth it
    # the whole pass within max_keys: causal columns then masked ones, nothing sparse (not the all-masked pass)
    h = plan_prefill(first, topk=4, cache_rows=41, max_keys=16, min_tokens=2)
    assert h == PrefillHint("split", QUERY_BLOCK, (16,), causal=True, dense_cols=4, masked_cols=2)
    # dense, masked and sparse columns in one pass: blocks of 4 reach extents 16, 16, 16, then 32 > max_keys
    rows = [list(range(21)), list(range(13)) + [-1] * 8, [-1] * 21]
    h = plan_prefill(rows, topk=2, cache_rows=41, max_keys=16, min_tokens=2, block=4)
    assert h == PrefillHint("split", 4, (16, 16, 16), causal=True, dense_cols=2, masked_cols=12) and h.short_cols == 14
    assert plan_prefill(rows, topk=2, cache_rows=41, max_keys=48, min_tokens=2, block=4).masked_cols == 19
    with pytest.raises(ValueError, match="not a hint"):
        PrefillHint("split", 4, (4,), causal=False, dense_cols=4)


def test_masked_crossover_follows_the_attention_dims():
    """4176 keys at V3.2's dims (2048 x 1088 / 320 x MASKED_RATE, rounded down to 16); off for model=small, whose
    window above top-k is narrower than a query block, and at rate 0."""
    v32 = compose(["mode=serve", "model=dsv32"]).model
    assert dp.masked_max_keys(v32) == 4176
    assert dp.masked_max_keys(v32, rate=0.0) == 0
    assert dp.masked_max_keys(compose(["mode=serve", "model=small"]).model) == 0


def test_graph_classes_are_the_prefix_a_pass_on_the_path_can_replay():
    assert graph_classes("sparse", [1, 8, 32, 64], 16, 40, 1) == [1, 8, 32, 64]
    assert graph_classes("dense", [1, 8, 32, 64], 16, 40, 1) == [8, 32]  # 32 takes 9..32 tokens (extent 9..16)
    assert graph_classes("masked", [1, 8, 32, 64], 16, 40, 1) == []  # masked passes never replay a graph
    assert graph_classes("dense", [1, 8, 32, 64], 64, 40, 20) == [32, 64]  # passes of < 20 tokens run sparse
    assert graph_hint("dense", 32, 16, 41) == PrefillHint("dense", 32, (16,))
    assert graph_hint("sparse", 32, 16, 41) is None


def test_dense_graphs_per_key_class():
    """Dense graphs come in key classes top-k / 4, / 2, top-k; a pass replays the smallest that holds its keys."""
    assert dp.dense_key_classes(2048, 4353) == (512, 1024, 2048)
    assert dp.dense_key_classes(16, 41) == (16,)  # rounded up to KEY_ALIGN: one class
    assert dp.dense_key_classes(2048, 700) == (512, 700)  # capped at the cache's rows
    assert dp.graph_labels(dp.PATHS, 2048, 4353) == ["sparse", "dense@512", "dense@1024", "dense", "split"]
    assert dp.graph_labels(("sparse",), 2048, 4353) == ["sparse"]
    assert graph_classes("dense@32", [1, 8, 32, 64], 64, 40, 1) == [8, 32]
    assert graph_classes("dense@16", [1, 8, 32, 64], 64, 40, 1) == [8, 32]  # 32 holds 9..16 tokens
    assert graph_classes("dense", [1, 8, 32, 64], 64, 40, 1) == [8, 32, 64]
    assert graph_hint("dense@32", 8, 64, 100) == PrefillHint("dense", 8, (32,))
    assert graph_hint("dense", 8, 64, 100) == PrefillHint("dense", 8, (64,))
    label = lambda h: dp.graph_label(h, 64, 100)  # noqa: E731
    assert label(PrefillHint("dense", 8, (16,))) == "dense@16"
    assert label(PrefillHint("dense", 4, (16, 32))) == "dense@32"  # the largest block's keys
    assert label(PrefillHint("dense", 8, (48,))) == "dense"
    assert label(None) == "sparse" and label(PrefillHint("masked", 8, (80,))) == "sparse"
    assert label(plan_prefill([list(range(80))], 64, 100, 0, min_tokens=2)) == "split"


# ---- the attention, on random inputs ----
def _inputs(B, T, S, pos_rows, seed=0, dtype=torch.float32, device="cpu", topk=None, **over):
    model, _ = planned_sharp("F", "model.num_layers=1", *(f"model.{k}={v}" for k, v in over.items()))
    torch.manual_seed(seed)
    mla = MLA(model, 0, "F", 0).to(device=device, dtype=dtype)
    for p in mla.parameters():  # scores of order one at any width: softmax neither flat nor one-hot
        torch.nn.init.normal_(p, std=2 * p.shape[-1] ** -0.5)
    H, N, R, C = mla.n_heads, mla.nope, mla.rope, mla.kv_lora_rank
    pos = torch.tensor(pos_rows, device=device)
    q = torch.randn(B, T, H, N + R, device=device, dtype=dtype)
    kv = torch.full((B, S, C + R), float("nan"), device=device, dtype=dtype)  # unwritten rows are NaN
    for b in range(B):
        n = int(pos[b].max()) + 1
        kv[b, :n] = torch.randn(n, C + R, device=device, dtype=dtype)
    cos, sin = rope_angles(pos, R, model.rope_theta)
    g = torch.Generator().manual_seed(seed)
    idx = torch.full((B, T, topk or 1), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(T):
            p = int(pos[b, t])
            if p >= 0 and topk:  # a random subset of the causal keys, at most topk, always holding key p
                keep = torch.randperm(p + 1, generator=g)[: min(topk, p + 1) - 1]
                sel = torch.cat([torch.tensor([p]), keep[keep != p]])[: min(topk, p + 1)]
                idx[b, t, : len(sel)] = sel.int()
    return mla, q, kv, pos, cos, sin, idx.to(device)


def naive(mla, q, kv, pos, cos, sin, indices=None):
    """Per query and head, in fp32, from the weights (not dense_prefill's head tensors): softmax over the visible (or
    selected) keys of [q_nope | rope q_pe] . [W_UK c | k_pe] * scale, times W_UV c. A padding query gets 0."""
    H, N, V, C = mla.n_heads, mla.nope, mla.v_dim, mla.kv_lora_rank
    w = mla.wkv_b.weight.detach().float().cpu().view(H, N + V, C)
    lat = torch.nan_to_num(kv.float()).cpu()
    qf = q.float().cpu()
    qh = torch.cat([qf[..., :N], rope_naive(qf[..., N:], cos.cpu(), sin.cpu())], dim=-1)  # [B, T, H, N + R]
    kh = torch.einsum("bsc,hnc->bhsn", lat[..., :C], w[:, :N])
    kh = torch.cat([kh, lat[:, None, :, C:].expand(-1, H, -1, -1)], dim=-1)  # [B, H, S, N + R]
    vh = torch.einsum("bsc,hvc->bhsv", lat[..., :C], w[:, N:])  # [B, H, S, V]
    B, T = q.shape[:2]
    out = torch.zeros(B, T, H, V)
    for b in range(B):
        for t in range(T):
            p = int(pos[b, t])
            if p < 0:
                continue
            keys = torch.arange(p + 1) if indices is None else indices[b, t][indices[b, t] >= 0].long().cpu()
            s = torch.einsum("hd,hkd->hk", qh[b, t], kh[b][:, keys]) * mla.sm_scale
            out[b, t] = torch.einsum("hk,hkd->hd", s.softmax(-1), vh[b][:, keys])
    return out.reshape(B, T, -1)


def attend(mla, q, kv, pos, cos, sin, hint, indices=None):
    """`prefill_attention` as the layer calls it (q_pe rotated in place, here on a copy), padding rows zeroed."""
    q_rot = rotate_query_pe_(q.clone(), cos, sin, mla.nope)
    return zero_padding(prefill_attention(mla, q_rot, kv, pos, hint, indices), pos)


def _absorbed(mla, q, kv, cos, sin, indices):
    """The sparse path's attention (absorbed, sparse_mla over indices) with NaN rows cleaned for the reference."""
    return mla._attend(q, torch.nan_to_num(kv), indices, cos, sin)


@torch.no_grad()
def test_head_tensors_and_the_in_place_query_rotation():
    """Two sequences: q_pe rotated in place (q_nope untouched, the same tensor returned); k and v from the batched
    up-projection into strided buffers equal the fp32 einsums, k's rope dims the shared rope key."""
    mla, q, kv, pos, cos, sin, _ = _inputs(2, 5, 9, [[0, 1, 2, 3, 4], [2, 3, 4, 5, 6]])
    kv = torch.randn_like(kv)
    H, N, V, C = mla.n_heads, mla.nope, mla.v_dim, mla.kv_lora_rank
    q0 = q.clone()
    out = rotate_query_pe_(q, cos, sin, N)
    assert out.data_ptr() == q.data_ptr()
    torch.testing.assert_close(q[..., :N], q0[..., :N], rtol=0, atol=0)
    torch.testing.assert_close(q[..., N:], rope_naive(q0[..., N:], cos, sin))
    qh, kh, vh = dp.head_tensors(mla, q, kv)
    w = mla.wkv_b.weight.view(H, N + V, C)
    assert qh.data_ptr() == q.data_ptr() and qh.shape == (2, H, 5, N + mla.rope)
    torch.testing.assert_close(kh[..., :N], torch.einsum("bsc,hnc->bhsn", kv[..., :C], w[:, :N]))
    torch.testing.assert_close(kh[..., N:], kv[:, None, :, C:].expand(-1, H, -1, -1), rtol=0, atol=0)
    torch.testing.assert_close(vh, torch.einsum("bsc,hvc->bhsv", kv[..., :C], w[:, N:]))


CASES = {
    # first chunk of two rows and a padding row: causal SDPA
    "dense_causal": ([[0, 1, 2, 3, 4, 5], [0, 1, 2, -1, -1, -1], [-1] * 6], 16, None),
    # a later chunk (offsets differ per row): position mask, two query blocks
    "dense_offset": ([[8, 9, 10, 11, 12, 13], [3, 4, 5, 6, -1, -1], [-1] * 6], 16, None),
    # above top-k: the top-k key mask
    "masked": ([[30, 31, 32, 33, 34, 35], [17, 18, 19, -1, -1, -1], [-1] * 6], 6, 48),
}


@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_prefill_attention_matches_naive_and_the_sparse_path(case):
    pos_rows, topk, max_keys = CASES[case]
    S = 41
    mla, q, kv, pos, cos, sin, idx = _inputs(3, 6, S, pos_rows, topk=topk if max_keys else None)
    top = 16 if max_keys is None else topk
    hint = plan_prefill(pos_rows, topk=top, cache_rows=S, max_keys=max_keys or 0, min_tokens=1, block=4)
    assert hint.path == ("dense" if max_keys is None else "masked")
    assert hint.causal == (case == "dense_causal")
    indices = idx if max_keys else causal_indices(pos, S)
    got = attend(mla, q, kv, pos, cos, sin, hint, idx if max_keys else None)
    ref = naive(mla, q, kv, pos, cos, sin, idx if max_keys else None)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, _absorbed(mla, q, kv, cos, sin, indices), rtol=1e-5, atol=1e-5)
    if max_keys is None:  # the static graph hint (one block over the first top-k keys, masks): the same numbers
        static = graph_hint(hint.path, 6, 16, S)
        static_out = attend(mla, q, kv, pos, cos, sin, static)
        torch.testing.assert_close(static_out, ref, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_split_attention_is_causal_then_masked_like_naive():
    """A split hint's columns: 2 causal (every visible key fits top-k 2), then two masked blocks of 2 over the top-k
    mask; a shorter row and a padding row; NaN in unwritten cache rows. Equal to the naive reference over the
    selected keys and to the sparse path."""
    rows, S = [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, -1, -1], [-1] * 6], 41
    mla, q, kv, pos, cos, sin, idx = _inputs(3, 6, S, rows, topk=2)
    hint = plan_prefill(rows, topk=2, cache_rows=S, max_keys=16, min_tokens=2, block=2)
    assert (hint.path, hint.dense_cols, hint.masked_cols, hint.ends) == ("split", 2, 4, (16, 16))
    got = attend(mla, q, kv, pos, cos, sin, hint, idx)
    ref = naive(mla, q, kv, pos, cos, sin, idx)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, _absorbed(mla, q, kv, cos, sin, idx), rtol=1e-5, atol=1e-5)


# ---- stages with serving caches ----
def _caches(model, plan, device="cpu", dtype=torch.float32, rows=3, context=32, chunk=5):
    """Serving caches with NaN in every row (a row a query must not see stays NaN)."""
    caches = [stage_cache(model, plan, i, rows, context, chunk, device, dtype) for i in range(plan.num_stages)]
    for c in caches:
        for t in (*c.kv.values(), *c.index_k.values()):
            t.fill_(float("nan"))
    return caches


def _run(stages, caches, x, pos, hint, decode=False):
    """One prefill pass (or decode step) through every stage (cross-stage indices handed on) -> last stage's logits."""
    idx = None
    for s, c in zip(stages, caches):
        given = idx if s.incoming_source is not None else None
        if decode:
            x = s.forward_decode(x, pos, c, indices_in=given)
        else:
            x = s.forward_prefill(x, pos, c, indices_in=given, hint=hint)
        idx = s.take_indices(x)
    return x


def _prefill_then_decode(stages, caches, seqs, prompts, chunk, hints, topk, max_keys):
    """Chunked prefill of two sequences plus a padding row, then 3 decode steps -> [(path, logits, positions)]."""
    outs, dev = [], seqs[0].device
    for c0 in range(0, max(prompts), chunk):
        spans = [list(range(c0, min(c0 + chunk, P))) for P in prompts]
        T = max(len(p) for p in spans)
        x, pos = torch.zeros(3, T, dtype=torch.long, device=dev), torch.full((3, T), -1, device=dev)
        for b, p in enumerate(spans):
            x[b, : len(p)], pos[b, : len(p)] = seqs[b][p], torch.tensor(p, dtype=torch.long)
        rows = caches[0].max_context + 1
        hint = plan_prefill(pos.tolist(), topk, rows, max_keys, min_tokens=2, block=4) if hints else None
        outs.append((hint.path if hint else "sparse", _run(stages, caches, x, pos, hint), pos))
    for k in range(3):
        x = torch.stack([s[P + k : P + k + 1] for s, P in zip(seqs, prompts)] + [seqs[0][:1] * 0])
        pos = torch.tensor([[P + k] for P in prompts] + [[-1]], device=dev)
        outs.append(("decode", _run(stages, caches, x, pos, None, decode=True), pos))
    return outs


def _compare(got, ref, tol, rel=None):
    """Logits of the real positions: close elementwise (fp32), or in relative norm per pass (bf16: `rel`)."""
    for (path, a, pos), (_, b, _) in zip(got, ref):
        real = pos >= 0
        assert torch.isfinite(a[real]).all(), path
        if rel is None:
            torch.testing.assert_close(a[real].float(), b[real].float(), rtol=tol, atol=tol, msg=path)
        else:
            assert _rel_err(a[real], b[real]) < rel, path


def _rel_err(a, b):
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize(
    "topk,max_keys,chunk,paths",
    [(24, 0, 5, {"dense"}), (6, 40, 5, {"dense", "masked"}), (3, 0, 5, {"split"}), (2, 16, 21, {"split"})],
)
@torch.no_grad()
def test_stage_prefill_paths_equal_the_sparse_path_then_decode(topk, max_keys, chunk, paths):
    """Prompts of 21 and 13 tokens in chunks of 5 (padding columns and a padding row), two stages FSSS|FSS (S
    layers, cross-stage indices), NaN-poisoned caches: logits of every prefill chunk and of the decode steps after
    it (which read the indexer keys the dense path wrote) equal the sparse path's. topk 6: the first chunk runs
    dense, the later ones masked; topk 3: the first chunk splits (3 dense columns, 2 sparse), the rest sparse;
    topk 2 in one chunk of 21: 2 dense columns, 12 masked (blocks of 4), 7 sparse."""
    model, plan = planned_sharp(
        "FSSS|FSS", "model.num_layers=7", f"model.index_topk={topk}", "pipeline.cross_stage_indices=true"
    )
    stages = build_stages(model, plan, seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [21, 13]
    seqs = [torch.randint(0, V, (P + 3,), generator=g) for P in prompts]
    ref = _prefill_then_decode(stages, _caches(model, plan, chunk=chunk), seqs, prompts, chunk, False, topk, max_keys)
    got = _prefill_then_decode(stages, _caches(model, plan, chunk=chunk), seqs, prompts, chunk, True, topk, max_keys)
    assert {p for p, *_ in got} - {"decode", "sparse"} == paths  # a one-token tail chunk runs sparse
    _compare(got, ref, 1e-4)
    for (path, a, _), (_, b, _) in zip(got, ref):  # padding queries too: 0 attention on every path
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=path)


@torch.no_grad()
def test_hint_outside_a_sparse_prefill_of_several_tokens_is_refused():
    model, plan = planned_sharp("FS", "model.num_layers=2")
    (stage,) = build_stages(model, plan, seed=1)
    cache = stage_cache(model, plan, 0, 1, 16, 4)
    hint = PrefillHint("dense", 4, (16,))
    x, pos = torch.zeros(1, 4, dtype=torch.long), torch.arange(4).view(1, 4)
    with pytest.raises(ValueError, match="hint=.*attn='dense', T=4"):
        stage.forward_prefill(x, pos, cache, hint=hint, attn="dense")
    with pytest.raises(ValueError, match="hint=.*attn='sparse', T=1"):
        stage.forward_prefill(x[:, :1], pos[:, :1], cache, hint=hint)


# ---- the engine ----
@pytest.mark.parametrize(
    "topk,max_keys,paths",
    [
        (8, 24, {"dense", "masked", "sparse"}),  # 6-token chunks: first chunks dense, later ones masked or sparse
        (4, 0, {"split", "sparse"}),  # first chunks longer than top-k split: 4 dense columns, up to 2 sparse
        (4, 16, {"split", "masked", "sparse"}),  # the split's last 2 columns masked; later chunks masked to 16 keys
    ],
)
def test_engine_tokens_equal_with_short_prefill_on_and_off(topk, max_keys, paths, monkeypatch):
    """The eager engine plans every prefill pass's path; greedy tokens equal the run with serve.short_prefill=false,
    which plans nothing."""
    from test_generate import run as run_engine
    from test_generate import setup

    import dsaflow.serve.engine as engine_mod

    seen = []
    real_plan = engine_mod.plan_prefill
    monkeypatch.setattr(engine_mod, "plan_prefill", lambda *a, **k: seen.append(real_plan(*a, **k)) or seen[-1])
    monkeypatch.setattr(dp, "masked_max_keys", lambda model: max_keys)
    monkeypatch.setattr(dp, "MIN_PREFILL_TOKENS", 2)
    prompts = ["hello", "hi there, friend, how are you", "abc" * 9, "x"]
    base = [f"model.index_topk={topk}", "serve.max_batch=2", "serve.prefill_chunk=6", "model.init_std=0.3"]
    out_on, _ = run_engine(*setup(base), prompts)
    assert {h.path if h else "sparse" for h in seen} == paths
    n = len(seen)
    out_off, _ = run_engine(*setup([*base, "serve.short_prefill=false"]), prompts)
    assert len(seen) == n  # off: the engine plans nothing
    assert out_on == out_off and all(len(o) == 5 for o in out_on)


def test_engine_prefill_graph_blocks_per_path_replay_like_eager(monkeypatch):
    """Fake-captured prefill graphs: one block per path and class a pass can take (`prefill`, `prefill+dense`; a
    pass whose keys would take the masked path replays the sparse graph), replayed with static hints; tokens equal plain eager, logits equal the force-eager run of
    the same blocks bit for bit."""
    from test_generate import PROMPTS, _graph_cfg, same_logits
    from test_generate import run as run_engine
    from test_graphs_cpu import FakeCapturer

    monkeypatch.setattr(dp, "MIN_PREFILL_TOKENS", 2)
    monkeypatch.setattr(dp, "masked_max_keys", lambda model: 8192)  # masked eager passes: graphs replay sparse
    cfg, plan = _graph_cfg()
    ps = [*PROMPTS[:2], "abcdefghijklmnopqrstuvwxyz"]  # the last one above top-k 16: masked chunks
    out_g, eg = run_engine(cfg, plan, ps, record=True, capturer=FakeCapturer())
    prefill = [("prefill", (2, 8)), ("prefill+dense", (2, 8))]
    assert {(r.block, r.shape_class, r.stage) for r in eg.graphs.report().records} == {
        (b, c, s) for s in (0, 1) for b, cs in (("decode", (1, 2, 4)), *prefill) for c in cs
    }
    out_f, ef = run_engine(cfg, plan, ps, record=True, force_eager=True)
    assert out_f == out_g and same_logits(eg.logits_log, ef.logits_log)
    cfg_off, plan_off = _graph_cfg()
    cfg_off.serve.short_prefill = False
    out_off, _ = run_engine(cfg_off, plan_off, ps, capturer=FakeCapturer())
    assert out_off == out_g


def test_engine_dense_graphs_per_key_class_replay_like_eager(monkeypatch):
    """Top-k 64: dense prefill graphs for key classes 16, 32 and 64 (`prefill+dense@16`, `prefill+dense@32`,
    `prefill+dense`); each pass replays the smallest that holds its keys. Tokens equal the run without short
    prefill, logits the force-eager run of the same blocks bit for bit."""
    from test_generate import _graph_cfg, same_logits
    from test_generate import run as run_engine
    from test_graphs_cpu import FakeCapturer

    monkeypatch.setattr(dp, "MIN_PREFILL_TOKENS", 2)

    def cfg_plan(short=True):
        cfg, plan = _graph_cfg()
        cfg.model.index_topk, cfg.serve.short_prefill = 64, short
        return cfg, plan

    ps = ["hello", "hi there, friend", "abcdefghijklmnopqrstuvwxyz"]
    cfg, plan = cfg_plan()
    out_g, eg = run_engine(cfg, plan, ps, record=True, capturer=FakeCapturer())
    assert {"prefill+dense@16", "prefill+dense@32", "prefill+dense"} <= {r.block for r in eg.graphs.report().records}
    replayed, run_block = [], eg.graphs.run
    eg.graphs.run = lambda name, *a, **k: replayed.append(name) or run_block(name, *a, **k)
    assert eg.generate([list(p.encode()) for p in ps]) == out_g
    assert {"prefill+dense@16", "prefill+dense@32"} <= set(replayed)
    out_f, ef = run_engine(*cfg_plan(), ps, record=True, force_eager=True)
    assert out_f == out_g and same_logits(eg.logits_log, ef.logits_log)
    out_off, _ = run_engine(*cfg_plan(short=False), ps, capturer=FakeCapturer())
    assert out_off == out_g


def test_engine_split_graphs_replay_like_eager(monkeypatch):
    """Top-k 4 under prefill token classes 2 / 8: a first chunk of 5-8 tokens replays the `prefill+split` graph
    (captured with the static hint of an aligned 8-column pass: 4 causal columns, 4 masked), padded; tokens equal the
    run without short prefill, logits equal the force-eager run of the same blocks bit for bit."""
    from test_generate import _graph_cfg, same_logits
    from test_generate import run as run_engine
    from test_graphs_cpu import FakeCapturer

    monkeypatch.setattr(dp, "MIN_PREFILL_TOKENS", 2)
    monkeypatch.setattr(dp, "masked_max_keys", lambda model: 8192)
    cfg, plan = _graph_cfg()
    cfg.model.index_topk = 4
    ps = ["hello there", "abcdefghijklmnopqrstuvwxyz", "hi"]
    out_g, eg = run_engine(cfg, plan, ps, record=True, capturer=FakeCapturer())
    blocks = {(r.block, r.shape_class) for r in eg.graphs.report().records}
    assert {("prefill+split", 8), ("prefill+dense", 2), ("prefill+dense", 8)} <= blocks
    assert not any("masked" in b for b, _ in blocks)
    replayed, run_block = [], eg.graphs.run
    eg.graphs.run = lambda name, *a, **k: replayed.append(name) or run_block(name, *a, **k)
    assert eg.generate([list(p.encode()) for p in ps]) == out_g
    assert "prefill+split" in replayed
    out_f, ef = run_engine(cfg, plan, ps, record=True, force_eager=True)
    assert out_f == out_g and same_logits(eg.logits_log, ef.logits_log)
    cfg_off, plan_off = _graph_cfg()
    cfg_off.model.index_topk = 4
    cfg_off.serve.short_prefill = False
    out_off, _ = run_engine(cfg_off, plan_off, ps, capturer=FakeCapturer())
    assert out_off == out_g


# ---- GPU ----
@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_gpu_prefill_attention_bf16_matches_naive(case):
    """V3.2 head dims (nope 128, rope 64, v 128, latent 512), 16 heads, bf16, NaN in every unwritten cache row."""
    pos_rows, topk, max_keys = CASES[case]
    T, S = 300, 700
    rows = [_widen(r, T) for r in pos_rows]
    dims = dict(n_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    top = 512 if max_keys is None else 64  # dense: every extent (<= 338) fits top-k
    mla, q, kv, pos, cos, sin, idx = _inputs(
        3, T, S, rows, dtype=torch.bfloat16, device="cuda", topk=top if max_keys else None, **dims
    )
    hint = plan_prefill(rows, topk=top, cache_rows=S, max_keys=4096 if max_keys else 0, min_tokens=2)
    assert hint.path == ("dense" if max_keys is None else "masked") and hint.causal == (case == "dense_causal")
    got = attend(mla, q, kv, pos, cos, sin, hint, idx if max_keys else None)
    ref = naive(mla, q, kv, pos, cos, sin, idx.cpu() if max_keys else None)
    assert torch.isfinite(got).all()
    assert _rel_err(got, ref) < 1e-2


def _widen(row, T):
    """A 6-column case row -> T columns: the same start, the same share of padding."""
    start = row[0]
    if start < 0:
        return [-1] * T
    n = math.ceil(T * sum(p >= 0 for p in row) / len(row))
    return [start + t if t < n else -1 for t in range(T)]


@pytest.mark.gpu
@pytest.mark.parametrize("topk,max_keys", [(256, 0), (64, 4096), (64, 0)])
@torch.no_grad()
def test_gpu_stage_prefill_paths_match_the_sparse_path_bf16(topk, max_keys):
    """V3.2 head dims, 16 heads, FSSS, bf16 on the GPU, NaN-poisoned caches: prompts of 200 and 130 tokens in chunks of
    96. Both bf16 paths are measured against the fp32 sparse path on the CPU: the new paths must be as accurate as
    the sparse one, pass by pass (random weights make bf16 logits drift 13-30 % in relative norm from fp32 through
    four layers on either path, so the two bf16 paths are not compared with each other). (64, 0): the first chunk
    splits, 64 dense columns and 32 sparse."""
    over = ["model.n_heads=16", "model.kv_lora_rank=512", "model.qk_nope_head_dim=128", "model.qk_rope_head_dim=64"]
    model, plan = planned_sharp("FSSS", "model.num_layers=4", f"model.index_topk={topk}", "model.dim=256", *over)
    g = torch.Generator().manual_seed(0)
    prompts, chunk = [200, 130], 96
    seqs = [torch.randint(0, V, (P + 3,), generator=g) for P in prompts]
    cpu = build_stages(model, plan, seed=1)
    ref = _prefill_then_decode(
        cpu, _caches(model, plan, "cpu", torch.float32, 3, 256, chunk), seqs, prompts, chunk, False, topk, max_keys
    )
    stages = [s.to("cuda", torch.bfloat16) for s in build_stages(model, plan, seed=1)]
    seqs = [x.cuda() for x in seqs]
    caches = lambda: _caches(model, plan, "cuda", torch.bfloat16, 3, 256, chunk)  # noqa: E731
    sparse = _prefill_then_decode(stages, caches(), seqs, prompts, chunk, False, topk, max_keys)
    got = _prefill_then_decode(stages, caches(), seqs, prompts, chunk, True, topk, max_keys)
    assert {p for p, *_ in got} - {"decode", "sparse"}
    for (path, a, pos), (_, b, _), (_, r, _) in zip(got, sparse, ref):
        real = (pos >= 0).cpu()
        assert torch.isfinite(a[pos >= 0]).all(), path
        err_new, err_sparse = _rel_err(a.cpu()[real], r[real]), _rel_err(b.cpu()[real], r[real])
        assert err_new <= 1.1 * err_sparse + 0.01, (path, err_new, err_sparse)


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [128, 16])
def test_gpu_prefill_graphs_of_each_path_replay_bitwise_equal_to_eager(topk, monkeypatch):
    """topk 128: every prompt (5..70 tokens) prefills dense, through the dense graph of the smallest key class that
    holds the pass (32, 64 or 128 keys); topk 16: first chunks above 16 tokens replay the split
    graph (16 causal columns, then masked), later chunks above 16 keys, where eager passes would run masked, the
    sparse graph (no masked graph is captured). The prefill graph blocks of the path replay (checked by name) and
    equal the force-eager run of the same blocks bit for bit."""
    from test_graphs_gpu import assert_bitwise, make, prompts
    from test_graphs_gpu import run as run_gpu

    monkeypatch.setattr(dp, "MIN_PREFILL_TOKENS", 2)
    monkeypatch.setattr(dp, "masked_max_keys", lambda model: 8192)
    cfg, plan = make([f"model.index_topk={topk}"])
    ps = prompts(5, seed=3)
    out_g, eg, report = run_gpu(cfg, plan, ps, strict=True)
    assert report.records and all(r.status == "captured" for r in report.records)
    replayed, run_block = [], eg.graphs.run
    eg.graphs.run = lambda name, *a, **k: replayed.append(name) or run_block(name, *a, **k)
    out_g = eg.generate(ps)
    if topk == 128:  # dense graphs of key classes 32 / 64 / 128: the short prompts' passes take the smaller ones
        assert any(name.startswith("prefill+dense@") for name in replayed)
    else:
        assert "prefill+split" in replayed  # first chunks above 16 tokens split
    assert not any("+masked" in r.block for r in report.records)
    out_e, ee, _ = run_gpu(cfg, plan, ps, force_eager=True)
    assert_bitwise(eg.logits_log, ee.logits_log)
    assert out_g == out_e
