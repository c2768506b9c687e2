"""FP8 weights resident (`serve.weights=fp8`): a built stage's projections held as e4m3 with one fp32 scale per
128x128 block, as DeepSeek-V3.2's FP8 checkpoints ship them, and run through the block-scaled FP8 GEMMs.

`quantize_stage_(stage, device, dtype)` converts a StageModule in place, layer by layer, by the one policy
(`dsaflow.config.fp8_policy.is_fp8_weight`):
    nn.Linear `<name>` whose `<name>.weight` is FP8  -> FP8Linear: buffers `weight` e4m3 [N, K] and
                                                        `weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)]
    Experts (the routed experts)                      -> FP8Experts: `gate_up_proj` e4m3 [E, 2I, D] and
                                                        `gate_up_proj_scale_inv` fp32 [E, ceil(2I/128), ceil(D/128)];
                                                        `down_proj` [E, D, I] and `down_proj_scale_inv` likewise
Everything else (embedding, head, norms, the indexer's weights_proj) moves to `dtype`; the router stays fp32.
The state-dict names are the Hugging Face checkpoints' (`<name>.weight` + `<name>.weight_scale_inv`), so an FP8
checkpoint loads into them as stored (dsaflow.checkpoint.hf_weights).

MLA's kv_b projection is also used as two matrices (q absorption, the output up-projection, the non-absorbed
prefill's per-head keys and values): `matrix_weight(module, dtype)` gives those paths the weight in `dtype`,
dequantized per call from its FP8 form by `dequantize_weight` (one Triton pass on CUDA; a transient of one layer's
kv_b: 32 MiB in bf16 at DeepSeek-V3.2's shapes), as DeepSeek's own inference code does; the stage keeps only the FP8 copy, which is what the planner counts.

Inference only: the FP8 tensors are buffers, not parameters, and nothing differentiates through them. A moved or
cast module keeps its e4m3 weights and fp32 scales bit for bit (`.to(dtype)` moves them, never converts them).
"""

from __future__ import annotations

import torch
from torch import nn

from dsaflow.config.fp8_policy import is_fp8_weight
from dsaflow.ops.fp8_gemm import Fp8Activation, dequantize_weight, fp8_linear, quantize_blocks_128
from dsaflow.ops.moe import moe_experts

from .moe import Experts

FP8 = torch.float8_e4m3fn
BLOCK = 128
# the integer type of each stored format's width: a cast-free view that `.to(dtype)` and `to_empty` move as they are
_BITS = {FP8: torch.uint8, torch.float32: torch.int32}
# elements quantized per step when moving a weight to its device (fp32 transient: 1 GiB)
QUANTIZE_CHUNK = 1 << 28


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


class _StoredFormats(nn.Module):
    """A module of stored tensors (e4m3 weights, fp32 scales) that any `_apply` (`.to`, `.cuda`, `.float`,
    `to_empty`) moves without converting: each buffer goes through `fn` as a same-width integer view."""

    def _apply(self, fn, recurse=True):
        def keep_format(t: torch.Tensor) -> torch.Tensor:
            bits = _BITS.get(t.dtype)
            return fn(t) if bits is None else fn(t.view(bits)).view(t.dtype)

        return super()._apply(keep_format, recurse)


def quantize_to(w: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (any float dtype, any device) -> (e4m3 [..., N, K], fp32 scales [..., ceil(N/128),
    ceil(K/128)]) on `device`, quantized from w's values in fp32 (`quantize_blocks_128`). A stack [E, N, K] is
    quantized a few experts at a time on `device`, so the fp32 transient stays near QUANTIZE_CHUNK elements."""
    if w.dim() == 2:
        return quantize_blocks_128(w.to(device=device, dtype=torch.float32))
    *stack, N, K = w.shape
    flat = w.reshape(-1, N, K)
    w8 = torch.empty(flat.shape, dtype=FP8, device=device)
    scale = torch.empty(flat.shape[0], _blocks(N), _blocks(K), dtype=torch.float32, device=device)
    step = max(1, QUANTIZE_CHUNK // (N * K))
    for e in range(0, flat.shape[0], step):
        w8[e : e + step], scale[e : e + step] = quantize_blocks_128(flat[e : e + step].to(device, torch.float32))
    return w8.view(*stack, N, K), scale.view(*stack, _blocks(N), _blocks(K))


class FP8Linear(_StoredFormats):
    """x [..., in_features] -> [..., out_features] in x's dtype, through `fp8_linear` (activations quantized per
    1x128 on the fly, fp32 accumulation). Buffers: `weight` e4m3 [out, in], `weight_scale_inv` fp32
    [ceil(out/128), ceil(in/128)] (the weight is weight.float() times its block's scale). No bias (MLA, the indexer
    and the MLPs have none)."""

    def __init__(self, in_features: int, out_features: int, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8, device=device))
        scales = torch.ones(_blocks(out_features), _blocks(in_features), dtype=torch.float32, device=device)
        self.register_buffer("weight_scale_inv", scales)

    @classmethod
    def from_linear(cls, linear: nn.Linear, device=None) -> FP8Linear:
        """`linear`'s weight quantized onto `device` (default: where it is); a meta weight gives an empty module."""
        if linear.bias is not None:
            raise ValueError(f"FP8Linear takes bias-free layers; this one has a bias of {tuple(linear.bias.shape)}")
        w = linear.weight
        device = w.device if device is None else torch.device(device)
        out = cls(linear.in_features, linear.out_features, device=device)
        if not (w.is_meta or device.type == "meta"):
            out.weight, out.weight_scale_inv = quantize_to(w.detach(), device)
        return out

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        """x [..., in_features], or its `Fp8Activation` when the layer quantized it once for several projections
        (`shared_fp8_input`) -> [..., out_features], bit-equal either way."""
        return fp8_linear(x, self.weight, self.weight_scale_inv)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 128x128 blocks"


class FP8Experts(_StoredFormats):
    """The routed experts with e4m3 weights: `gate_up_proj` [E, 2I, D] (gate rows first), `down_proj` [E, D, I],
    each with `<name>_scale_inv` fp32 [E, ceil(rows/128), ceil(cols/128)]; run through `fp8_grouped_mm` by
    `moe_experts` (the same routing, sorting and SwiGLU as the bf16 experts)."""

    def __init__(self, experts: int, dim: int, inter: int, device=None):
        super().__init__()
        for name, (rows, cols) in (("gate_up_proj", (2 * inter, dim)), ("down_proj", (dim, inter))):
            self.register_buffer(name, torch.empty(experts, rows, cols, dtype=FP8, device=device))
            scales = torch.ones(experts, _blocks(rows), _blocks(cols), dtype=torch.float32, device=device)
            self.register_buffer(name + "_scale_inv", scales)

    @classmethod
    def from_experts(cls, experts: Experts, device=None) -> FP8Experts:
        """`experts`' weights quantized onto `device` (default: where they are); meta gives an empty module."""
        gu = experts.gate_up_proj
        device = gu.device if device is None else torch.device(device)
        E, two_i, D = gu.shape
        out = cls(E, D, two_i // 2, device=device)
        if not (gu.is_meta or device.type == "meta"):
            out.gate_up_proj, out.gate_up_proj_scale_inv = quantize_to(gu.detach(), device)
            out.down_proj, out.down_proj_scale_inv = quantize_to(experts.down_proj.detach(), device)
        return out

    def forward(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, x_fp8: Fp8Activation | None = None
    ) -> torch.Tensor:
        """x [N, D] in the serve dtype, ids int64 [N, k], weights fp32 [N, k] -> [N, D] in x's dtype. x_fp8: x's
        rows already quantized, shared with the shared expert (`shared_fp8_input`); None: quantized here."""
        scales = (self.gate_up_proj_scale_inv, self.down_proj_scale_inv)
        return moe_experts(x, ids, weights, self.gate_up_proj, self.down_proj, scales=scales, x_fp8=x_fp8)


def matrix_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in] of `linear` (nn.Linear or FP8Linear) as a plain matrix in `dtype`: an FP8 weight
    dequantized (a fresh transient), a bf16/fp32 one cast (a view when the dtype already matches; gradients flow
    to the parameter)."""
    if isinstance(linear, FP8Linear):
        return dequantize_weight(linear.weight, linear.weight_scale_inv, dtype)
    return linear.weight.to(dtype)


def _convert_children(module: nn.Module, prefix: str, device) -> int:
    """Replace, under `module` (named `prefix` in the stage), every nn.Linear / Experts whose weight the policy
    stores in FP8 by its FP8 module quantized onto `device`. Returns how many were replaced."""
    done = 0
    for name, child in list(module.named_children()):
        full = f"{prefix}.{name}" if prefix else name
        if isinstance(child, nn.Linear) and is_fp8_weight(f"{full}.weight"):
            setattr(module, name, FP8Linear.from_linear(child, device))
            done += 1
        elif isinstance(child, Experts) and is_fp8_weight(f"{full}.gate_up_proj"):
            setattr(module, name, FP8Experts.from_experts(child, device))
            done += 1
        else:
            done += _convert_children(child, full, device)
    return done


@torch.no_grad()
def quantize_stage_(stage: nn.Module, device=None, dtype: torch.dtype | None = None) -> nn.Module:
    """Convert `stage` (a StageModule) in place to FP8 weights by the policy and move it to `device` / `dtype`,
    one layer at a time: each layer's other tensors move (and cast) first, then its FP8 weights are quantized onto
    the device from their current values (fp32 on CPU after a checkpoint load: no bf16 rounding in between), so
    the device never holds more than the FP8 stage plus one layer's FP8 weights being made. Returns `stage`.
    Raises ValueError if a tensor the policy names FP8 is left in another format (the policy and the modules must
    agree: dsaflow.config.fp8_policy)."""
    device = torch.device(device) if device is not None else next(stage.parameters()).device
    for key, layer in stage.layers.items():
        _convert_children(layer, f"layers.{key}", device)
        layer.to(device=device, dtype=dtype)
    stage.to(device=device, dtype=dtype)  # the embedding, the final norm and the head (none of them FP8)
    left = [n for n, t in stage.state_dict().items() if is_fp8_weight(n) and t.dtype != FP8]
    if left:
        raise ValueError(f"the FP8 policy names {left[:3]} FP8 but no FP8 module holds them ({len(left)} in all)")
    return stage


def fp8_state_names(stage: nn.Module) -> list[str]:
    """The state-dict keys of `stage` held in e4m3 (each has a `<key>_scale_inv` beside it)."""
    return [n for n, t in stage.state_dict().items() if t.dtype == FP8]


def materialize_(stage: nn.Module, device) -> nn.Module:
    """A stage built on the meta device (its FP8 modules too) -> uninitialised storage on `device`, every tensor
    in the dtype it was given, to be filled by a checkpoint load. Non-persistent buffers, which no checkpoint
    holds, are the MoE routers' token counters and start at zero, as a built stage's do. Returns `stage`."""
    tied = stage.head is not None and stage.embed is not None and stage.head.weight is stage.embed.weight
    stage.to_empty(device=device)
    if tied:  # to_empty gives each module its own tensor
        stage.head.weight = stage.embed.weight
    with torch.no_grad():
        for module in stage.modules():
            for name in module._non_persistent_buffers_set:
                module._buffers[name].zero_()
    return stage
