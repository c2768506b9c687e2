"""The naive fp32 op references against independent dense float64 computations: forward and every gradient."""

import pytest
import torch

from dsaflow.ops import indexer_topk, sparse_mla
from dsaflow.ops.indexer_topk import indexer_scores_naive, indexer_topk_naive, topk_from_scores
from dsaflow.ops.sparse_mla import sparse_mla_naive


def _gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def dense_index_scores_f64(q, k, w, positions):
    """Broadcast-and-sum float64 index scores [B, T, S] and visibility [B, T, S] (no einsum, no masked_fill)."""
    q, k, w = q.double(), k.double(), w.double()
    dots = (q.unsqueeze(3) * k.unsqueeze(1).unsqueeze(1)).sum(-1)  # [B, T, H, S]
    scores = (dots.clamp_min(0) * w.unsqueeze(-1)).sum(2)
    s = torch.arange(k.shape[1])
    vis = (s.view(1, 1, -1) <= positions.unsqueeze(-1)) & (positions.unsqueeze(-1) >= 0)
    return scores, vis


def _indexer_inputs(seed, B=2, T=9, S=13, H=3, D=8, requires_grad=False):
    g = _gen(seed)
    q = torch.randn(B, T, H, D, generator=g)
    k = torch.randn(B, S, D, generator=g)
    w = torch.randn(B, T, H, generator=g)
    # decode-style positions: queries sit at the end of a longer key row, one padding query per batch row
    positions = torch.stack([torch.arange(S - T, S), torch.arange(T) + 1])
    positions[0, 2] = -1
    positions[1, -1] = -1
    for t in (q, k, w):
        t.requires_grad_(requires_grad)
    return q, k, w, positions


@pytest.mark.parametrize("seed", [0, 1])
def test_indexer_scores_forward_and_gradients_match_f64(seed):
    q, k, w, positions = _indexer_inputs(seed, requires_grad=True)
    got = indexer_scores_naive(q, k, w, positions)
    ref, vis = dense_index_scores_f64(q, k, w, positions)
    assert torch.equal(torch.isinf(got), ~vis) and (got[~vis] < 0).all()
    torch.testing.assert_close(got[vis].double(), ref[vis], rtol=1e-5, atol=1e-5)
    g = torch.randn(ref.shape, generator=_gen(seed + 100)) * vis
    grads = torch.autograd.grad((got.masked_fill(~vis, 0) * g).sum(), (q, k, w))
    ref_grads = torch.autograd.grad((ref * g.double()).sum(), (q, k, w))
    for name, a, b in zip("qkw", grads, ref_grads):
        assert a.abs().sum() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("seed,topk", [(0, 4), (1, 6), (2, 20)])
def test_indexer_topk_selects_best_visible_keys(seed, topk):
    q, k, w, positions = _indexer_inputs(seed)
    idx = indexer_topk(q, k, w, positions, topk)
    ref, vis = dense_index_scores_f64(q, k, w, positions)
    assert idx.dtype == torch.int32 and idx.shape == (*positions.shape, topk)
    n_vis = vis.sum(-1)
    for b in range(idx.shape[0]):
        for t in range(idx.shape[1]):
            sel = idx[b, t]
            n = min(topk, int(n_vis[b, t]))
            assert (sel[n:] == -1).all() and (sel[:n] >= 0).all()
            chosen = sel[:n].long()
            assert len(set(chosen.tolist())) == n and vis[b, t, chosen].all()
            s = ref[b, t, chosen]
            assert (chosen[1:] > chosen[:-1]).all(), "ascending key order"
            if n < int(n_vis[b, t]):  # every unselected visible key scores no better than the worst selected one
                rest = vis[b, t].clone()
                rest[chosen] = False
                assert ref[b, t][rest].max() <= s.min() + 1e-6


def test_indexer_topk_chunking_and_padding_queries():
    q, k, w, positions = _indexer_inputs(3, T=11, S=17)
    whole = topk_from_scores(indexer_scores_naive(q, k, w, positions), 5)
    assert torch.equal(indexer_topk_naive(q, k, w, positions, 5, chunk=3), whole)
    assert (whole[0, 2] == -1).all() and (whole[1, -1] == -1).all()  # padding queries select nothing


def test_indexer_topk_ties_break_to_lower_index():
    """Exact ties (common: all relu logits 0) are resolved deterministically, whatever the key row length."""
    B, T, H, D = 1, 1, 2, 4
    q = torch.ones(B, T, H, D)
    k = torch.zeros(B, 10, D)
    k[0, 7] = 1.0  # the only positive key; all others tie at exactly 0
    w = torch.ones(B, T, H)
    idx = indexer_topk(q, k, w, torch.tensor([[8]]), 4)
    assert idx.tolist() == [[[0, 1, 2, 7]]]  # the best 4 (7, then 0, 1, 2 of the ties) in key order
    longer = torch.cat([k, torch.randn(B, 30, D)], dim=1)  # extra invisible keys must not change the choice
    assert torch.equal(indexer_topk(q, longer, w, torch.tensor([[8]]), 4), idx)


def dense_attention_f64(q, kv, mask, sm_scale, d_v):
    """Plain masked softmax attention in float64: q [B, T, H, D], kv [B, S, D], mask [B, T, S] bool."""
    q, kv = q.double(), kv.double()
    s = torch.einsum("bthd,bsd->bths", q, kv) * sm_scale
    s = s.masked_fill(~mask.unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.where(mask.unsqueeze(2), torch.exp(s - lse.nan_to_num(neginf=0).unsqueeze(-1)), torch.zeros_like(s))
    return torch.einsum("bths,bsd->bthd", p, kv[..., :d_v]), lse


def _sparse_inputs(seed, B=2, T=6, S=11, H=3, D=12, K=5):
    g = _gen(seed)
    q = torch.randn(B, T, H, D, generator=g, requires_grad=True)
    kv = torch.randn(B, S, D, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(B * T)]).view(B, T, K).int()
    idx[0, 1, 2] = -1  # padding
    idx[1, 3, 0] = S + 4  # out of range = no key
    idx[1, 4, :] = -1  # a query with no key at all
    idx[0, 5, 1:3] = torch.tensor([-1, S])
    mask = torch.zeros(B, T, S, dtype=torch.bool)
    valid = (idx >= 0) & (idx < S)
    for b in range(B):
        for t in range(T):
            mask[b, t, idx[b, t][valid[b, t]].long()] = True
    return q, kv, idx, mask


@pytest.mark.parametrize("seed,d_v", [(0, 8), (1, 12)])
def test_sparse_mla_forward_and_gradients_match_f64(seed, d_v):
    q, kv, idx, mask = _sparse_inputs(seed)
    scale = q.shape[-1] ** -0.5
    out, lse = sparse_mla(q, kv, idx, scale, d_v)
    ref_out, ref_lse = dense_attention_f64(q, kv, mask, scale, d_v)
    assert out.shape == (*q.shape[:3], d_v) and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and (out[1, 4] == 0).all()
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin], rtol=1e-5, atol=1e-5)
    g_out = torch.randn(out.shape, generator=_gen(seed + 7))
    g_lse = torch.randn(lse.shape, generator=_gen(seed + 8)) * fin
    loss = (out * g_out).sum() + (lse.masked_fill(~fin, 0) * g_lse).sum()
    ref_loss = (ref_out * g_out.double()).sum() + (ref_lse.masked_fill(~fin, 0) * g_lse.double()).sum()
    grads = torch.autograd.grad(loss, (q, kv))
    ref_grads = torch.autograd.grad(ref_loss, (q, kv))
    for name, a, b in zip(("q", "kv"), grads, ref_grads):
        assert torch.isfinite(a).all() and a.abs().sum() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")


def test_sparse_mla_chunking_is_invisible():
    q, kv, idx, _ = _sparse_inputs(4, T=10)
    a = sparse_mla_naive(q, kv, idx, 0.3, 8, chunk=3)
    b = sparse_mla_naive(q, kv, idx, 0.3, 8, chunk=256)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=1e-6)


def test_sparse_equals_dense_causal_when_topk_covers_the_context():
    g = _gen(5)
    B, T, H, D, HI, DI = 2, 7, 2, 10, 2, 6
    q = torch.randn(B, T, H, D, generator=g)
    kv = torch.randn(B, T, D, generator=g)
    positions = torch.arange(T).expand(B, T)
    idx = indexer_topk(
        torch.randn(B, T, HI, DI, generator=g),
        torch.randn(B, T, DI, generator=g),
        torch.randn(B, T, HI, generator=g),
        positions,
        topk=T + 3,
    )
    out, lse = sparse_mla(q, kv, idx, 0.25, 6)
    causal = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    ref_out, ref_lse = dense_attention_f64(q, kv, causal, 0.25, 6)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_sparse_mla_missing_keys_ignore_garbage_rows():
    """-1 / out-of-range indices are clamped for the gather; the row they land on must not leak (NaN cache rows)."""
    q, kv, idx, mask = _sparse_inputs(6)
    idx = torch.where(idx == 0, torch.full_like(idx, -1), idx)  # no query selects row 0 ...
    mask[..., 0] = False
    with torch.no_grad():
        kv[:, 0] = float("nan")  # ... and row 0 is garbage
    out, lse = sparse_mla(q, kv, idx, 0.3, 8)
    ref_out, ref_lse = dense_attention_f64(q.detach(), kv.detach().nan_to_num(), mask, 0.3, 8)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all() and torch.equal(torch.isinf(lse), ~fin)
