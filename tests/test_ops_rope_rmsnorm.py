"""Triton RoPE and RMSNorm vs their fp32 torch references (forward and every gradient).

Without CUDA the kernels run in the CPU interpreter (TRITON_INTERPRET=1, conftest.py) at small shapes; these kernels
have no dots, so fp32, fp16 and bf16 are all exercised there. `gpu`-marked tests repeat the checks at the model's
shapes (dim 7168, 128 heads x rope 64, indexer 64 x 128) and check the dispatch of the model's modules. Every output
buffer is NaN-poisoned before a kernel writes it; inputs come from seeded generators.
"""

from __future__ import annotations

import pytest
import torch

from dsaflow.ops.rmsnorm import rms_norm, rms_norm_naive, triton_rmsnorm
from dsaflow.ops.rmsnorm.function import rms_norm_triton
from dsaflow.ops.rmsnorm.triton_rmsnorm import rms_norm_bwd, rms_norm_fwd
from dsaflow.ops.rope import function as rope_function
from dsaflow.ops.rope import rope, rope_naive
from dsaflow.ops.rope.function import rope_triton
from dsaflow.ops.rope.triton_rope import rope_into

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Both sides compute in fp32; a low-precision output may round the other way by one ulp of its dtype.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=8e-3, atol=8e-3),
}


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    """Every buffer a launcher allocates starts as NaN, so an element the kernel misses fails the comparison."""

    def empty(*a, **k):
        t = torch.empty(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def empty_like(*a, **k):
        t = torch.empty_like(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(triton_rmsnorm, "_empty", empty)
    monkeypatch.setattr(rope_function, "_empty_like", empty_like)


def angles(B, T, rope_dim, g):
    """cos/sin of seeded positions (some negative = padding, which rotates by 0) -> [B, T, rope_dim // 2] fp32."""
    from dsaflow.model.rope import rope_angles

    pos = torch.randint(-2, 5000, (B, T), generator=g)
    cos, sin = rope_angles(pos, rope_dim, 10000.0)
    return cos.to(DEV), sin.to(DEV)


def close(x, ref, dtype):
    assert not torch.isnan(x).any(), "NaN: an element was not written"
    torch.testing.assert_close(x.float(), ref.float(), **TOL[dtype])


# ---------------------------------------------------------------- RoPE


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,rope_dim", [((2, 7, 5, 12), 12), ((1, 9, 24), 24), ((2, 5, 3, 20), 8), ((2, 3, 16), 6)])
def test_rope_forward_backward_match_reference(dtype, shape, rope_dim):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(*shape, generator=g).to(DEV, dtype).requires_grad_(True)
    cos, sin = angles(shape[0], shape[1], rope_dim, g)
    dy = torch.randn(*shape, generator=g).to(DEV, dtype)
    y = rope_triton(x, cos, sin, rope_dim)
    ref = rope_naive(x, cos, sin, rope_dim)
    assert y.dtype == dtype and y.shape == x.shape
    close(y, ref, dtype)
    (dx,) = torch.autograd.grad(y, x, dy)
    (ref_dx,) = torch.autograd.grad(ref, x, dy)
    close(dx, ref_dx, dtype)
    if rope_dim < shape[-1]:  # the pass-through dims are copied bit for bit, forward and backward
        assert torch.equal(y[..., rope_dim:], x[..., rope_dim:]) and torch.equal(dx[..., rope_dim:], dy[..., rope_dim:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_reads_and_writes_through_strides_and_touches_nothing_else(dtype):
    """q_pe is a slice of q [B, T, H, N + R]; its rotation lands in the tail of q_abs [B, T, H, C + R]."""
    g = torch.Generator().manual_seed(3)
    B, T, H, N, R, C = 2, 5, 3, 8, 6, 10
    q = torch.randn(B, T, H, N + R, generator=g).to(DEV, dtype)
    cos, sin = angles(B, T, R, g)
    buf = torch.full((B, T, H, C + R), float("nan"), device=DEV, dtype=dtype)
    out = rope_into(q[..., N:], cos, sin, buf[..., C:])
    assert out.data_ptr() == buf[..., C:].data_ptr()
    close(buf[..., C:], rope_naive(q[..., N:], cos, sin), dtype)
    assert torch.isnan(buf[..., :C]).all(), "wrote outside its view"
    back = torch.full_like(buf, float("nan"))
    rope_into(buf[..., C:], cos, sin, back[..., :R], inverse=True)  # rotation by -angle undoes the rotation
    close(back[..., :R], q[..., N:], dtype)
    assert torch.isnan(back[..., R:]).all()


def test_rope_public_op_dispatches_by_device_and_refuses_with_a_reason():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 8, generator=g)
    cos, sin = angles(2, 3, 8, g)
    if DEV == "cpu":  # the CPU path is the reference itself
        assert torch.equal(rope(x, cos.cpu(), sin.cpu()), rope_naive(x, cos.cpu(), sin.cpu()))
    x = x.to(DEV)
    assert torch.equal(rope(x, cos[..., :0], sin[..., :0], 0), rope_naive(x, cos[..., :0], sin[..., :0], 0))
    with pytest.raises(ValueError, match="rope_dim=7"):
        rope_triton(x, cos, sin, 7)
    with pytest.raises(ValueError, match="cos of shape"):
        rope_triton(x, cos[:, :2], sin, 8)
    with pytest.raises(ValueError, match="dtype"):
        rope_triton(x.double(), cos, sin, 8)


# ---------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 7, 48), (1, 3, 130), (33, 16)])
def test_rms_norm_forward_backward_match_reference(dtype, shape):
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(*shape, generator=g) * 3).to(DEV, dtype).requires_grad_(True)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(DEV).requires_grad_(True)
    dy = torch.randn(*shape, generator=g).to(DEV, dtype)
    y = rms_norm_triton(x, w, 1e-6)
    ref = rms_norm_naive(x, w, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    close(y, ref, dtype)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    ref_dx, ref_dw = torch.autograd.grad(ref, (x, w), dy)
    assert dx.dtype == dtype and dw.dtype == torch.float32
    close(dx, ref_dx, dtype)
    torch.testing.assert_close(dw, ref_dw, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("max_programs", [1, 3, 512])
def test_rms_norm_weight_grad_partials_over_programs_and_strided_rows(max_programs):
    """The kv latent norm reads c_kv, a strided slice of [B, T, C + R]; the weight gradient is summed from
    per-program partials (1, several with a ragged last block, one per row block) and is bitwise repeatable."""
    g = torch.Generator().manual_seed(5)
    B, T, C, R = 2, 19, 40, 8
    row = torch.randn(B, T, C + R, generator=g).to(DEV)
    x = row[..., :C]
    w = torch.randn(C, generator=g).to(DEV)
    dy = torch.randn(B, T, C, generator=g).to(DEV)
    y, rstd = rms_norm_fwd(x, w, 1e-6)
    dx, dw = rms_norm_bwd(x, w, rstd, dy, max_programs=max_programs)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref = rms_norm_naive(xr, wr, 1e-6)
    ref_dx, ref_dw = torch.autograd.grad(ref, (xr, wr), dy)
    close(y, ref, torch.float32)
    close(dx, ref_dx, torch.float32)
    close(dw, ref_dw, torch.float32)
    assert torch.equal(rms_norm_bwd(x, w, rstd, dy, max_programs=max_programs)[1], dw)


def test_rms_norm_public_op_dispatches_by_device_and_refuses_with_a_reason():
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    w = torch.ones(8)
    if DEV == "cpu":
        assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_naive(x, w, 1e-6))
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x.to(DEV), torch.ones(7, device=DEV), 1e-6)
    with pytest.raises(ValueError, match="dtypes"):
        rms_norm_triton(x.to(DEV).double(), w.to(DEV), 1e-6)


# ---------------------------------------------------------------- GPU: model shapes, dispatch


@pytest.mark.gpu
@pytest.mark.parametrize("shape,rope_dim", [((1, 1024, 128, 64), 64), ((2, 333, 64, 128), 64), ((1, 1024, 64), 64)])
def test_gpu_rope_model_shapes(shape, rope_dim):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g).to("cuda", torch.bfloat16).requires_grad_(True)
    cos, sin = angles(shape[0], shape[1], rope_dim, g)
    dy = torch.randn(*shape, generator=g).to("cuda", torch.bfloat16)
    y, ref = rope(x, cos, sin, rope_dim), rope_naive(x, cos, sin, rope_dim)
    close(y, ref, torch.bfloat16)
    close(torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(ref, x, dy)[0], torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("D,dtype", [(7168, torch.float32), (1536, torch.bfloat16), (512, torch.bfloat16)])
def test_gpu_rms_norm_model_shapes(D, dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 1000, D, generator=g).to("cuda", dtype).requires_grad_(True)
    w = (1 + 0.1 * torch.randn(D, generator=g)).cuda().requires_grad_(True)
    dy = torch.randn(2, 1000, D, generator=g).to("cuda", dtype)
    y, ref = rms_norm(x, w, 1e-6), rms_norm_naive(x, w, 1e-6)
    close(y, ref, dtype)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    ref_dx, ref_dw = torch.autograd.grad(ref, (x, w), dy)
    close(dx, ref_dx, dtype)
    torch.testing.assert_close(dw, ref_dw, rtol=1e-4, atol=1e-3)
    assert torch.equal(torch.autograd.grad(rms_norm(x, w, 1e-6), (x, w), dy)[1], dw)  # deterministic


@pytest.mark.gpu
def test_gpu_rope_and_norm_capture_in_a_cuda_graph():
    """Serving captures decode steps: no host sync, fixed grids."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 1, 128, 64, generator=g).to("cuda", torch.bfloat16)
    h = torch.randn(4, 1, 7168, generator=g).cuda()
    w = torch.ones(7168, device="cuda")
    cos, sin = angles(4, 1, 64, g)
    rope(x, cos, sin), rms_norm(h, w, 1e-6)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, z = rope(x, cos, sin), rms_norm(h, w, 1e-6)
    graph.replay()
    torch.cuda.synchronize()
    close(y, rope_naive(x, cos, sin), torch.bfloat16)
    close(z, rms_norm_naive(h, w, 1e-6), torch.float32)
