"""FP8 block-scaled GEMMs on CPU: the references held to bounds derived from e4m3's 3 mantissa bits, the Triton
kernels in the interpreter (TRITON_INTERPRET=1, conftest.py) against the references, the torch scaled_mm row's
layouts against cuBLASLt's contract (through a stand-in that checks it), and the dispatch table (CUDA faked by
`is_cuda` and a patched device capability). The GPU tests are in test_fp8_gemm_gpu.py.

Bounds: e4m3 keeps 3 mantissa bits, so a quantized value y = x / scale is off by at most half a step: 2^-4 |y| in
the normal range, 2^-10 in the subnormal one (step 2^-9). Back in x's units: |dequantized - x| <= 2^-4 |x| + 2^-10
scale.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ops_helpers import FakeCuda

from dsaflow.ops.fp8_gemm import (
    dequantize_blocks_128,
    dequantize_rows_1x128,
    dequantize_weight,
    dispatch,
    explain_fp8_gemm,
    fp8_grouped_mm,
    fp8_grouped_mm_naive,
    fp8_linear,
    fp8_linear_naive,
    quantize_blocks_128,
    quantize_rows_1x128,
    torch_blockwise,
)
from dsaflow.ops.fp8_gemm.naive import E4M3_MAX, blocks
from dsaflow.ops.fp8_gemm.triton_act_quant import quantize_rows_1x128_triton
from dsaflow.ops.fp8_gemm.triton_dequant import dequantize_blocks_128_triton
from dsaflow.ops.fp8_gemm.triton_fp8_gemm import fp8_gemm_triton
from dsaflow.ops.fp8_gemm.triton_fp8_grouped import fp8_grouped_mm_triton
from dsaflow.ops.kernel_table import Choice

# the kernels run on CPU tensors in the interpreter, which conftest.py turns on only where there is no CUDA device
interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason="needs the Triton interpreter (no CUDA device)")


def wide_range(*shape, seed=0):
    """Normal values with row and column magnitudes spread over 1e-4..1e3, so blocks land in e4m3's subnormals
    too, plus one all-zero 128-block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.logspace(-4, 3, shape[-1])[torch.randperm(shape[-1], generator=g)]
    x.view(-1, shape[-1])[0, :128] = 0
    return x


def error_bound(x: torch.Tensor, scale_full: torch.Tensor) -> torch.Tensor:
    return 2.0**-4 * x.abs() + 2.0**-10 * scale_full


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int32)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_rows_round_trip_within_e4m3_rounding(ue8m0):
    x = wide_range(2, 3, 200)
    x8, scale = quantize_rows_1x128(x, ue8m0)
    assert x8.shape == x.shape and x8.dtype == torch.float8_e4m3fn and scale.shape == (2, 3, 2)
    full = scale.repeat_interleave(128, -1)[..., :200]
    assert ((dequantize_rows_1x128(x8, scale) - x).abs() <= error_bound(x, full)).all()
    assert (x8.float().abs() <= E4M3_MAX).all()
    assert torch.equal(scale[0, 0, 0], torch.tensor(1.0)) and (x8[0, 0, :128].float() == 0).all()  # the zero block


@pytest.mark.parametrize("ue8m0", [False, True])
def test_blocks_round_trip_on_an_expert_stack(ue8m0):
    w = wide_range(3, 130, 200, seed=1)
    w8, scale = quantize_blocks_128(w, ue8m0)
    assert w8.shape == w.shape and scale.shape == (3, 2, 2)
    full = scale.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :130, :200]
    assert ((dequantize_blocks_128(w8, scale) - w).abs() <= error_bound(w, full)).all()
    for e in range(3):  # the stack's scales are each expert's own
        assert torch.equal(quantize_blocks_128(w[e], ue8m0)[1], scale[e])


def test_scales_are_amax_over_448_and_the_largest_value_lands_on_448():
    x = wide_range(5, 300, seed=2)
    x8, scale = quantize_rows_1x128(x)
    amax = F.pad(x, (0, 84)).view(5, 3, 128).abs().amax(-1)
    assert torch.equal(scale, torch.where(amax > 0, amax * (1.0 / 448.0), torch.ones_like(amax)))
    blocks_max = F.pad(x8.float(), (0, 84)).view(5, 3, 128).abs().amax(-1)
    assert torch.equal(blocks_max[amax > 0], torch.full_like(blocks_max[amax > 0], 448.0))


def test_ue8m0_scales_are_the_next_power_of_two():
    x = wide_range(4, 256, seed=3)
    _, scale = quantize_rows_1x128(x, ue8m0=True)
    _, exact = quantize_rows_1x128(x)
    assert (bits(scale) & 0x7FFFFF == 0).all()  # no mantissa bit: a power of two
    assert (scale >= exact).all() and (scale < 2 * exact).all()
    w8, wscale = quantize_blocks_128(wide_range(130, 256, seed=4), ue8m0=True)
    assert (bits(wscale) & 0x7FFFFF == 0).all()


def gemm_bound(x, w, x_scale, w_scale, xq, wq):
    """|fp8 GEMM - x @ w^T| per output: the e4m3 rounding of each operand (error_bound) through the products, plus
    fp32 accumulation (K + 2 roundings of 2^-24 of the absolute products)."""
    K = x.shape[-1]
    dx = error_bound(x, x_scale.repeat_interleave(128, -1)[..., :K]).double()
    dw = error_bound(w, w_scale.repeat_interleave(128, -2).repeat_interleave(128, -1)[: w.shape[0], :K]).double()
    xa, wa = x.abs().double(), w.abs().double()
    rounding = xa @ dw.t() + dx @ wa.t() + dx @ dw.t()
    return rounding + (K + 2) * 2.0**-24 * (xq.abs().double() @ wq.abs().double().t())


@pytest.mark.parametrize("ue8m0", [False, True])
def test_the_reference_gemm_is_within_the_e4m3_bound_of_the_exact_product(ue8m0):
    x = wide_range(9, 300, seed=5)
    w = torch.randn(130, 300, generator=torch.Generator().manual_seed(6)) * 0.05
    w8, w_scale = quantize_blocks_128(w)
    x8, x_scale = quantize_rows_1x128(x, ue8m0)
    out = fp8_linear_naive(x, w8, w_scale, ue8m0)
    assert out.dtype == torch.float32 and out.shape == (9, 130)
    exact = x.double() @ w.double().t()
    bound = gemm_bound(x, w, x_scale, w_scale, dequantize_rows_1x128(x8, x_scale), dequantize_blocks_128(w8, w_scale))
    assert ((out.double() - exact).abs() <= bound).all()
    assert (out.double() - exact).abs().max() > 0  # the bound is not met by accident of exact inputs
    assert fp8_linear_naive(x.bfloat16(), w8, w_scale).dtype == torch.bfloat16


def grouped_inputs(M=37, E=6, N=130, K=200, seed=7):
    """Rows sorted by expert: experts 0, 3 and 5 get none, and rows 33.. belong to no expert."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g)
    w8, w_scale = quantize_blocks_128(torch.randn(E, N, K, generator=g) * 0.05)
    offsets = torch.tensor([0, 10, 25, 25, 33, 33], dtype=torch.int32)
    return a, w8, w_scale, offsets


def test_grouped_reference_rows_follow_their_experts_and_the_tail_is_zero():
    a, w8, w_scale, offsets = grouped_inputs()
    out = fp8_grouped_mm_naive(a, w8, w_scale, offsets)
    starts = [0, *offsets.tolist()[:-1]]
    for e, (start, end) in enumerate(zip(starts, offsets.tolist())):
        torch.testing.assert_close(out[start:end], fp8_linear_naive(a[start:end], w8[e], w_scale[e]))
    assert (out[33:] == 0).all()


# ---- the Triton kernels in the interpreter ----


@interpreter
@pytest.mark.parametrize("M,K,ue8m0", [(1, 128, False), (7, 200, True), (70, 300, False)])
def test_the_quantization_kernel_equals_the_reference_bit_for_bit(M, K, ue8m0):
    x = wide_range(M, K, seed=M)
    for dtype in (torch.float32, torch.float16):
        xd = x.clamp(-6e4, 6e4).to(dtype)
        x8, scale = quantize_rows_1x128(xd, ue8m0)
        k8, k_scale_t = quantize_rows_1x128_triton(xd, ue8m0, pad_rows=4)
        M_pad = -(-M // 4) * 4
        assert k8.shape == (M_pad, K) and k_scale_t.shape == (blocks(K), M_pad)
        assert torch.equal(bits(k8[:M]), bits(x8)) and torch.equal(k_scale_t.t()[:M], scale)
        assert (k8[M:].float() == 0).all() and (k_scale_t[:, M:] == 1).all()  # the padding rows


@interpreter
def test_the_quantization_kernel_rounds_ties_to_even_like_torch():
    """Every midpoint between neighbouring e4m3 values, normal and subnormal, with the scale exactly 1 (ue8m0 and
    an amax of 440): the kernel rounds in fp32 bits and must agree with torch's cast on each tie."""
    grid = torch.tensor([2.0**e * (1 + m / 8) for e in range(-6, 9) for m in range(8)])
    mids = torch.cat(
        [(grid[:-1] + grid[1:]) / 2, (torch.arange(9) + 0.5) * 2.0**-9, torch.tensor([2.0**-6 - 2.0**-11])]
    )
    x = torch.cat([mids[mids <= 440], -mids[mids <= 440], torch.tensor([440.0])])
    x = F.pad(x, (0, 128 - x.numel() % 128)).view(1, -1)
    x8, scale = quantize_rows_1x128(x, ue8m0=True)
    assert (scale == 1).all()
    assert torch.equal(bits(quantize_rows_1x128_triton(x, ue8m0=True)[0]), bits(x8))


@interpreter
@pytest.mark.parametrize("M,N,K", [(1, 40, 200), (7, 130, 256), (70, 33, 129), (130, 64, 384)])
def test_the_dense_kernel_matches_the_reference(M, N, K):
    g = torch.Generator().manual_seed(M + N)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * 0.05
    w8, w_scale = quantize_blocks_128(w)
    x8, x_scale_t = quantize_rows_1x128_triton(x)
    out = fp8_gemm_triton(x8, x_scale_t, w8, w_scale, M, torch.float32)
    # the same e4m3 values on both sides: only the fp32 summation order differs
    torch.testing.assert_close(out, fp8_linear_naive(x, w8, w_scale), rtol=1e-5, atol=1e-5)


@interpreter
def test_the_grouped_kernel_matches_the_reference_with_empty_experts_and_a_tail():
    a, w8, w_scale, offsets = grouped_inputs()
    x8, x_scale_t = quantize_rows_1x128_triton(a)
    out = fp8_grouped_mm_triton(x8, x_scale_t, w8, w_scale, offsets, a.shape[0], torch.float32)
    torch.testing.assert_close(out, fp8_grouped_mm_naive(a, w8, w_scale, offsets), rtol=1e-5, atol=1e-5)
    assert (out[33:] == 0).all()


@interpreter
@pytest.mark.parametrize("shape", [(256, 384), (130, 200), (2, 129, 130)])
def test_the_dequantization_kernel_equals_the_reference_bit_for_bit(shape):
    w8, scale = quantize_blocks_128(wide_range(*shape, seed=shape[-1]).clamp(-1e4, 1e4))
    for dtype in (torch.bfloat16, torch.float32):
        out = dequantize_blocks_128_triton(w8, scale, dtype)
        assert out.dtype == dtype and out.shape == w8.shape
        assert torch.equal(out.view(torch.uint8), dequantize_blocks_128(w8, scale).to(dtype).view(torch.uint8)), dtype


@pytest.mark.parametrize("shape", [(256, 384), (130, 200), (2, 128, 256)])
def test_dequantize_weight_on_cpu_equals_the_reference_bit_for_bit(shape):
    """The CPU path (whole blocks broadcast their scales; partial blocks take the reference) as `matrix_weight`
    uses it for MLA's kv_b."""
    w8, scale = quantize_blocks_128(wide_range(*shape, seed=shape[0]).clamp(-1e4, 1e4))
    for dtype in (torch.bfloat16, torch.float32):
        want = dequantize_blocks_128(w8, scale).to(dtype)
        assert torch.equal(dequantize_weight(w8, scale, dtype).view(torch.uint8), want.view(torch.uint8)), dtype


def test_the_dequantization_kernel_refuses_a_wrong_scale_shape():
    w8, scale = quantize_blocks_128(torch.randn(130, 200))
    with pytest.raises(ValueError, match=r"scale must be fp32 \(2, 2\)"):
        dequantize_blocks_128_triton(w8, scale[:1], torch.bfloat16)


@interpreter
def test_the_public_functions_run_the_triton_path(monkeypatch):
    """The glue around the kernels (leading dims, row strides, the output's shape and dtype) through the
    interpreter: the table is reduced to a Triton row that accepts CPU tensors."""
    monkeypatch.setattr(dispatch, "KERNELS", (("triton", lambda *args: None),))
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 3, 400, generator=g)[..., :200]  # rows with a stride of 400
    w8, w_scale = quantize_blocks_128(torch.randn(130, 200, generator=g) * 0.05)
    assert explain_fp8_gemm(x, w8).kernel == "triton"
    out = fp8_linear(x, w8, w_scale, ue8m0=True)
    assert out.shape == (2, 3, 130) and out.dtype == torch.float32
    torch.testing.assert_close(out, fp8_linear_naive(x, w8, w_scale, ue8m0=True), rtol=1e-5, atol=1e-5)
    a, w8, w_scale, offsets = grouped_inputs()
    out = fp8_grouped_mm(a.half(), w8, w_scale, offsets)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, fp8_grouped_mm_naive(a.half(), w8, w_scale, offsets), rtol=1e-3, atol=1e-3)
    # tokens quantized once and gathered into expert order: bit-equal to the gathered rows quantized
    gather = torch.randint(0, 11, (a.shape[0],), generator=g)
    tokens = torch.randn(11, a.shape[1], generator=g).clamp(-6e4, 6e4).half()
    got = fp8_grouped_mm(tokens, w8, w_scale, offsets, gather=gather)
    assert torch.equal(got, fp8_grouped_mm(tokens.index_select(0, gather), w8, w_scale, offsets))
    with pytest.raises(ValueError, match="gather must be int64"):
        fp8_grouped_mm(tokens, w8, w_scale, offsets, gather=gather.int())


def test_gathered_calls_choose_the_kernel_by_the_gemms_rows(monkeypatch):
    """With gather, the GEMM has gather.numel() rows (k per token): the dispatch's rows-per-expert rule must see
    those, not the T tokens (at a prefill chunk: 65,536 rows, Gluon's range, against 8,192 tokens, Triton's)."""
    import dsaflow.ops.fp8_gemm as ops

    seen = []
    real = ops.explain_fp8_gemm
    monkeypatch.setattr(ops, "explain_fp8_gemm", lambda x, *rest: seen.append(x.shape) or real(x, *rest))
    a, w8, w_scale, offsets = grouped_inputs()
    fp8_grouped_mm(torch.randn(5, a.shape[1]), w8, w_scale, offsets, gather=torch.zeros(37, dtype=torch.int64))
    assert seen == [(37, a.shape[1])]


def test_the_reference_path_takes_gathered_rows_too():
    a, w8, w_scale, offsets = grouped_inputs()
    gather = torch.randint(0, 5, (a.shape[0],), generator=torch.Generator().manual_seed(1))
    tokens = torch.randn(5, a.shape[1])
    want = fp8_grouped_mm_naive(tokens.index_select(0, gather), w8, w_scale, offsets)
    assert torch.equal(fp8_grouped_mm(tokens, w8, w_scale, offsets, gather=gather), want)


# ---- torch's scaled_mm row: the layouts it is handed ----


def cublaslt_scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, output_dtype):
    """A stand-in for torch.nn.functional.scaled_mm that asserts what torch's `_scaled_block1x128_block128x128`
    checks (and cuBLASLt needs) before computing the block-scaled product in fp32."""
    rows_recipe, squares_recipe = torch_blockwise.block_recipes()
    M, K = mat_a.shape
    N = mat_b.shape[1]
    KB, L4 = blocks(K), -(-blocks(K) // 4) * 4
    assert recipe_a == rows_recipe and recipe_b == squares_recipe
    assert mat_a.stride(1) == 1 and mat_b.stride(0) == 1, "row-major A, column-major B"
    assert M % 4 == 0, "16-byte aligned scale columns"
    assert scale_a.shape == (M, KB) and scale_a.stride(0) == 1 and scale_a.stride(1) in (M, 1 if KB == 1 else M)
    assert scale_b.shape == (L4, blocks(N)) and scale_b.stride() == (1, L4)
    a = dequantize_rows_1x128(mat_a, scale_a)
    b = dequantize_blocks_128(mat_b.t(), scale_b.t()[:, :KB])
    return (a @ b.t()).to(output_dtype)


@interpreter
@pytest.mark.parametrize("M,K", [(7, 512), (1, 640), (64, 128)])  # ceil(K / 128) of 4, 5 (padded to 8) and 1
def test_the_torch_row_hands_scaled_mm_cublaslt_layouts(monkeypatch, M, K):
    monkeypatch.setattr(F, "scaled_mm", cublaslt_scaled_mm)
    g = torch.Generator().manual_seed(K)
    x = torch.randn(M, K, generator=g).bfloat16()
    w8, w_scale = quantize_blocks_128(torch.randn(256, K, generator=g) * 0.05)
    x8, x_scale_t = quantize_rows_1x128_triton(x, pad_rows=torch_blockwise.SCALED_MM_PAD_ROWS)
    out = torch_blockwise.fp8_linear_torch(x8, x_scale_t, w8, w_scale, M)
    assert out.shape == (M, 256) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), fp8_linear_naive(x, w8, w_scale).float(), rtol=2**-8, atol=1e-3)


# ---- dispatch ----


def test_cpu_calls_run_the_reference_and_equal_it():
    a, w8, w_scale, offsets = grouped_inputs()
    assert explain_fp8_gemm(a, w8[0]) == Choice("reference", ())
    assert explain_fp8_gemm(a, w8, offsets) == Choice("reference", ())
    assert torch.equal(fp8_linear(a, w8[0], w_scale[0]), fp8_linear_naive(a, w8[0], w_scale[0]))
    assert torch.equal(fp8_grouped_mm(a, w8, w_scale, offsets), fp8_grouped_mm_naive(a, w8, w_scale, offsets))


@pytest.fixture
def hopper(monkeypatch):
    """CUDA calls on an sm_90 GPU with a CUDA 12.9 torch build (faked: the rules read no tensor value)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    monkeypatch.delenv(dispatch.ENV_KERNEL, raising=False)
    return monkeypatch


def cuda_inputs(N=256, K=512, dtype=torch.bfloat16, rows=128):
    return FakeCuda(torch.zeros(rows, K, dtype=dtype)), torch.zeros(N, K, dtype=torch.float8_e4m3fn)


def refusal(choice: Choice, kernel: str) -> str:
    return dict(choice.refused)[kernel]


def test_hopper_runs_torch_scaled_mm_where_its_rule_holds(hopper):
    x, w8 = cuda_inputs()
    assert explain_fp8_gemm(x, w8) == Choice(
        "torch_scaled_mm", (("reference", "device cuda runs the kernels (DSAFLOW_FP8_GEMM=reference runs it there)"),)
    )
    x, w8 = cuda_inputs(N=576)  # MLA's wkv_a: a partial last 128-block, which cuBLASLt's block scaling takes
    assert explain_fp8_gemm(x, w8).kernel == "torch_scaled_mm"
    reasons = {
        "multiples of 16": cuda_inputs(N=200),
        "K 200 and N 256": cuda_inputs(K=200),
        "bf16 activations only": cuda_inputs(dtype=torch.float16),
        "64 rows <= 64: Triton's split-K": cuda_inputs(rows=64),
    }
    for reason, (x, w8) in reasons.items():
        choice = explain_fp8_gemm(x, w8)
        assert choice.kernel == "triton" and reason in refusal(choice, "torch_scaled_mm"), str(choice)
    x, w8 = cuda_inputs()
    choice = explain_fp8_gemm(x, w8.t().contiguous().t())
    assert choice.kernel is None and "contiguous" in refusal(choice, "torch_scaled_mm")
    assert "unit stride along K" in refusal(choice, "triton")
    grouped = explain_fp8_gemm(x, w8.unsqueeze(0), torch.zeros(1, dtype=torch.int32))
    assert grouped.kernel != "torch_scaled_mm" and "scaled_grouped_mm" in refusal(grouped, "torch_scaled_mm")


def test_grouped_calls_with_many_rows_per_expert_run_gluon_on_hopper(hopper):
    """The Gluon grouped kernel above 64 rows per expert, Triton at or below (and for every dense call); a forced
    gluon takes few rows too, and K off TMA's 16-byte pitch goes to Triton either way."""
    from dsaflow.ops.fp8_gemm import gluon_fp8_grouped

    if gluon_fp8_grouped.TMA_ERROR is not None:
        pytest.skip(gluon_fp8_grouped.TMA_ERROR)
    E = 4
    offsets = torch.zeros(E, dtype=torch.int32)
    x, w8 = cuda_inputs(rows=65 * E)
    assert explain_fp8_gemm(x, w8.expand(E, -1, -1).contiguous(), offsets).kernel == "gluon"
    assert "dense" in refusal(explain_fp8_gemm(*cuda_inputs(rows=64)), "gluon")
    x, w8 = cuda_inputs(rows=64 * E)
    few = explain_fp8_gemm(x, w8.expand(E, -1, -1).contiguous(), offsets)
    assert few.kernel == "triton" and "64 rows per expert < 65" in refusal(few, "gluon")
    hopper.setenv(dispatch.ENV_KERNEL, "gluon")
    assert explain_fp8_gemm(x, w8.expand(E, -1, -1).contiguous(), offsets).kernel == "gluon"
    hopper.delenv(dispatch.ENV_KERNEL)
    x, w8 = cuda_inputs(K=200, rows=128 * E)
    odd = explain_fp8_gemm(x, w8.expand(E, -1, -1).contiguous(), offsets)
    assert odd.kernel == "triton" and "not a multiple of 16" in refusal(odd, "gluon")
    hopper.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    x, w8 = cuda_inputs(rows=128 * E)
    assert "need sm_90" in refusal(explain_fp8_gemm(x, w8.expand(E, -1, -1).contiguous(), offsets), "gluon")


def test_the_torch_row_reads_the_torch_build_and_the_gpu(hopper):
    x, w8 = cuda_inputs()
    hopper.setattr(torch.version, "cuda", "12.8")
    assert "CUDA 12.9+" in refusal(explain_fp8_gemm(x, w8), "torch_scaled_mm")
    hopper.setattr(torch.version, "cuda", None)
    assert "not a CUDA build" in refusal(explain_fp8_gemm(x, w8), "torch_scaled_mm")
    hopper.setattr(torch.version, "cuda", "13.0")
    hopper.delattr(F, "scaled_mm")
    assert "has no torch.nn.functional.scaled_mm" in refusal(explain_fp8_gemm(x, w8), "torch_scaled_mm")
    hopper.undo()
    hopper.setattr(torch.version, "cuda", "13.0")
    for capability, kernel, reason in [((10, 0), "triton", "sm_90 only; this GPU is sm_100"), ((8, 0), None, "8.9+")]:
        hopper.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        choice = explain_fp8_gemm(x, w8)
        assert choice.kernel == kernel and reason in str(choice), str(choice)


def test_the_env_var_forces_one_kernel_and_rejects_a_bad_name(hopper):
    x, w8 = cuda_inputs()
    hopper.setenv(dispatch.ENV_KERNEL, "triton")
    choice = explain_fp8_gemm(x, w8)
    assert choice.kernel == "triton" and refusal(choice, "torch_scaled_mm") == "DSAFLOW_FP8_GEMM=triton"
    hopper.setenv(dispatch.ENV_KERNEL, "reference")
    assert explain_fp8_gemm(x, w8).kernel == "reference"
    hopper.setenv(dispatch.ENV_KERNEL, "torch_scaled_mm")
    assert explain_fp8_gemm(*cuda_inputs(N=200)).kernel is None
    a, w8, w_scale, offsets = grouped_inputs()
    with pytest.raises(ValueError, match=r"fp8_linear: no kernel takes x \(37, 200\).*torch_scaled_mm: device cpu"):
        fp8_linear(a, w8[0], w_scale[0])
    hopper.setenv(dispatch.ENV_KERNEL, "cublas")
    with pytest.raises(ValueError, match="DSAFLOW_FP8_GEMM='cublas' is not an fp8 GEMM kernel"):
        fp8_linear(a, w8[0], w_scale[0])


def test_inputs_of_the_wrong_shape_or_dtype_are_refused_with_their_shapes():
    a, w8, w_scale, offsets = grouped_inputs()
    cases = {
        "w_scale must be fp32 (2, 2)": lambda: fp8_linear(a, w8[0], w_scale[0, :1]),
        "w8 must be float8_e4m3fn with 2 dims": lambda: fp8_linear(a, w8[0].float(), w_scale[0]),
        "x's last dim 199 is not w8's K 200": lambda: fp8_linear(a[:, :199], w8[0], w_scale[0]),
        "offsets int32 [6]": lambda: fp8_grouped_mm(a, w8, w_scale, offsets.long()),
        "w_scale must be fp32 (6, 2, 2)": lambda: fp8_grouped_mm(a, w8, w_scale.double(), offsets),
    }
    for message, call in cases.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            call()


def test_importing_the_public_functions_loads_no_kernel_module():
    """dsaflow.ops.fp8_gemm imports its Triton and Gluon kernel files where a kernel runs, not at import."""
    import subprocess
    import sys

    code = "import sys, dsaflow.ops.fp8_gemm; print(*sorted(m for m in sys.modules if 'fp8_gemm.' in m))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "dsaflow.ops.fp8_gemm.activation" in loaded
    assert [m for m in loaded if m.rsplit(".", 1)[1].startswith(("triton", "gluon"))] == []
