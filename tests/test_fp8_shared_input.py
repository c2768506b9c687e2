"""An input quantized once for the FP8 GEMMs that read it (`Fp8Activation`, dsaflow.ops.fp8_gemm.activation), on CPU:
the reference kernels, and the Triton kernels in the interpreter (TRITON_INTERPRET=1, conftest.py) through a
dispatch table reduced to a Triton row that takes CPU tensors. The same kernels on the GPU: test_fp8_gemm_gpu.py.

- `quantize_activation` holds `quantize_rows_1x128`'s values and scales in the GEMMs' padded layout;
- a GEMM given the Fp8Activation is bit-equal to the GEMM given x, and within the bound below of an fp64 product of
  the dequantized operands (dense and grouped, reference and Triton, fused launches included);
- `shared_fp8_input` quantizes only where a GEMM reads a separate quantization;
- a layer forward (attention, dense MLP, MoE) quantizes each shared input once and hands that one value to every
  FP8 projection reading it, with outputs bit-equal to every GEMM quantizing for itself; a bf16 training forward
  reaches nothing FP8.

Bound, GEMM vs the fp64 product r of the same dequantized operands: the e4m3 products are exact in fp32, so the
kernels differ from r only by fp32 rounding in the sums (at most K adds within blocks and one scale product and add
per 128-block: gamma = (K + 2 ceil(K / 128) + 2) 2^-24 of sum_k |x_k w_k|) and the final rounding to bf16, at most
one step of its 8 significant bits (2^-7 |r|: the Triton interpreter's cast truncates where the GPU's rounds to
nearest): |out - r| <= 2^-7 |r| + (1 + 2^-7) gamma sum_k |x_k w_k|.
"""

from __future__ import annotations

import types

import pytest
import torch

from dsaflow.config.compose import compose
from dsaflow.model import fp8_weights
from dsaflow.model.cache import StageCache
from dsaflow.model.fp8_weights import FP8Experts, FP8Linear, quantize_stage_
from dsaflow.model.moe import MoE
from dsaflow.model.swiglu import SwiGLU
from dsaflow.ops.fp8_gemm import (
    Fp8Activation,
    activation,
    dequantize_blocks_128,
    dequantize_rows_1x128,
    dispatch,
    fp8_grouped_mm,
    fp8_linear,
    quantize_activation,
    quantize_blocks_128,
    quantize_rows_1x128,
    shared_fp8_input,
    tile_configs,
)
from dsaflow.ops.fp8_gemm.activation import SHARED_PAD_ROWS
from dsaflow.ops.fp8_gemm.naive import blocks
from dsaflow.pipeline.stages import build_stages
from dsaflow.plan import build_plan

# the Triton kernels run on CPU tensors in the interpreter, which conftest.py turns on only where there is no CUDA
interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason="needs the Triton interpreter (no CUDA device)")
FUSED_TABLE = ((None, None, tile_configs.FP8TileConfig(16, 64, 4, 5, fuse_quant=True)),)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int32)


@pytest.fixture
def kernels(monkeypatch, request):
    """The kernel the FP8 GEMMs run: "reference" (CPU's own), "triton" (the interpreter, the shipped tile table) or
    "triton fused" (the interpreter, every dense launch fusing the quantization)."""
    kind = request.param
    if kind != "reference":
        if torch.cuda.is_available():
            pytest.skip("needs the Triton interpreter (no CUDA device)")
        monkeypatch.setattr(dispatch, "KERNELS", (("triton", lambda *args: None),))
    if kind == "triton fused":
        monkeypatch.setattr(tile_configs, "DENSE_TABLE", FUSED_TABLE)
    return kind


def within_bound(out: torch.Tensor, x8, x_scale, w8, w_scale) -> None:
    """out [M, N] against the fp64 product of x8 [M, K] (scales [M, KB]) and w8 [N, K] dequantized (module bound)."""
    xq, w = dequantize_rows_1x128(x8, x_scale).double(), dequantize_blocks_128(w8, w_scale).double()
    ref, absprod = xq @ w.t(), xq.abs() @ w.abs().t()
    K = w8.shape[-1]
    gamma = (K + 2 * blocks(K) + 2) * 2.0**-24
    bound = 2.0**-7 * ref.abs() + (1 + 2.0**-7) * gamma * absprod
    assert ((out.double() - ref).abs() <= bound).all()


def test_quantize_activation_holds_the_row_quantization_in_the_gemms_layout():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 3, 600, generator=g) * 4)[..., :300].bfloat16()  # strided rows, a partial last block
    xq = quantize_activation(x, ue8m0=True)
    want8, want_scale = quantize_rows_1x128(x.reshape(6, 300), ue8m0=True)
    assert xq.source is x and xq.rows == 6 and xq.ue8m0 and xq.version == x._version
    assert xq.values.shape == (8, 300) and xq.scale_t.shape == (3, 8)  # 6 rows padded to SHARED_PAD_ROWS
    assert 8 % SHARED_PAD_ROWS == 0 and xq.scale_t.is_contiguous()
    assert torch.equal(bits(xq.values[:6]), bits(want8)) and torch.equal(xq.scale_t[:, :6], want_scale.t())
    assert (xq.values[6:].float() == 0).all() and (xq.scale_t[:, 6:] == 1).all()
    got8, got_scale = xq.row_values()
    assert torch.equal(bits(got8), bits(want8)) and torch.equal(got_scale, want_scale)
    with pytest.raises(ValueError, match="float tensor"):
        quantize_activation(torch.zeros(4, 128, dtype=torch.int32))


@pytest.mark.parametrize("kernels", ["reference", "triton", "triton fused"], indirect=True)
@pytest.mark.parametrize("ue8m0", [False, True])
def test_a_dense_gemm_given_the_quantized_input_equals_the_gemm_given_x(kernels, ue8m0):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 5, 400, generator=g) * torch.logspace(-2, 2, 400)).bfloat16()
    w8, w_scale = quantize_blocks_128(torch.randn(200, 400, generator=g) * 0.05)
    xq = quantize_activation(x, ue8m0)
    out = fp8_linear(xq, w8, w_scale)
    assert out.shape == (2, 5, 200) and out.dtype == torch.bfloat16
    assert torch.equal(out, fp8_linear(x, w8, w_scale, ue8m0))
    within_bound(out.reshape(10, 200), *quantize_rows_1x128(x.reshape(10, 400), ue8m0), w8, w_scale)


@pytest.mark.parametrize("kernels", ["reference", "triton"], indirect=True)
def test_a_grouped_gemm_given_the_quantized_tokens_equals_the_gemm_given_them(kernels):
    """The MoE experts' gathered form: the tokens' rows (from a [B, T, K] source) gathered into expert order."""
    g = torch.Generator().manual_seed(2)
    E, N, K, T = 4, 160, 256, 9
    x = torch.randn(1, T, K, generator=g).bfloat16()
    w8, w_scale = quantize_blocks_128(torch.randn(E, N, K, generator=g) * 0.05)
    gather = torch.randint(0, T, (2 * T,), generator=g)
    offsets = torch.tensor([5, 5, 12, 16], dtype=torch.int32)  # an empty expert, and 2 rows past the last one
    out = fp8_grouped_mm(quantize_activation(x), w8, w_scale, offsets, gather=gather)
    assert torch.equal(out, fp8_grouped_mm(x.view(T, K), w8, w_scale, offsets, gather=gather))
    x8, x_scale = quantize_rows_1x128(x.view(T, K).index_select(0, gather))
    start = 0
    for e, end in enumerate(offsets.tolist()):
        within_bound(out[start:end], x8[start:end], x_scale[start:end], w8[e], w_scale[e])
        start = end
    assert (out[start:] == 0).all()


def test_a_stale_or_differently_scaled_activation_is_refused():
    x = torch.randn(3, 256)
    w8, w_scale = quantize_blocks_128(torch.randn(128, 256) * 0.05)
    xq = quantize_activation(x)
    with pytest.raises(ValueError, match="ue8m0=True but the activation was quantized with ue8m0=False"):
        fp8_linear(xq, w8, w_scale, ue8m0=True)
    x.mul_(2)
    with pytest.raises(ValueError, match="written in place after quantize_activation"):
        fp8_linear(xq, w8, w_scale)


def test_shared_fp8_input_quantizes_only_for_fp8_gemms_that_read_a_separate_quantization(monkeypatch):
    from ops_helpers import FakeCuda

    x = torch.randn(4, 256)
    w8 = quantize_blocks_128(torch.randn(128, 256))[0]
    assert shared_fp8_input(x, torch.randn(128, 256), torch.randn(4, 128, 256)) is None  # bf16 weights
    assert shared_fp8_input(x, w8, w8.unsqueeze(0)) is None  # CPU: the reference quantizes inside its product
    with monkeypatch.context() as m:  # a kernel reading x8 and its scales, as on a GPU
        m.setattr(activation, "reads_quantized_input", lambda x, w: True)
        xq = shared_fp8_input(x, torch.randn(128, 256), w8)
        assert isinstance(xq, Fp8Activation) and xq.source is x
        assert shared_fp8_input(x, torch.randn(128, 256)) is None  # still nothing FP8 to feed
        assert shared_fp8_input(x.clone().requires_grad_(), w8) is None  # an Fp8Activation carries no gradient
    # the decision on (faked) CUDA tensors: the rules read shapes and devices only
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    monkeypatch.delenv(dispatch.ENV_KERNEL, raising=False)
    rows = {n: FakeCuda(torch.zeros(n, 256, dtype=torch.bfloat16)) for n in (16, 128)}
    assert dispatch.reads_quantized_input(rows[128], w8)  # torch_scaled_mm reads x8 and its scales
    assert dispatch.reads_quantized_input(rows[16], w8)  # Triton, a launch without fused quantization
    assert dispatch.reads_quantized_input(rows[16], w8.unsqueeze(0))  # grouped kernels always read them
    monkeypatch.setattr(tile_configs, "DENSE_TABLE", FUSED_TABLE)
    assert not dispatch.reads_quantized_input(rows[16], w8)  # the launch quantizes x's tiles itself
    monkeypatch.setenv(dispatch.ENV_KERNEL, "reference")
    assert not dispatch.reads_quantized_input(rows[128], w8) and not dispatch.reads_quantized_input(rows[16], w8[None])


# ---- a layer forward ----


def fp8_stage(dtype=torch.float32):
    """A tiny_moe stage of two layers (0: dense MLP, F; 1: MoE, S) with FP8 weights, and its config."""
    cfg = compose(["mode=serve", "model=tiny_moe", "model.num_layers=2", "index.pattern=FS", "serve.weights=fp8"])
    torch.manual_seed(0)
    stage = build_stages(cfg.model, build_plan(cfg))[0]
    return quantize_stage_(stage, "cpu", dtype), cfg


class GemmInputs:
    """What each FP8 projection of a forward was handed (by the module), and every `quantize_activation` made."""

    def __init__(self, monkeypatch):
        self.made, self.seen = [], {}
        quantize, linear, experts = activation.quantize_activation, fp8_weights.fp8_linear, fp8_weights.moe_experts

        def quantize_spy(x, ue8m0=False):
            self.made.append(quantize(x, ue8m0))
            return self.made[-1]

        def linear_spy(x, w8, w_scale, ue8m0=None):
            self.seen.setdefault(w8.data_ptr(), []).append(x)
            return linear(x, w8, w_scale, ue8m0)

        def experts_spy(x, ids, weights, gate_up, down, scales=None, x_fp8=None):
            self.seen.setdefault(gate_up.data_ptr(), []).append(x if x_fp8 is None else x_fp8)
            return experts(x, ids, weights, gate_up, down, scales=scales, x_fp8=x_fp8)

        monkeypatch.setattr(activation, "quantize_activation", quantize_spy)
        monkeypatch.setattr(fp8_weights, "fp8_linear", linear_spy)
        monkeypatch.setattr(fp8_weights, "moe_experts", experts_spy)

    def handed(self, module) -> object:
        """The one input every call of `module` (FP8Linear / FP8Experts) got in the forward."""
        weight = module.weight if isinstance(module, FP8Linear) else module.gate_up_proj
        inputs = self.seen[weight.data_ptr()]
        assert all(x is inputs[0] for x in inputs), f"{module} read different inputs"
        return inputs[0]


def shared_readers(layer) -> list[list]:
    """Per shared input of `layer`, the FP8 modules reading it."""
    attn, mlp = layer.attn, layer.mlp
    groups = [[attn.wq_a, attn.wkv_a, *([attn.indexer.wk] if attn.indexer is not None else [])]]
    if isinstance(mlp, MoE):
        groups.append([mlp.experts, mlp.shared_experts.w1, mlp.shared_experts.w3])
    else:
        groups.append([mlp.w1, mlp.w3])
    return groups


def forward(stage, cfg, tokens, cached: bool) -> torch.Tensor:
    """The stage's no-grad forward over tokens [B, T]: a serving prefill into a fresh cache, or a cacheless one."""
    if not cached:
        return stage(tokens)
    specs = [types.SimpleNamespace(index=int(k), role=layer.attn.role) for k, layer in stage.layers.items()]
    B, T = tokens.shape
    cache = StageCache.allocate(cfg.model, specs, B, 32, T)
    return stage.forward_prefill(tokens, torch.arange(T).expand(B, T), cache)


@pytest.mark.parametrize("kernels", ["triton", "triton fused"], indirect=True)
@pytest.mark.parametrize("cached", [False, True])
@torch.no_grad()
def test_a_layer_quantizes_each_shared_input_once_and_hands_it_to_every_reader(monkeypatch, kernels, cached):
    """The shipped table quantizes both inputs of each layer; with fused dense launches, only the MoE input (the
    grouped GEMM reads it; the shared expert's fused launches read x). Outputs bit-equal to unshared GEMMs."""
    stage, cfg = fp8_stage()
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    with pytest.MonkeyPatch.context() as alone:
        alone_inputs = GemmInputs(alone)
        alone.setattr(activation, "reads_quantized_input", lambda x, w: False)  # every GEMM quantizes for itself
        unshared = forward(stage, cfg, tokens, cached)
    assert alone_inputs.made == []
    inputs = GemmInputs(monkeypatch)
    shared = forward(stage, cfg, tokens, cached)
    assert torch.equal(shared, unshared)
    made = iter(inputs.made)
    for layer in stage.layers.values():
        for readers in shared_readers(layer):
            grouped = any(isinstance(m, FP8Experts) for m in readers)
            handed = {id(inputs.handed(m)) for m in readers}
            if kernels == "triton fused" and not grouped:  # nothing reads a separate quantization
                assert all(isinstance(inputs.handed(m), torch.Tensor) for m in readers)
                continue
            xq = next(made)
            assert handed == {id(xq)}, f"layer {layer.layer_index}: not one quantization for {readers}"
    assert next(made, None) is None, "a quantization no shared input accounts for"


def test_a_bf16_training_forward_reaches_nothing_fp8(monkeypatch):
    cfg = compose(["model=tiny_moe", "model.num_layers=2", "index.pattern=FS"])
    stage = build_stages(cfg.model, build_plan(cfg))[0]
    assert isinstance(stage.layers["0"].mlp, SwiGLU) and isinstance(stage.layers["1"].mlp, MoE)

    def refuse(*args, **kwargs):
        raise AssertionError("the bf16 training path asked an FP8 question")

    monkeypatch.setattr(activation, "quantize_activation", refuse)
    monkeypatch.setattr(activation, "reads_quantized_input", refuse)
    out = stage(torch.randint(0, 256, (2, 9)))
    out.float().sum().backward()
    assert stage.layers["1"].attn.wq_a.weight.grad is not None
