"""Fused indexer-loss kernels (attention target, KL forward / backward) vs the naive fp32 references.

Without CUDA these run on CPU through TRITON_INTERPRET=1 (conftest.py) at tiny shapes in fp32 and fp16 (the
interpreter's bf16 dot is wrong). Every input comes from a seeded generator; kernel outputs are NaN-poisoned first.
Indices are duplicate-free per query and include invalid ones (< 0 and >= S) and one query with no valid key.
`gpu` tests repeat the checks at DeepSeek-V3.2 shapes with bf16 inputs (fp32 math).
"""

from __future__ import annotations

import pytest
import torch
from ops_helpers import FakeCuda

from dsaflow.ops.indexer_loss import (
    attention_distribution,
    attention_target,
    attention_target_naive,
    indexer_kl,
    indexer_kl_naive,
)
from dsaflow.ops.indexer_loss.function import IndexerKLFunction
from dsaflow.ops.indexer_loss.triton_kl import launch_indexer_kl_bwd, launch_indexer_kl_fwd
from dsaflow.ops.indexer_loss.triton_target import attention_target_triton, launch_attention_target, split_dims
from dsaflow.ops.sparse_mla import sparse_mla_naive

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    assert not torch.isnan(x).any(), "NaN in kernel output (unwritten or invalid)"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_indices(B, T, S, K, g, invalid=True, device=DEV):
    """int32 [B, T, K], duplicate-free per query; with `invalid`, entries in [-3, 0) and [S, S + 3) and query
    (0, 1) with no valid key at all."""
    lo, span = (-3, S + 6) if invalid else (0, S)
    assert K <= span
    idx = torch.stack([torch.randperm(span, generator=g)[:K] for _ in range(B * T)]).view(B, T, K) + lo
    if invalid:
        idx[0, min(1, T - 1)] = -1
    return idx.to(torch.int32).to(device)


def make_attention(B, T, H, d_qk, S, K, dtype, seed, invalid=True, idx=None):
    """q, kv (dtype), indices, lse (fp32, from the naive sparse MLA on the same rounded inputs), sm_scale."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, T, H, d_qk, generator=g) * 0.5).to(DEV, dtype)
    kv = (torch.randn(B, S, d_qk, generator=g) * 0.5).to(DEV, dtype)
    if idx is None:
        idx = make_indices(B, T, S, K, g, invalid)
    scale = d_qk**-0.5
    _, lse = sparse_mla_naive(q.float(), kv.float(), idx, scale, split_dims(d_qk))
    return q, kv, idx, lse, scale


def make_indexer(B, T, H_I, D_I, S, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H_I, D_I, generator=g).to(DEV, dtype)
    k = torch.randn(B, S, D_I, generator=g).to(DEV, dtype)
    w = (torch.randn(B, T, H_I, generator=g) * H_I**-0.5).to(DEV, dtype)
    return q, k, w


# ---------------------------------------------------------------------------------------------- CPU (interpreter)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("H,d_qk,K", [(4, 40, 16), (20, 48, 12), (3, 32, 7)])
def test_attention_target_matches_reference(dtype, H, d_qk, K):
    """Padded head / key / dim blocks, a value + tail split (40 = 32 + 8), no tail (32), several head blocks (20)."""
    B, T, S = 2, 5, 23
    q, kv, idx, lse, scale = make_attention(B, T, H, d_qk, S, K, dtype, seed=H + K)
    ref = attention_distribution(q.float(), kv.float(), idx, lse, scale)
    out = torch.full((B, T, K), float("nan"), device=DEV)
    launch_attention_target(q, kv, idx, lse, scale, split_dims(d_qk), out, 1.0, False, dict(BLOCK_H=16, BLOCK_K=16))
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 3e-3)
    assert (out[0, 1] == 0).all(), "a query with no valid key gets an all-zero row"
    assert (out[idx.long().lt(0) | idx.long().ge(S)] == 0).all(), "invalid keys get probability 0"
    sums = out.sum(-1)
    torch.testing.assert_close(sums[sums > 0], torch.ones_like(sums[sums > 0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_attention_target_accumulates_served_layers(dtype):
    """An F layer and two served S layers (same indices, own q / kv / lse) sum into one buffer with weight 1/3:
    equal to the mean of the three reference distributions, added onto what the buffer held."""
    B, T, H, d_qk, S, K = 2, 6, 4, 40, 19, 8
    g = torch.Generator().manual_seed(11)
    idx = make_indices(B, T, S, K, g)
    prior = torch.rand(B, T, K, generator=g).to(DEV)
    out = prior.clone()
    refs = []
    for layer in range(3):
        q, kv, _, lse, scale = make_attention(B, T, H, d_qk, S, K, dtype, seed=100 + layer, idx=idx)
        attention_target_triton(q, kv, idx, lse, scale, out=out, weight=1 / 3)
        refs.append(attention_distribution(q.float(), kv.float(), idx, lse, scale))
    ref = prior + torch.stack(refs).mean(0)
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 3e-3)


def test_attention_target_dispatch_and_contract():
    """The public op: naive on CPU tensors; accumulating into `out` returns `out`; a bad buffer is refused."""
    q, kv, idx, lse, scale = make_attention(1, 3, 2, 24, 9, 4, torch.float32, seed=5)
    a = attention_target(q, kv, idx, lse, scale)
    buf = torch.zeros_like(a)
    assert attention_target(q, kv, idx, lse, scale, out=buf, weight=0.5) is buf
    torch.testing.assert_close(buf, a * 0.5)
    with pytest.raises(ValueError, match="out must be fp32"):
        attention_target_triton(q, kv, idx, lse, scale, out=torch.zeros(1, 3, 4, dtype=torch.float64))


def random_target(idx, S, g):
    """A distribution over each query's valid keys (rows sum to 1; 0 on invalid keys), with some exact zeros."""
    valid = (idx.long() >= 0) & (idx.long() < S)
    t = torch.rand(idx.shape, generator=g).to(idx.device) * valid
    t = torch.where(t < 0.2, torch.zeros_like(t), t)
    return t / t.sum(-1, keepdim=True).clamp_min(1e-30)


def check_kl(B, T, H_I, D_I, S, K, dtype, seed, loss_tol, grad_tol, overrides=None):
    g = torch.Generator().manual_seed(seed)
    idx = make_indices(B, T, S, K, g)
    target = random_target(idx, S, g)
    q, k, w = make_indexer(B, T, H_I, D_I, S, dtype, seed)
    qr, kr, wr = (x.detach().float().requires_grad_(True) for x in (q, k, w))
    ref = indexer_kl_naive(qr, kr, wr, idx, target)
    ref_grads = torch.autograd.grad(ref * 1.7, (qr, kr, wr))

    poisoned = torch.full((4, B * T), float("nan"), device=DEV)
    stats = launch_indexer_kl_fwd(q, k, w, idx, target, overrides, stats=poisoned)
    assert not torch.isnan(stats).any()
    assert stats[3, 1] == 0 and stats[0, 1] == 0, "the query with no valid key: KL 0, left out of the mean"
    n_valid = stats[3].sum()
    assert n_valid == B * T - 1
    loss = stats[0].sum() / n_valid
    assert abs(loss.item() - ref.item()) <= loss_tol * abs(ref.item())
    dq, dw = torch.full_like(q, float("nan")), torch.full_like(w, float("nan"))
    grads = launch_indexer_kl_bwd(q, k, w, idx, target, stats, (1.7 / n_valid).reshape(1), overrides, dq, dw)
    for name, got, want, x in zip("qkw", grads, ref_grads, (q, k, w)):
        assert got.dtype == x.dtype and got.shape == x.shape, name
        assert rel_err(got, want) < grad_tol, name

    # The autograd.Function gives the same loss and gradients as the launchers.
    qa, ka, wa = (x.detach().clone().requires_grad_(True) for x in (q, k, w))
    la = IndexerKLFunction.apply(qa, ka, wa, idx, target, overrides)
    torch.testing.assert_close(la, loss)
    for got, want in zip(torch.autograd.grad(la * 1.7, (qa, ka, wa)), grads):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_indexer_kl_forward_backward_tiny(dtype):
    """The model's tiny indexer (4 heads x 16): loss and the gradients of q_I, k_I, w vs autograd on the reference."""
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    check_kl(B=2, T=5, H_I=4, D_I=16, S=23, K=16, dtype=dtype, seed=3, loss_tol=tol, grad_tol=max(tol, 1e-4) * 3)


def test_indexer_kl_ragged_blocks_fp32():
    """K not a multiple of BLOCK_K (several key blocks plus a ragged one), padded heads and dims."""
    check_kl(
        B=1,
        T=4,
        H_I=3,
        D_I=24,
        S=40,
        K=37,
        dtype=torch.float32,
        seed=9,
        loss_tol=1e-5,
        grad_tol=3e-4,
        overrides={"fwd": dict(BLOCK_K=16), "bwd": dict(BLOCK_K=16)},
    )


def test_indexer_kl_public_op_and_mass():
    """The public op (the reference on CPU tensors); a target with mass != 1 on the valid keys (e.g. mass on an invalid
    key) is handled like the reference (target restricted to the valid keys, no renormalisation)."""
    B, T, H_I, D_I, S, K = 1, 3, 2, 16, 10, 6
    g = torch.Generator().manual_seed(21)
    idx = make_indices(B, T, S, K, g)
    target = torch.rand(B, T, K, generator=g).to(DEV)  # mass on invalid keys too
    q, k, w = make_indexer(B, T, H_I, D_I, S, torch.float32, 21)
    ref = indexer_kl(q, k, w, idx, target)
    torch.testing.assert_close(ref, indexer_kl_naive(q, k, w, idx, target), rtol=1e-5, atol=1e-6)
    stats = launch_indexer_kl_fwd(q, k, w, idx, target)
    torch.testing.assert_close(stats[0].sum() / stats[3].sum(), ref, rtol=1e-5, atol=1e-6)
    qr, kr, wr = (x.clone().requires_grad_(True) for x in (q, k, w))
    want = torch.autograd.grad(indexer_kl_naive(qr, kr, wr, idx, target), (qr, kr, wr))
    got = launch_indexer_kl_bwd(q, k, w, idx, target, stats, (1 / stats[3].sum()).reshape(1))
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-4


# ---------------------------------------------------------------------------------------------- GPU, V3.2 shapes
V32 = dict(H=128, d_qk=576, H_I=64, D_I=128, K=2048)


@pytest.mark.gpu
def test_attention_target_v32_bf16():
    """1024 queries at the end of a 4096-token sequence, causal duplicate-free top-2048 indices, lse from the
    Triton sparse-MLA forward; one layer, then three served layers accumulated."""
    from dsaflow.ops.sparse_mla import sparse_mla

    B, T, S, K = 1, 1024, 4096, V32["K"]
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(S - T, S)
    idx = torch.stack([torch.randperm(int(p) + 1, generator=g)[:K] for p in pos]).view(B, T, K).to(torch.int32)
    idx = idx.cuda()
    out, refs = None, []
    for _layer in range(3):
        q = (torch.randn(B, T, V32["H"], V32["d_qk"], generator=g) * 0.1).cuda().bfloat16()
        kv = torch.randn(B, S, V32["d_qk"], generator=g).cuda().bfloat16()
        scale = 192**-0.5
        _, lse = sparse_mla(q, kv, idx, scale, 512)
        one = attention_target(q, kv, idx, lse, scale)
        ref = attention_distribution(q, kv, idx, lse, scale)
        assert rel_err(one, ref) < 1e-3
        out = attention_target(q, kv, idx, lse, scale, out=torch.zeros_like(one) if out is None else out, weight=1 / 3)
        refs.append(ref)
    assert rel_err(out, torch.stack(refs).mean(0)) < 1e-3


@pytest.mark.gpu
def test_indexer_kl_v32_bf16():
    """Loss and gradients at V3.2 indexer shapes (64 heads x 128, top-2048) in bf16 vs the fp32 reference."""
    B, T, S, K = 1, 512, 4096, V32["K"]
    g = torch.Generator().manual_seed(1)
    pos = torch.arange(S - T, S)
    idx = torch.stack([torch.randperm(int(p) + 1, generator=g)[:K] for p in pos]).view(B, T, K).to(torch.int32)
    idx[0, 7] = -1
    idx = idx.cuda()
    target = random_target(idx, S, g)
    q, k, w = make_indexer(B, T, V32["H_I"], V32["D_I"], S, torch.bfloat16, 1)
    qr, kr, wr = (x.detach().float().requires_grad_(True) for x in (q, k, w))
    ref = indexer_kl_naive(qr, kr, wr, idx, target)
    ref_grads = torch.autograd.grad(ref, (qr, kr, wr))
    qa, ka, wa = (x.detach().clone().requires_grad_(True) for x in (q, k, w))
    loss = indexer_kl(qa, ka, wa, idx, target)
    assert abs(loss.item() - ref.item()) < 1e-3 * ref.item()
    for name, got, want in zip("qkw", torch.autograd.grad(loss, (qa, ka, wa)), ref_grads):
        assert rel_err(got, want) < 2e-2, name


# ---------------------------------------------------------------------------------------------- in the model
def stage_loss_and_grads(stage, x):
    stage.zero_grad(set_to_none=True)
    stage(x, compute_indexer_loss=True)
    loss = stage.indexer_loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton kernels on CPU tensors (interpreter)")
@pytest.mark.parametrize("layout", ["FSSFS", "FSSS|FSSS"])
def test_model_indexer_loss_with_fused_ops_matches_reference(monkeypatch, layout):
    """The stage's indexer loss and every indexer gradient with the Triton ops (interpreter, forced on CPU tensors)
    equal those with the reference: F layers with 2 and 3 served layers, several F layers per stage, topk < T."""
    from model_helpers import planned_sharp, tokens

    from dsaflow.model import indexer_loss as recorder_mod
    from dsaflow.pipeline.stages import build_stages

    model, plan = planned_sharp(layout, "model.num_layers=" + str(len(layout.replace("|", ""))), "model.index_topk=4")
    stage = build_stages(model, plan, seed=2)[0]
    stage.train()
    x = tokens(2, 9, seed=1)
    ref_loss, ref_grads = stage_loss_and_grads(stage, x)
    assert ref_grads and all(".attn.indexer." in n for n in ref_grads)
    monkeypatch.setattr(recorder_mod, "attention_target", attention_target_triton)
    from dsaflow.ops.indexer_loss.function import indexer_kl_triton

    monkeypatch.setattr(recorder_mod, "indexer_kl", indexer_kl_triton)
    loss, grads = stage_loss_and_grads(stage, x)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6)


def stage_without_hydra(layout: str, topk: int, seed: int):
    """The whole tiny model (schema defaults, init std 0.3) with these roles, built without Hydra or a plan."""
    from dsaflow.config.schema import ModelConfig
    from dsaflow.model import build_model

    return build_model(ModelConfig(num_layers=len(layout), index_topk=topk, init_std=0.3), layout, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True])
def test_model_indexer_loss_cuda_fused_matches_reference(monkeypatch, autocast):
    """On CUDA the recorder uses the fused ops; forcing the reference gives the same loss and indexer gradients
    (fp32 model, and bf16 autocast where both see the same bf16 inputs)."""
    from dsaflow.model import indexer_loss as recorder_mod

    stage = stage_without_hydra("FSSSFSS", topk=8, seed=3).cuda().train()
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2)).cuda()

    def run():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return stage_loss_and_grads(stage, x)

    loss, grads = run()
    monkeypatch.setattr(recorder_mod, "attention_target", attention_target_naive)
    monkeypatch.setattr(recorder_mod, "indexer_kl", indexer_kl_naive)
    ref_loss, ref_grads = run()
    assert ref_loss.item() > 0
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3 if autocast else 1e-4, atol=1e-7)
    assert grads.keys() == ref_grads.keys() and grads
    for n in ref_grads:
        assert rel_err(grads[n], ref_grads[n]) < (2e-2 if autocast else 1e-3), n


def test_kernel_support_reasons():
    """Shapes the kernels refuse are named (a CUDA call they refuse raises with the reason)."""
    from dsaflow.ops.indexer_loss import kl_supports, target_supports

    q = torch.zeros(1, 2, 4, 576)
    assert target_supports(q.bfloat16(), q[:, :, 0].bfloat16()) is None
    assert "fp32 rows" in target_supports(q, q[:, :, 0])
    assert "dtypes" in target_supports(q.half(), q[:, :, 0].bfloat16())
    qi = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    assert kl_supports(qi, qi[:, :, 0]) is None
    assert "H_I=256" in kl_supports(torch.zeros(1, 2, 256, 128), torch.zeros(1, 2, 128))


def test_topk_style_rows_with_trailing_padding():
    """Rows like the indexer's: valid keys first, then -1 padding of every length 0..K (the kernels stop at the last
    valid index). Target (accumulated onto a prior) and KL with its gradients vs the references, 3 key blocks and
    3 row-sweep blocks."""
    B, T, H, d_qk, S, K, H_I, D_I = 1, 9, 4, 40, 50, 40, 4, 16
    g = torch.Generator().manual_seed(33)
    idx = make_indices(B, T, S, K, g, invalid=False)
    counts = torch.tensor([0, 1, 15, 16, 17, 33, 39, 40, 40])  # valid keys per query
    idx[0][(torch.arange(K).view(1, -1) >= counts.view(-1, 1)).to(idx.device)] = -1
    q, kv, _, lse, scale = make_attention(B, T, H, d_qk, S, K, torch.float32, seed=34, idx=idx)
    prior = torch.rand(B, T, K, generator=g).to(DEV)
    out = prior.clone()
    attention_target_triton(q, kv, idx, lse, scale, out=out, weight=0.5, overrides=dict(BLOCK_K=16, BLOCK_F=16))
    ref = attention_distribution(q.float(), kv.float(), idx, lse, scale)
    assert rel_err(out, prior + 0.5 * ref) < 1e-5
    target = random_target(idx, S, g)
    qi, ki, wi = make_indexer(B, T, H_I, D_I, S, torch.float32, 35)
    ov = {"fwd": dict(BLOCK_K=16, BLOCK_F=16), "bwd": dict(BLOCK_K=16, BLOCK_F=16)}
    qa, ka, wa = (x.clone().requires_grad_(True) for x in (qi, ki, wi))
    qr, kr, wr = (x.clone().requires_grad_(True) for x in (qi, ki, wi))
    loss = IndexerKLFunction.apply(qa, ka, wa, idx, target, ov)
    ref_loss = indexer_kl_naive(qr, kr, wr, idx, target)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
    for a, b in zip(torch.autograd.grad(loss, (qa, ka, wa)), torch.autograd.grad(ref_loss, (qr, kr, wr))):
        assert rel_err(a, b) < 1e-4


def test_dispatch_tables_name_their_choice(monkeypatch):
    """CPU tensors run the references; CUDA calls (faked by `is_cuda`) the kernels, whose rules refuse by name; the
    reference on demand (and, for the KL, in deterministic mode); the env choice is checked."""
    from dsaflow.ops.indexer_loss import explain_indexer_loss
    from dsaflow.ops.indexer_loss.dispatch import reference_requested

    q = torch.zeros(1, 2, 4, 576)
    assert explain_indexer_loss("attention_target", q, q[:, :, 0]).kernel == "reference"
    assert explain_indexer_loss("indexer_kl", q[..., :64], q[:, :, 0, :64]).kernel == "reference"
    target = explain_indexer_loss("attention_target", FakeCuda(q.bfloat16()), q[:, :, 0].bfloat16())
    assert target.kernel == "triton_target" and [name for name, _ in target.refused] == ["reference"]
    target = explain_indexer_loss("attention_target", FakeCuda(q), q[:, :, 0])
    assert target.kernel is None and "fp32 rows of d_qk=576" in dict(target.refused)["triton_target"]
    kl = explain_indexer_loss("indexer_kl", FakeCuda(torch.zeros(1, 2, 256, 128)), torch.zeros(1, 2, 128))
    assert kl.kernel is None and "H_I=256" in dict(kl.refused)["triton_kl"]
    q_i, k_i = FakeCuda(torch.zeros(1, 2, 64, 128)), torch.zeros(1, 2, 128)
    assert explain_indexer_loss("indexer_kl", q_i, k_i).kernel == "triton_kl"
    torch.use_deterministic_algorithms(True)
    try:
        assert explain_indexer_loss("indexer_kl", q_i, k_i).kernel == "reference"
    finally:
        torch.use_deterministic_algorithms(False)
    monkeypatch.setenv("DSAFLOW_INDEXER_LOSS", "reference")
    assert explain_indexer_loss("attention_target", FakeCuda(q.bfloat16()), q[:, :, 0]).kernel == "reference"
    with pytest.raises(ValueError, match="function 'kl'"):
        explain_indexer_loss("kl", q, q)
    monkeypatch.setenv("DSAFLOW_INDEXER_LOSS", "fastest")
    with pytest.raises(ValueError, match="use auto or reference"):
        reference_requested()


@pytest.mark.gpu
def test_cuda_shapes_the_kernels_refuse_raise():
    q = torch.zeros(1, 2, 4, 576, device="cuda")  # fp32 rows wider than 256
    idx = torch.zeros(1, 2, 3, dtype=torch.int32, device="cuda")
    lse = torch.zeros(1, 2, 4, device="cuda")
    with pytest.raises(ValueError, match=r"attention_target: no kernel takes .*fp32 rows of d_qk=576"):
        attention_target(q, q[:, :, 0], idx, lse, 0.1)
