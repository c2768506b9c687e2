"""FP8 indexer logits (`model.index_fp8`): the per-row e4m3 rounding, the op on CPU and CUDA, the config plumbing.

CPU: the rounding's error bound and exact cases, the naive op scoring the rounded values, the model passing the
field to the op, a GPU without fp8 tensor cores refused with the field named. `gpu`: the fp8 op's selection against
the fp32 reference on the rounded values (every selected key at or above the reference's kk-th score, up to the fp8
MMA's accumulation error), the radix and sort paths equal on the same fp8 logits, graph replay == eager.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import planned, tokens

import dsaflow.model.mla as mla
from dsaflow.ops.indexer_topk import indexer_scores_naive, indexer_topk, indexer_topk_naive, topk_from_scores
from dsaflow.ops.indexer_topk.fp8 import E4M3_MAX, dequantize_rows, quantize_rows
from dsaflow.ops.indexer_topk.triton_indexer import indexer_topk_triton

POISON = -12345


def test_rounding_error_bound_scale_and_zero_rows():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 128, generator=g) * torch.logspace(-3, 3, 5).view(1, 5, 1)
    x[1, 2] = 0.0
    x8, scale = quantize_rows(x)
    assert x8.dtype == torch.float8_e4m3fn and scale.shape == (3, 5) and scale.dtype == torch.float32
    assert scale[1, 2] == 1.0 and (x8[1, 2].float() == 0).all()
    assert torch.allclose(x8.float().abs().amax(-1)[x.abs().amax(-1) > 0], torch.tensor(E4M3_MAX))
    back = dequantize_rows(x8, scale)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values; values far below the row's max are
    # subnormal in e4m3 and round to a multiple of 2^-9 * scale
    err = (back - x).abs()
    assert (err <= x.abs() * 2.0**-4 + scale.unsqueeze(-1) * 2.0**-10 + 1e-12).all()
    assert (err > 0).any(), "random data must round somewhere"
    exact = torch.tensor([[448.0, -224.0, 1.0, 0.5, 0.0]])  # representable with scale 1
    assert torch.equal(dequantize_rows(*quantize_rows(exact)), exact)


def test_cpu_fp8_op_scores_the_rounded_values():
    g = torch.Generator().manual_seed(1)
    B, T, H, D, S, topk = 1, 16, 4, 32, 200, 24
    q, k, w = torch.randn(B, T, H, D, generator=g), torch.randn(B, S, D, generator=g), torch.randn(B, T, H, generator=g)
    positions = torch.arange(S - T, S).unsqueeze(0)
    positions[0, 0] = -1
    got = indexer_topk(q, k, w, positions, topk, fp8=True)
    qr, kr = dequantize_rows(*quantize_rows(q)), dequantize_rows(*quantize_rows(k))
    assert torch.equal(got, topk_from_scores(indexer_scores_naive(qr, kr, w, positions), topk))
    assert not torch.equal(got, indexer_topk_naive(q, k, w, positions, topk)), "fp8 must change some selection here"
    assert (got[0, 0] == -1).all()


def test_model_passes_index_fp8_to_the_op(monkeypatch):
    seen = []
    real = mla.indexer_topk

    def spy(*args, fp8=False, **kw):
        seen.append(fp8)
        return real(*args, fp8=fp8, **kw)

    monkeypatch.setattr(mla, "indexer_topk", spy)
    from dsaflow.model import build_model

    for flag in (False, True):
        cfg, _ = planned("FSFS", "model.num_layers=4", f"model.index_fp8={str(flag).lower()}")
        seen.clear()
        with torch.no_grad():
            build_model(cfg, roles="FSFS")(tokens(1, 40))
        assert seen == [flag, flag], (flag, seen)  # the two F layers


def test_gpu_without_fp8_tensor_cores_is_refused_naming_the_field(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    q, k, w = torch.zeros(1, 2, 2, 16), torch.zeros(1, 4, 16), torch.zeros(1, 2, 2)
    with pytest.raises(ValueError, match=r"model.index_fp8=true needs fp8 tensor cores.*sm_80.*index_fp8=false"):
        indexer_topk_triton(q, k, w, torch.tensor([[2, 3]]), 2, fp8=True)


# ---------------------------------------------------------------------------------------------- GPU, real shapes
def assert_selection_within(got, q, k, w, positions, topk, rel_tol=2e-3):
    """got [1, T, topk] from the fp8 op: valid slots first, distinct visible keys, every one at or above the fp32
    reference's kk-th score on the rounded values, in ascending key order, up to rel_tol x the row's largest |score|
    (the fp8 MMA accumulates differently from the fp32 einsum)."""
    qr, kr = dequantize_rows(*quantize_rows(q)), dequantize_rows(*quantize_rows(k))
    ref = indexer_scores_naive(qr, kr, w, positions)  # fp32 [1, T, S]
    kk = (positions + 1).clamp(0, k.shape[1]).clamp(max=topk)
    slots = torch.arange(topk, device=got.device)
    assert torch.equal(got >= 0, slots.view(1, 1, -1) < kk.unsqueeze(-1)), "valid slots first, -1 after"
    for t in range(got.shape[1]):
        n = int(kk[0, t])
        if n == 0:
            continue
        sel = got[0, t, :n].long()
        assert sel.unique().numel() == n and int(sel.max()) <= int(positions[0, t])
        row = ref[0, t]
        kth = row.topk(n).values[-1]
        tol = rel_tol * row[torch.isfinite(row)].abs().max()
        vals = row[sel]
        assert (vals >= kth - tol).all(), (t, float(vals.min()), float(kth), float(tol))
        assert (sel[1:] > sel[:-1]).all(), (t, "ascending key order")


def v32_inputs(T, S, seed, D=128, H=64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, D, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(1, S, D, generator=g).to("cuda", torch.bfloat16)
    w = torch.randn(1, T, H, generator=g).to("cuda", torch.bfloat16)
    return q, k, w


@pytest.mark.gpu
@pytest.mark.parametrize("S", [8192, 131072])
def test_gpu_fp8_selection_against_the_reference_on_rounded_values(S):
    T, topk = 128, 2048
    q, k, w = v32_inputs(T, S, seed=S)
    positions = torch.arange(S - T, S, device="cuda").unsqueeze(0)
    positions[0, :4] = torch.tensor([-1, 5, 1000, 2047])  # padding, short contexts, exactly topk visible
    out = indexer_topk_triton(q, k, w, positions, topk, fp8=True)
    assert_selection_within(out, q, k, w, positions, topk)


@pytest.mark.gpu
def test_gpu_fp8_small_head_dim_pads_the_dot():
    """index_head_dim 16 (model=tiny): the fp8 dot takes K in steps of 32, so the kernel pads D with zeros."""
    T, S, topk = 64, 300, 16
    q, k, w = v32_inputs(T, S, seed=4, D=16, H=4)
    positions = torch.arange(S - T, S, device="cuda").unsqueeze(0)
    got = indexer_topk(q, k, w, positions, topk, fp8=True)
    assert_selection_within(got, q, k, w, positions, topk)


@pytest.mark.gpu
def test_gpu_fp8_graph_replay_equals_eager():
    g = torch.Generator().manual_seed(3)
    B, T, S, topk = 2, 256, 32768, 2048
    q = torch.randn(B, T, 64, 128, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(B, S, 128, generator=g).to("cuda", torch.bfloat16)
    w = torch.randn(B, T, 64, generator=g).to("cuda", torch.bfloat16)
    positions = torch.arange(S - T, S, device="cuda").repeat(B, 1)
    eager = indexer_topk(q, k, w, positions, topk, fp8=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_idx = indexer_topk(q, k, w, positions, topk, fp8=True)
    g_idx.fill_(POISON)
    graph.replay()
    assert torch.equal(g_idx, eager)


@pytest.mark.gpu
def test_gpu_rounding_kernel_against_the_reference():
    """The CUDA rounding kernel vs `fp8.quantize_rows` (torch's cast): the same scales, w * scale and e4m3 codes, bit
    for bit, over rows whose magnitudes span 8 decades (e4m3 subnormals included)."""
    from dsaflow.ops.indexer_topk.triton_indexer import quantize_rows_triton

    g = torch.Generator().manual_seed(2)
    x = (torch.randn(2048, 64, 128, generator=g) * torch.logspace(-4, 4, 64).view(1, 64, 1)).to("cuda", torch.bfloat16)
    x[0, 0] = 0.0
    w = torch.randn(2048, 64, generator=g).to("cuda", torch.bfloat16)
    x8, scale, w_scaled = quantize_rows_triton(x, w)
    r8, r_scale = quantize_rows(x)
    assert torch.equal(scale, r_scale), int((scale != r_scale).sum())
    assert torch.equal(w_scaled, w.float() * r_scale)
    diff = x8.view(torch.uint8) != r8.view(torch.uint8)
    assert not diff.any(), f"{int(diff.sum())} of {diff.numel()} codes differ"
    assert x8.shape == x.shape and scale.shape == x.shape[:-1]


@pytest.mark.gpu
@pytest.mark.parametrize("D,H", [(128, 64), (16, 4)])
def test_gpu_fp8_decode_step_selection(D, H):
    """One query per row (a decode step, the one-query logits kernel) on fp8 tensor cores: padding, short and long
    contexts select within the reference's tolerance on the rounded values."""
    S, topk = 8192, 2048 if D == 128 else 16
    for pos in (-1, 5, 2047, 5000, S - 1):
        q, k, w = v32_inputs(1, S, seed=pos + 2, D=D, H=H)
        positions = torch.tensor([[pos]], device="cuda")
        got = indexer_topk(q, k, w, positions, topk, fp8=True)
        assert_selection_within(got, q, k, w, positions, topk)
