"""The Hopper (sm_90) Gluon pass 1 of the sparse MLA backward (`hopper_backward.py`): G against an fp32 reference,
the whole backward against the naive fp32 autograd and against the portable pass 1, its capability rule and its row
in the backward dispatch table.

The Gluon kernel does not run in the CPU interpreter: the CPU tests check the rule only. `gpu` tests skip unless a
CUDA device of compute capability 9.x is present. G and the partial sums are NaN-poisoned before the kernel writes
them; inputs come from seeded generators.
"""

from __future__ import annotations

import pytest
import torch

from dsaflow.ops.sparse_mla import dispatch as bd
from dsaflow.ops.sparse_mla import function
from dsaflow.ops.sparse_mla.hopper_backward import BLOCK_K, hopper_bwd_supports, launch_hopper_ds
from dsaflow.ops.sparse_mla.naive import sparse_mla_naive
from dsaflow.ops.sparse_mla.triton_backward import sparse_mla_bwd_triton
from dsaflow.ops.sparse_mla.triton_prefill import key_extent

IS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
hopper_only = pytest.mark.skipif(not IS_HOPPER, reason="needs an sm_90 GPU (H100/H200)")
SCALE = 576**-0.5


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    assert not torch.isnan(x).any(), "NaN in kernel output (unwritten or invalid)"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ---- CPU: the rule ----


def test_rule_refuses_cpu_and_other_shapes():
    z = lambda *s, dtype=torch.bfloat16: torch.zeros(*s, dtype=dtype)
    q, kv, idx = z(1, 2, 128, 576), z(1, 8, 576), z(1, 2, 4, dtype=torch.int32)
    assert "device cpu" in hopper_bwd_supports(q, kv, idx, 512)
    choice = bd.explain_sparse_mla(q, kv, idx, 512, backward=True, deterministic=False)
    assert choice.kernel == "triton" and "hopper: device cpu" in choice.reasons()


def test_forcing_hopper_where_it_cannot_run_raises_with_the_reason(monkeypatch):
    from dsaflow.errors import PlanError

    monkeypatch.setenv(bd.ENV_BACKWARD, "hopper")
    bd.forced_backward.cache_clear()
    try:
        z = lambda *s, dtype=torch.bfloat16: torch.zeros(*s, dtype=dtype)
        with pytest.raises(PlanError, match=rf"{bd.ENV_BACKWARD}=hopper.*device cpu.*{bd.ENV_BACKWARD}=auto"):
            args = z(1, 2, 128, 576), z(1, 8, 576), z(1, 2, 4, dtype=torch.int32), 512
            function.backward_kernel(*args, lse_grad=False, probs_into=False, deterministic=False)
    finally:
        bd.forced_backward.cache_clear()


def test_portable_backward_refuses_an_unknown_pass1():
    z = torch.zeros
    with pytest.raises(ValueError, match="pass1='gluon'"):
        sparse_mla_bwd_triton(
            z(1, 1, 2, 8),
            z(1, 4, 8),
            z(1, 1, 2, dtype=torch.int32),
            z(1, 1, 2, 4),
            z(1, 1, 2),
            z(1, 1, 2, 4),
            None,
            0.5,
            4,
            pass1="gluon",
        )


# ---- GPU ----


def make_case(B, T, H, S, K, seed, layout="random", dtype=torch.bfloat16):
    """q, kv, indices (with -1, >= S and a query without keys, or a `layout_indices` layout), the forward's out and
    lse (from the naive reference, so they are consistent), a random d_out and d_lse."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, 576, generator=g).to("cuda", dtype)
    kv = torch.randn(B, S, 576, generator=g).to("cuda", dtype)
    if layout == "random":
        idx = torch.randint(0, S, (B, T, K), generator=g, dtype=torch.int32)
        idx[torch.rand(B, T, K, generator=g) < 0.1] = -1
        idx[torch.rand(B, T, K, generator=g) < 0.05] = S + 7
        idx[0, 1] = -1
    else:
        from test_ops_key_extent import layout_indices

        idx = layout_indices(layout, B, T, S, K, g)
    idx = idx.cuda()
    out, lse = sparse_mla_naive(q, kv, idx, SCALE, 512)
    d_out = torch.randn(B, T, H, 512, generator=g).to("cuda", dtype)
    d_lse = torch.randn(B, T, H, generator=g).cuda()
    return q, kv, idx, out.contiguous(), lse.contiguous(), d_out, d_lse


def reference_g(q, kv, idx, out, lse, d_out, d_lse):
    """fp32 dS and P [B*T, H, K] of pass 1 (0 at invalid slots), the valid mask [B*T, K], and the size of dS's terms
    P (|dP| + |delta|) scale [B*T, H, K]: dS cancels where a query has one valid key (its P is 1 and dP = delta), so
    it is compared against the size of its terms, not against itself."""
    B, T, H, _ = q.shape
    S = kv.shape[1]
    valid = (idx >= 0) & (idx < S)
    rows = kv.float()[torch.arange(B, device=kv.device).view(-1, 1, 1), idx.long().clamp(0, S - 1)]
    rows = torch.where(valid.unsqueeze(-1), rows, 0.0)
    s = torch.einsum("bthd,btkd->bthk", q.float(), rows) * SCALE
    p = torch.where(valid.unsqueeze(2), torch.exp(s - torch.where(lse.isinf(), 0.0, lse).unsqueeze(-1)), 0.0)
    dp = torch.einsum("bthd,btkd->bthk", d_out.float(), rows[..., :512])
    delta = (d_out.float() * out.float()).sum(-1) - (0.0 if d_lse is None else d_lse)
    ds = p * (dp - delta.unsqueeze(-1)) * SCALE
    terms = p * (dp.abs() + delta.abs().unsqueeze(-1)) * SCALE
    K = idx.shape[-1]
    return ds.reshape(B * T, H, K), p.reshape(B * T, H, K), valid.reshape(B * T, K), terms.reshape(B * T, H, K)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize(
    "layout,with_dlse,cfg",
    [
        ("random", True, None),
        ("edges", False, dict(PROGRAMS=5)),
        ("interleaved", True, dict(PROGRAMS=7)),
        ("topk", False, None),
    ],
)
def test_pass1_writes_g_and_head_sums_like_the_reference(layout, with_dlse, cfg):
    """A chunk of queries [q0, q0 + n): G below each query's extent (rounded up to BLOCK_K) matches the fp32 dS and P,
    exactly 0 at invalid slots; the head sums of P match; G's rows past the chunk stay untouched (NaN)."""
    B, T, H, S, K = 2, 24, 128, 3000, 1000
    q, kv, idx, out, lse, d_out, d_lse = make_case(B, T, H, S, K, seed=3, layout=layout)
    d_lse = d_lse if with_dlse else None
    n_keys = key_extent(idx, S)
    q0, n = 5, 37
    g = torch.full((n + 2, 2 * H, K), float("nan"), device="cuda", dtype=q.dtype)
    ps = torch.full((H // 64, n + 2, K), float("nan"), device="cuda")
    launch_hopper_ds(q, kv, idx, n_keys, d_out, out, lse, d_lse, g, ps, q0, n, SCALE, cfg)
    ds_ref, p_ref, valid, terms = reference_g(q, kv, idx, out, lse, d_out, d_lse)
    ext = n_keys.view(-1)[q0 : q0 + n].long()
    n_g = ((ext + BLOCK_K - 1) // BLOCK_K * BLOCK_K).clamp(max=K)
    for i in range(n):
        e = int(n_g[i])
        got_ds, got_p = g[i, :H, :e], g[i, H:, :e]
        if e:
            assert rel_err(got_p, p_ref[q0 + i, :, :e]) < 1e-2
            ds_err = (got_ds.double() - ds_ref[q0 + i, :, :e]).norm() / terms[q0 + i, :, :e].norm().clamp_min(1e-30)
            assert not torch.isnan(got_ds).any() and ds_err < 1e-2
            dead = ~valid[q0 + i, :e]
            assert (got_p[:, dead] == 0).all() and (got_ds[:, dead] == 0).all()
            assert rel_err(ps[:, i, :e].sum(0), p_ref[q0 + i, :, :e].sum(0)) < 1e-3
        assert torch.isnan(g[i, :, e:]).all(), "G past the extent's last block is never written"
    assert torch.isnan(g[n:]).all() and torch.isnan(ps[:, n:]).all()


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_with_hopper_pass1_matches_naive_and_portable(deterministic):
    """dq, dkv (a loss on out and lse) and the indexer-loss target: the Hopper pass 1 against the naive fp32
    autograd and against the portable pass 1."""
    from dsaflow.ops.indexer_loss import attention_target_naive

    B, T, H, S, K = 1, 48, 128, 2500, 768
    q, kv, idx, out, lse, d_out, d_lse = make_case(B, T, H, S, K, seed=5)
    qf, kvf = q.float().requires_grad_(True), kv.float().requires_grad_(True)
    ref_out, ref_lse = sparse_mla_naive(qf, kvf, idx, SCALE, 512)
    fin = torch.isfinite(ref_lse)
    loss = (ref_out * d_out.float()).sum() + (torch.where(fin, ref_lse, 0.0) * d_lse).sum()
    ref_dq, ref_dkv = torch.autograd.grad(loss, (qf, kvf))
    got = {}
    for pass1 in ("hopper", "triton"):
        target = torch.zeros(B, T, K, device="cuda")
        dq, dkv = sparse_mla_bwd_triton(
            q,
            kv,
            idx,
            out,
            lse,
            d_out,
            d_lse,
            SCALE,
            512,
            deterministic=deterministic,
            probs_into=(target, 0.5),
            pass1=pass1,
        )
        got[pass1] = dq, dkv, target
        assert rel_err(dq, ref_dq) < 2e-2 and rel_err(dkv, ref_dkv) < 2e-2
    want_target = attention_target_naive(q.float(), kv.float(), idx, ref_lse.detach(), SCALE, weight=0.5)
    assert rel_err(got["hopper"][2], want_target) < 1e-3
    for a, b in zip(got["hopper"], got["triton"]):
        assert rel_err(a, b) < 5e-3
    if deterministic:
        again = sparse_mla_bwd_triton(
            q, kv, idx, out, lse, d_out, d_lse, SCALE, 512, deterministic=True, pass1="hopper"
        )
        assert torch.equal(again[0], got["hopper"][0]) and torch.equal(again[1], got["hopper"][1])


@pytest.mark.gpu
@hopper_only
def test_pass1_graph_replay_is_bitwise_eager():
    B, T, H, S, K = 1, 16, 128, 4096, 2048
    q, kv, idx, out, lse, d_out, _ = make_case(B, T, H, S, K, seed=9)
    n_keys = key_extent(idx, S)
    bufs = [
        (
            torch.full((T, 2 * H, K), float("nan"), device="cuda", dtype=q.dtype),
            torch.full((H // 64, T, K), float("nan"), device="cuda"),
        )
        for _ in range(2)
    ]
    launch_hopper_ds(q, kv, idx, n_keys, d_out, out, lse, None, *bufs[0], 0, T, SCALE)
    launch_hopper_ds(q, kv, idx, n_keys, d_out, out, lse, None, *bufs[1], 0, T, SCALE)  # compile outside capture
    bufs[1][0].fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_hopper_ds(q, kv, idx, n_keys, d_out, out, lse, None, *bufs[1], 0, T, SCALE)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bufs[0][0].nan_to_num(7.0), bufs[1][0].nan_to_num(7.0))
    assert torch.equal(bufs[0][1].nan_to_num(7.0), bufs[1][1].nan_to_num(7.0))


@pytest.mark.gpu
@hopper_only
def test_dispatch_picks_hopper_for_deepseek_shapes_on_sm90(monkeypatch):
    monkeypatch.setenv(bd.ENV_BACKWARD, "dsaflow")
    bd.forced_backward.cache_clear()
    try:
        z = lambda *s, dtype=torch.bfloat16: torch.zeros(*s, dtype=dtype, device="cuda")
        choice = bd.explain_sparse_mla(
            z(1, 2, 128, 576), z(1, 8, 576), z(1, 2, 4, dtype=torch.int32), 512, backward=True
        )
        assert choice.kernel == "hopper"
        choice = bd.explain_sparse_mla(
            z(1, 2, 16, 576), z(1, 8, 576), z(1, 2, 4, dtype=torch.int32), 512, backward=True
        )
        assert choice.kernel == "triton" and "H=16" in choice.reasons()
        monkeypatch.setenv(bd.ENV_BACKWARD, "triton")  # the portable pass 1 on demand
        bd.forced_backward.cache_clear()
        choice = bd.explain_sparse_mla(
            z(1, 2, 128, 576), z(1, 8, 576), z(1, 2, 4, dtype=torch.int32), 512, backward=True
        )
        assert choice.kernel == "triton" and f"{bd.ENV_BACKWARD}=triton" in choice.reasons()
    finally:
        bd.forced_backward.cache_clear()
