"""FP8 block-scaled GEMMs on the GPU: the quantization kernel bit-equal to the reference, each GEMM kernel (Triton,
and torch's scaled_mm where its rule takes the call) against the fp32 reference at DeepSeek-V3.2 shapes and at
widths that are not multiples of 128, ragged expert groups with empty experts and a tail past the last expert,
outputs NaN-poisoned first, and CUDA-graph replays equal to eager calls with no host sync. Run on a GPU machine:

    .venv/bin/python -m pytest -q -m gpu tests/test_fp8_gemm_gpu.py

Tolerance, kernel vs reference: both multiply the same e4m3 values (the quantization is bit-equal, checked first),
so they differ only by the order of the fp32 accumulation, Hopper's fp8 MMA accumulating each 128-deep block with
fewer bits before the fp32 add, and the kernel's rounding of its output to bf16. Per output:
|kernel - reference| <= 2^-8 |reference| (bf16 keeps 8 significant bits: half a step is 2^-8 relative) +
2^-10 sum_k |x_k w_k| (the accumulation: fp32 over K = 7168 terms is below 2^-11 of that sum, the MMA's short
accumulation about 2^-13 of each block's).
"""

from __future__ import annotations

import pytest
import torch

from dsaflow.ops.fp8_gemm import (
    Fp8Activation,
    dequantize_blocks_128,
    dequantize_rows_1x128,
    dequantize_weight,
    dispatch,
    explain_fp8_gemm,
    fp8_grouped_mm,
    fp8_grouped_mm_naive,
    fp8_linear,
    fp8_linear_naive,
    quantize_activation,
    quantize_blocks_128,
    quantize_rows_1x128,
    shared_fp8_input,
)
from dsaflow.ops.fp8_gemm.gluon_fp8_grouped import gluon_weight_reason
from dsaflow.ops.fp8_gemm.triton_act_quant import quantize_rows_1x128_triton

pytestmark = pytest.mark.gpu

ROWS = [1, 7, 64, 130, 1000]
# (N, K): o_proj's down half and its transpose, kv_a's 576 (not a multiple of 128) both ways, small partial blocks,
# and K with 5 blocks (torch's weight scales padded to 8)
WIDTHS = [(7168, 2048), (2048, 7168), (576, 7168), (7168, 576), (200, 576), (576, 200), (256, 640)]


@pytest.fixture(autouse=True)
def _ieee_fp32_reference():
    """The references' fp32 matmuls in full fp32 (no TF32)."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def poison_free_memory():
    """Fill a large block with NaN and free it: the caching allocator hands it to the next allocations, so an
    output element a kernel never writes shows NaN."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    block = torch.full((64 << 20,), float("nan"), device="cuda")
    del block


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def weight(*shape, seed: int):
    """Random e4m3 weights [N, K] or [E, N, K] with their block scales. An expert stack is drawn and quantized one
    expert at a time: DeepSeek-V3's 256 x 4096 x 7168 stack is 30 GB in fp32, and quantizing it whole needs twice that."""
    g = gen(seed)
    if len(shape) == 2:
        return quantize_blocks_128(torch.randn(*shape, device="cuda", generator=g) * 0.02)
    E, N, K = shape
    w8 = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device="cuda")
    scale = torch.empty(E, -(-N // 128), -(-K // 128), device="cuda")
    for e in range(E):
        w8[e], scale[e] = quantize_blocks_128(torch.randn(N, K, device="cuda", generator=g) * 0.02)
    return w8, scale


def assert_within_bound(out, ref, absprod, what=""):
    """out (bf16) vs ref (fp32) within 2^-8 |ref| + 2^-10 absprod (the module docstring)."""
    assert not out.isnan().any(), f"{what}: NaN in the output (an element left unwritten)"
    err = (out.float() - ref).abs()
    bound = 2.0**-8 * ref.abs() + 2.0**-10 * absprod
    worst = torch.where(err > 0, err / bound, 0).max().item()  # 0 / 0 where both are exact zeros (empty rows)
    assert worst <= 1, f"{what}: error reaches {worst:.2f} x the bound"


def forced(monkeypatch, kernel, x, w8, offsets=None):
    """Force `kernel`; skip where its rule refuses these inputs (the reason is the skip's)."""
    monkeypatch.setenv(dispatch.ENV_KERNEL, kernel)
    choice = explain_fp8_gemm(x, w8, offsets)
    if choice.kernel != kernel:
        pytest.skip(f"{kernel} refuses: {dict(choice.refused)[kernel]}")


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("K", [200, 576, 7168])
def test_the_quantization_kernel_equals_the_reference_bit_for_bit(K, ue8m0):
    for M in ROWS:
        x = (torch.randn(M, K, device="cuda", generator=gen(M)) * torch.logspace(-4, 3, K, device="cuda")).bfloat16()
        x8, scale = quantize_rows_1x128(x, ue8m0)
        poison_free_memory()
        k8, k_scale_t = quantize_rows_1x128_triton(x, ue8m0, pad_rows=4)
        assert torch.equal(k8[:M].view(torch.uint8), x8.view(torch.uint8)), (M, K)
        assert torch.equal(k_scale_t.t()[:M], scale), (M, K)
        assert (k8[M:].float() == 0).all() and (k_scale_t[:, M:] == 1).all()


@pytest.mark.parametrize("N,K", WIDTHS)
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("kernel", ["triton", "torch_scaled_mm"])
def test_each_dense_kernel_matches_the_reference(monkeypatch, kernel, M, N, K):
    ue8m0 = M in (7, 130)  # DeepSeek-V3.2's power-of-two activation scales on some of the rows
    x = torch.randn(M, K, device="cuda", generator=gen(M * N + K)).bfloat16()
    w8, w_scale = weight(N, K, seed=N + K)
    forced(monkeypatch, kernel, x, w8)
    poison_free_memory()
    out = fp8_linear(x, w8, w_scale, ue8m0)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    ref = fp8_linear_naive(x.float(), w8, w_scale, ue8m0)
    absprod = dequantize_rows_1x128(*quantize_rows_1x128(x, ue8m0)).abs() @ dequantize_blocks_128(w8, w_scale).abs().t()
    assert_within_bound(out, ref, absprod, f"{kernel} M={M} N={N} K={K}")


def ragged_offsets(M: int, E: int, seed: int) -> torch.Tensor:
    """Cumulative row ends over E experts: experts 0, E // 2 and E - 1 get no row, the others random counts, and
    about 5 % of the M rows are left past offsets[-1]."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(E, generator=g)
    weights[[0, E // 2, E - 1]] = 0
    counts = torch.floor(weights / weights.sum() * int(M * 0.95)).long()
    return torch.cumsum(counts, 0).to(torch.int32).cuda()


GROUPED_CASES = [
    (kernel, M, N, K)
    for M in (7, 301, 2000)
    for N, K in ((4096, 7168), (7168, 2048), (576, 200))
    for kernel in ("triton", "gluon")
    if kernel == "triton" or K % 16 == 0  # the Gluon kernel's TMA needs 16-byte rows
]


@pytest.mark.parametrize("kernel,M,N,K", GROUPED_CASES)
def test_the_grouped_kernel_matches_the_reference_over_ragged_experts(monkeypatch, kernel, M, N, K):
    """Each grouped kernel, forced, and what the dispatch picks unforced (Gluon from GLUON_MIN_ROWS_PER_EXPERT rows
    per expert on sm_90)."""
    E = 16
    a = torch.randn(M, K, device="cuda", generator=gen(M + K)).bfloat16()
    w8, w_scale = weight(E, N, K, seed=N)
    offsets = ragged_offsets(M, E, seed=M)
    auto = explain_fp8_gemm(a, w8, offsets).kernel
    gluon_refused = gluon_weight_reason(a.device, w8)
    many_rows = M // E >= dispatch.GLUON_MIN_ROWS_PER_EXPERT
    assert auto == ("gluon" if gluon_refused is None and many_rows else "triton")
    if kernel == "gluon" and gluon_refused is not None:  # not sm_90, or a triton without Gluon's TMA
        pytest.skip(f"the Gluon kernel does not run here: {gluon_refused}")
    monkeypatch.setenv(dispatch.ENV_KERNEL, kernel)
    assert explain_fp8_gemm(a, w8, offsets).kernel == kernel
    poison_free_memory()
    out = fp8_grouped_mm(a, w8, w_scale, offsets)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    ref = fp8_grouped_mm_naive(a.float(), w8, w_scale, offsets)
    aq = dequantize_rows_1x128(*quantize_rows_1x128(a)).abs()
    absprod = torch.zeros_like(ref)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        absprod[start:end] = aq[start:end] @ dequantize_blocks_128(w8[e], w_scale[e]).abs().t()
        start = end
    assert_within_bound(out, ref, absprod, f"grouped M={M} N={N} K={K}")
    assert (out[start:] == 0).all(), "rows past offsets[-1] must be zero"


@pytest.mark.parametrize("kernel,rows_per_expert", [("triton", 2), ("triton", 100), ("gluon", 100)])
def test_gathered_token_rows_equal_the_gathered_rows_quantized(monkeypatch, kernel, rows_per_expert):
    """moe_experts' inference path: T tokens quantized once, their e4m3 rows and scales gathered into expert order
    (`gather`), bit-equal to quantizing the T x k gathered rows, ragged experts included."""
    E, T, k, N, K = 16, rows_per_expert * 2, 8, 512, 7168
    M = T * k
    tokens = torch.randn(T, K, device="cuda", generator=gen(5)).bfloat16()
    gather = torch.randint(0, T, (M,), device="cuda", generator=gen(6))
    w8, w_scale = weight(E, N, K, seed=7)
    offsets = ragged_offsets(M, E, seed=3)
    forced(monkeypatch, kernel, tokens.index_select(0, gather), w8, offsets)
    want = fp8_grouped_mm(tokens.index_select(0, gather), w8, w_scale, offsets)
    poison_free_memory()
    assert torch.equal(fp8_grouped_mm(tokens, w8, w_scale, offsets, gather=gather), want)


def count_quantizations(monkeypatch) -> list:
    """Counts launches of the activation quantization kernel, wherever the GEMMs call it from."""
    from dsaflow.ops.fp8_gemm import triton_act_quant, triton_fp8_gemm

    calls, real = [], triton_act_quant.quantize_rows_1x128_triton

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_act_quant, "quantize_rows_1x128_triton", counted)
    monkeypatch.setattr(triton_fp8_gemm, "quantize_rows_1x128_triton", counted)
    return calls


@pytest.mark.parametrize("kernel", ["triton", "torch_scaled_mm", "auto"])
def test_gemms_handed_one_quantize_activation_share_it_bit_equal(monkeypatch, kernel):
    """A layer's input read by three dense projections and the routed experts (gather path), all handed one
    `quantize_activation(x)`: one quantization launch in all, outputs bit-equal to the calls given x, and
    `shared_fp8_input` asks for it; after an in-place write to x the shared value is refused."""
    E, N_e, K = 8, 256, 7168
    x = torch.randn(2, 65, K, device="cuda", generator=gen(11)).bfloat16()  # 130 rows: no fused-quant launch
    weights = [weight(n, K, seed=20 + n) for n in (1536, 128, 2048)]
    experts = weight(E, N_e, K, seed=12)
    gather = torch.randint(0, 130, (130 * 4,), device="cuda", generator=gen(13))
    offsets = ragged_offsets(gather.numel(), E, seed=4)
    if kernel != "auto":
        forced(monkeypatch, kernel, x, weights[0][0])

    def layer(inp):
        monkeypatch.setenv(dispatch.ENV_KERNEL, kernel)
        dense = [fp8_linear(inp, w8, s) for w8, s in weights]
        monkeypatch.setenv(dispatch.ENV_KERNEL, "auto")  # 65 rows per expert: the Gluon kernel on sm_90
        rows = inp if isinstance(inp, Fp8Activation) else inp.view(130, K)
        return [*dense, fp8_grouped_mm(rows, *experts, offsets, gather=gather)]

    alone = layer(x)
    calls = count_quantizations(monkeypatch)
    poison_free_memory()
    monkeypatch.setenv(dispatch.ENV_KERNEL, kernel)  # as the dense GEMMs run: their kernels read a quantization
    x_fp8 = shared_fp8_input(x, *(w8 for w8, _ in weights))
    assert isinstance(x_fp8, Fp8Activation) and len(calls) == 1
    shared = layer(x_fp8)
    assert len(calls) == 1, f"{len(calls)} quantizations of one shared input"
    for a, b in zip(alone, shared):
        assert torch.equal(a, b)
    x.mul_(-0.5)
    with pytest.raises(ValueError, match="written in place after quantize_activation"):
        fp8_linear(x_fp8, *weights[1])
    assert torch.equal(fp8_linear(quantize_activation(x), *weights[1]), fp8_linear(x, *weights[1]))


def test_decode_rows_with_fused_launches_quantize_nothing_apart(monkeypatch):
    """Where every dense launch fuses the quantization (a table of fused decode launches), `shared_fp8_input`
    quantizes nothing for dense projections, and one shared copy for the grouped experts, whose kernels read it;
    a fused launch handed the Fp8Activation reads x, bit-equal to one handed x."""
    from dsaflow.ops.fp8_gemm import tile_configs

    fused = tile_configs.FP8TileConfig(16, 64, 4, 4, split_k_programs=tile_configs.SM_FILL, fuse_quant=True)
    monkeypatch.setattr(tile_configs, "DENSE_TABLE", ((None, None, fused),))
    monkeypatch.setenv(dispatch.ENV_KERNEL, "triton")
    K = 7168
    x = torch.randn(4, K, device="cuda", generator=gen(14)).bfloat16()
    weights = [weight(n, K, seed=30 + n) for n in (1536, 576)]
    experts = weight(8, 256, K, seed=15)
    calls = count_quantizations(monkeypatch)
    assert shared_fp8_input(x, *(w8 for w8, _ in weights)) is None and calls == []
    x_fp8 = shared_fp8_input(x, *(w8 for w8, _ in weights), experts[0])
    assert isinstance(x_fp8, Fp8Activation) and len(calls) == 1
    for w8, s in weights:
        assert torch.equal(fp8_linear(x_fp8, w8, s), fp8_linear(x, w8, s))
    assert len(calls) == 1


def capture(fn):
    """fn() run twice on a side stream with host syncs made errors, then captured into a CUDA graph: (graph, its
    static output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles the kernels outside the sync check (Triton's first launch)
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def replay_equals_eager(graph, out, fn, refill, what):
    for seed in range(3):
        refill(seed)
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
            eager = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(out, eager), (what, seed)


@pytest.mark.parametrize("kernel", ["triton", "torch_scaled_mm"])
def test_dense_replays_from_a_cuda_graph_bit_equal_with_no_host_sync(monkeypatch, kernel):
    x = torch.randn(64, 7168, device="cuda").bfloat16()
    w8, w_scale = weight(2048, 7168, seed=1)
    forced(monkeypatch, kernel, x, w8)
    graph, out = capture(lambda: fp8_linear(x, w8, w_scale))
    refill = lambda seed: x.copy_(torch.randn(64, 7168, device="cuda", generator=gen(seed)))
    replay_equals_eager(graph, out, lambda: fp8_linear(x, w8, w_scale), refill, kernel)


def test_grouped_replays_from_a_cuda_graph_bit_equal_with_no_host_sync():
    """The routing changes between replays: the offsets are read on the device, the grid is static."""
    E, M = 16, 512
    a = torch.randn(M, 2048, device="cuda").bfloat16()
    w8, w_scale = weight(E, 1024, 2048, seed=2)
    offsets = ragged_offsets(M, E, seed=0)
    graph, out = capture(lambda: fp8_grouped_mm(a, w8, w_scale, offsets))

    def refill(seed):
        a.copy_(torch.randn(M, 2048, device="cuda", generator=gen(seed)))
        offsets.copy_(ragged_offsets(M, E, seed=seed + 1))

    replay_equals_eager(graph, out, lambda: fp8_grouped_mm(a, w8, w_scale, offsets), refill, "grouped")


@pytest.mark.parametrize("shape", [(32768, 512), (200, 576), (3, 130, 257)])
def test_the_dequantization_kernel_equals_the_reference_bit_for_bit(shape):
    """kv_b at V3.2's shape (what absorbed attention dequantizes per call), partial blocks, an expert stack; every
    output element written (poisoned memory), in bf16 and fp32, and from a CUDA graph with no host sync."""
    w8, scale = quantize_blocks_128(
        torch.randn(*shape, device="cuda", generator=gen(3)) * torch.logspace(-3, 2, shape[-1], device="cuda")
    )
    for dtype in (torch.bfloat16, torch.float32):
        ref = dequantize_blocks_128(w8, scale).to(dtype)
        poison_free_memory()
        out = dequantize_weight(w8, scale, dtype)
        assert out.dtype == dtype and out.shape == w8.shape
        assert torch.equal(out.view(-1).view(torch.uint8), ref.view(-1).view(torch.uint8)), (shape, dtype)
    graph, out = capture(lambda: dequantize_weight(w8, scale, torch.bfloat16))

    def refill(seed):
        fresh8, fresh_scale = weight(*shape, seed=seed + 10)
        w8.copy_(fresh8)
        scale.copy_(fresh_scale)

    replay_equals_eager(graph, out, lambda: dequantize_weight(w8, scale, torch.bfloat16), refill, "dequantize")


def test_hopper_takes_the_torch_row():
    """On sm_90 with this torch (2.11 on the GPU machines) a bf16 call of more than 64 rows at block-aligned widths runs torch's
    cuBLASLt kernel; the refusal says why where it does not."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("torch's block-scaled scaled_mm runs on sm_90 only")
    x = torch.zeros(128, 7168, device="cuda", dtype=torch.bfloat16)
    choice = explain_fp8_gemm(x, weight(2048, 7168, seed=3)[0])
    assert choice.kernel == "torch_scaled_mm", str(choice)
