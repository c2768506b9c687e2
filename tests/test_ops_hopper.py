"""Hopper (sm_90) Gluon sparse MLA forward vs the naive fp32 reference, its capability rule, the dispatch table
(forward rows, and the order of the backward rows), and decode configs.

The Gluon kernel does not run in the CPU interpreter: the CPU tests check only what `hopper_fwd_supports` refuses.
`gpu` tests skip unless a CUDA device of compute capability 9.x is present. Inputs come from seeded generators;
outputs are NaN-poisoned before the kernel writes them.
"""

from __future__ import annotations

import pytest
import torch
from ops_helpers import sparse_mla_kernels, sparse_mla_kernels_only

from dsaflow.ops.sparse_mla import dispatch
from dsaflow.ops.sparse_mla.hopper_common import shape_reason
from dsaflow.ops.sparse_mla.hopper_seesaw import hopper_fwd_supports, launch_hopper_fwd, sparse_mla_fwd_hopper
from dsaflow.ops.sparse_mla.naive import sparse_mla_naive

IS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
hopper_only = pytest.mark.skipif(not IS_HOPPER, reason="needs an sm_90 GPU (H100/H200)")


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    assert not torch.isnan(x).any(), "NaN in kernel output (unwritten or invalid)"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_inputs(B, T, H, S, K, dtype, device, seed):
    """q [B,T,H,576], kv [B,S,576], indices [B,T,K] int32 with -1 and >= S entries, and query (0, 1) with no key."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, 576, generator=g).to(device, dtype)
    kv = torch.randn(B, S, 576, generator=g).to(device, dtype)
    idx = torch.randint(0, S, (B, T, K), generator=g, dtype=torch.int32)
    drop = torch.rand(B, T, K, generator=g) < 0.1
    idx[drop] = -1
    idx[torch.rand(B, T, K, generator=g) < 0.05] = S + 7  # out of range: no key
    if T > 1:
        idx[0, 1] = -1
    return q, kv, idx.to(device)


def check_against_naive(out, lse, q, kv, idx, scale, sample):
    ref_out, ref_lse = sparse_mla_naive(q[:, sample].float(), kv.float(), idx[:, sample], scale, 512)
    assert rel_err(out[:, sample], ref_out) < 1e-2
    got = lse[:, sample]
    assert not torch.isnan(got).any()
    assert torch.equal(torch.isinf(got), torch.isinf(ref_lse)), "-inf lse must mark exactly the queries with no key"
    fin = torch.isfinite(ref_lse)
    assert ((got[fin] - ref_lse[fin]).abs() / (1 + ref_lse[fin].abs())).max().item() < 2e-2


# ---- CPU: the capability rule ----


def _t(*shape, dtype=torch.bfloat16):
    return torch.zeros(*shape, dtype=dtype)


def test_supports_refuses_cpu_and_raises():
    q, kv, idx = _t(1, 2, 64, 576), _t(1, 8, 576), torch.zeros(1, 2, 4, dtype=torch.int32)
    assert "device cpu" in hopper_fwd_supports(q, kv, idx, 512)
    with pytest.raises(ValueError, match="device cpu"):
        sparse_mla_fwd_hopper(q, kv, idx, 0.1, 512)


def test_shape_rule_refuses_what_it_must():
    q, kv, idx = _t(1, 2, 128, 576), _t(1, 8, 576), torch.zeros(1, 2, 4, dtype=torch.int32)
    assert shape_reason(q, kv, idx, 512) is None
    assert "dtypes" in shape_reason(q.float(), kv.float(), idx, 512)
    assert "dtypes" in shape_reason(q, kv.half(), idx, 512)
    assert "d_v" in shape_reason(q, kv, idx, 256)
    assert "d_v" in shape_reason(_t(1, 2, 128, 192), _t(1, 8, 192), idx, 128)
    assert "H=16" in shape_reason(_t(1, 2, 16, 576), kv, idx, 512)
    assert "int32" in shape_reason(q, kv, idx.long(), 512)
    assert "contiguous" in shape_reason(_t(1, 2, 128, 1152)[..., ::2], kv, idx, 512)
    assert "multiples of 8" in shape_reason(q, _t(1, 8, 580)[..., :576], idx, 512)
    assert "empty" in shape_reason(q, _t(1, 0, 576), idx, 512)
    assert "empty" in shape_reason(q, kv, torch.zeros(1, 2, 0, dtype=torch.int32), 512)
    assert "ranks" in shape_reason(q[0], kv, idx, 512)


def test_launch_refuses_unknown_knobs():
    """The launcher names a knob it does not know before any kernel runs (no device needed)."""
    q, kv, idx = _t(1, 2, 128, 576), _t(1, 8, 576), torch.zeros(1, 2, 4, dtype=torch.int32)
    out, lse, n_keys = _t(1, 2, 128, 512), torch.zeros(1, 2, 128), torch.ones(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"unknown config keys \['BLOCK_K'\]"):
        launch_hopper_fwd(q, kv, idx, 0.1, 512, out, lse, dict(BLOCK_K=32), n_keys)


# ---- GPU (sm_90) ----


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("cfg", [None, dict(PROGRAMS=5)])
def test_hopper_fwd_deepseek_shapes_poisoned(cfg):
    """V3.2 shapes (h128, 576/512, topk 2048) in bf16, invalid indices, a query with no key, NaN-poisoned out."""
    B, T, H, S, K = 2, 48, 128, 8192, 2048
    q, kv, idx = make_inputs(B, T, H, S, K, torch.bfloat16, "cuda", seed=11)
    assert hopper_fwd_supports(q, kv, idx, 512) is None
    out = torch.full((B, T, H, 512), float("nan"), device="cuda", dtype=q.dtype)
    lse = torch.full((B, T, H), float("nan"), device="cuda")
    launch_hopper_fwd(q, kv, idx, 576**-0.5, 512, out, lse, cfg)
    assert torch.isinf(lse[0, 1]).all() and (out[0, 1] == 0).all()
    check_against_naive(out, lse, q, kv, idx, 576**-0.5, sample=torch.tensor([0, 1, 2, 17, 31, 47]))


@pytest.mark.gpu
@hopper_only
def test_hopper_fwd_fp16_ragged_topk():
    """fp16, H = 64, K = 100 (not a multiple of the 64-row block), and strided (sliced) q."""
    B, T, H, S, K = 1, 9, 64, 300, 100
    q, kv, idx = make_inputs(B, T, 2 * H, S, K, torch.float16, "cuda", seed=5)
    q = q[:, :, :H]
    out, lse = sparse_mla_fwd_hopper(q, kv, idx, 0.05, 512)
    check_against_naive(out, lse, q, kv, idx, 0.05, sample=torch.arange(T))


@pytest.mark.gpu
@hopper_only
def test_hopper_fwd_cuda_graph_replay_bitwise():
    B, T, H, S, K = 1, 32, 128, 4096, 2048
    q, kv, idx = make_inputs(B, T, H, S, K, torch.bfloat16, "cuda", seed=7)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sparse_mla_fwd_hopper(q, kv, idx, 0.04, 512)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = sparse_mla_fwd_hopper(q, kv, idx, 0.04, 512)
    q2, kv2, idx2 = make_inputs(B, T, H, S, K, torch.bfloat16, "cuda", seed=8)
    q.copy_(q2)
    kv.copy_(kv2)
    idx.copy_(idx2)
    graph.replay()
    out, lse = sparse_mla_fwd_hopper(q, kv, idx, 0.04, 512)
    assert torch.equal(g_out, out) and torch.equal(g_lse, lse)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("layout", ["topk", "interleaved", "edges"])
def test_hopper_fwd_key_extent_layouts(layout):
    """Producer and consumers stop at the query's key extent: the top-k layout (valid prefix, then -1), holes before
    the last valid slot, single-slot and keyless rows; K = 2000 is not a multiple of either key block; NaN-poisoned
    outputs, every query checked."""
    check_layout_against_naive(layout, B=1, T=40, seed=13, cfg=None)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("layout", ["edges", "interleaved"])
def test_hopper_fwd_persistent_programs_walk_mixed_items(layout):
    """3 persistent programs walk 256 work items each with its own key extent (single-slot and keyless rows among
    them), so the ring's phases, the Q reload and the epilogue's tile hand-back run on across items of different
    lengths; batch 2; NaN-poisoned outputs, every query checked."""
    check_layout_against_naive(layout, B=2, T=64, seed=17, cfg=dict(PROGRAMS=3))


def check_layout_against_naive(layout, B, T, seed, cfg):
    """h128, S 4096, K 2000 (not a multiple of any key block), indices from `layout_indices`; every query checked."""
    from test_ops_key_extent import layout_indices

    H, S, K = 128, 4096, 2000
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, 576, generator=g).to("cuda", torch.bfloat16)
    kv = torch.randn(B, S, 576, generator=g).to("cuda", torch.bfloat16)
    idx = layout_indices(layout, B, T, S, K, g).cuda()
    out = torch.full((B, T, H, 512), float("nan"), device="cuda", dtype=q.dtype)
    lse = torch.full((B, T, H), float("nan"), device="cuda")
    launch_hopper_fwd(q, kv, idx, 576**-0.5, 512, out, lse, cfg)
    check_against_naive(out, lse, q, kv, idx, 576**-0.5, sample=torch.arange(T))


# ---- decode options (triton_decode.decode_overrides) ----


def test_decode_overrides_rule():
    from dsaflow.ops.sparse_mla.triton_decode import decode_overrides

    assert decode_overrides(_t(128, 1, 16, 576), 512) == {"num_warps": 8}
    assert decode_overrides(_t(64, 1, 128, 576), 512) == {}  # h128 decode is compute-bound: prefill options
    assert decode_overrides(_t(4, 1, 16, 40, dtype=torch.float32), 32) == {}


@pytest.mark.gpu
def test_decode_tp8_shard_vs_naive_and_graph():
    """128 x 1 token x 16 heads (a TP-8 shard), bf16, invalid indices and an empty query, through the portable
    split-K kernel (8 warps, 2 splits); graph replay == eager, bit for bit."""
    from dsaflow.ops.sparse_mla.triton_decode import sparse_mla_decode_triton

    def decode(q, kv, idx):
        return sparse_mla_decode_triton(q, kv, idx, 0.04, 512)

    q, kv, idx = make_inputs(128, 1, 16, 2048, 2048, torch.bfloat16, "cuda", seed=21)
    idx[3] = -1
    out, lse = decode(q, kv, idx)
    check_against_naive(out, lse, q, kv, idx, 0.04, sample=torch.arange(1))
    assert torch.isinf(lse[3]).all() and (out[3] == 0).all()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        decode(q, kv, idx)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = decode(q, kv, idx)
    q2, _, idx2 = make_inputs(128, 1, 16, 2048, 2048, torch.bfloat16, "cuda", seed=22)
    q.copy_(q2)
    idx.copy_(idx2)
    graph.replay()
    out, lse = decode(q, kv, idx)
    assert torch.equal(g_out, out) and torch.equal(g_lse, lse)


@pytest.fixture
def forced_kernel(monkeypatch):
    """Set DSAFLOW_SPARSE_MLA_KERNEL for one test (the dispatch reads it once per process: clear its cache)."""

    def force(value: str | None):
        if value is None:
            monkeypatch.delenv(dispatch.ENV_KERNEL, raising=False)
        else:
            monkeypatch.setenv(dispatch.ENV_KERNEL, value)
        dispatch.forced_kernels.cache_clear()

    yield force
    force(None)


def test_explain_walks_the_table_in_order(forced_kernel):
    """CPU tensors: the reference, nothing refused before it. The kernels alone (as the CPU tests run them): the
    Gluon kernel refuses the device, the grad-less kernel refuses a call with grad and the other way round; the
    backward rows are walked apart from the forward ones, cuDNN-Frontend's and the Gluon pass 1 refusing the CPU."""
    q, kv, idx = _t(1, 2, 64, 576), _t(1, 8, 576), torch.zeros(1, 2, 4, dtype=torch.int32)
    assert dispatch.explain_sparse_mla(q, kv, idx, 512) == dispatch.Choice("reference", ())
    assert [row[0] for row in dispatch.KERNELS] == [
        "reference", "empty", "hopper_seesaw", "triton_prefill", "triton_decode", "cudnn", "hopper", "triton"
    ]  # fmt: skip
    with sparse_mla_kernels_only():
        with_grad = dispatch.explain_sparse_mla(q, kv, idx, 512, grad=True)
        no_grad = dispatch.explain_sparse_mla(q, kv, idx, 512, grad=False)
        empty = dispatch.explain_sparse_mla(q[:, :0], kv, idx[:, :0], 512, grad=True)
        backward = dispatch.explain_sparse_mla(q, kv, idx, 512, backward=True, deterministic=False)
    assert with_grad.kernel == "triton_prefill"
    assert [name for name, _ in with_grad.refused] == ["empty", "hopper_seesaw"]
    assert dict(with_grad.refused)["empty"] == "inputs are not empty"
    assert "device cpu" in dict(with_grad.refused)["hopper_seesaw"]
    assert no_grad.kernel == "triton_decode" and "no grad" in dict(no_grad.refused)["triton_prefill"]
    assert empty.kernel == "empty" and empty.refused == ()
    assert "runs triton_decode" in str(no_grad) and "hopper_seesaw: device cpu" in str(no_grad)
    assert backward.kernel == "triton" and [name for name, _ in backward.refused] == ["cudnn", "hopper"]
    assert "device cpu" in dict(backward.refused)["cudnn"] and "device cpu" in dict(backward.refused)["hopper"]


def test_forcing_a_kernel_that_refuses_raises_with_its_reason(forced_kernel):
    """DSAFLOW_SPARSE_MLA_KERNEL restricts the kernels; a forced kernel that refuses the inputs raises with its
    reason; an unknown value is refused with the choices."""
    g = torch.Generator().manual_seed(3)
    q, kv = torch.randn(1, 2, 2, 40, generator=g), torch.randn(1, 8, 40, generator=g)
    idx = torch.randint(0, 8, (1, 2, 4), generator=g, dtype=torch.int32)
    forced_kernel("hopper")
    with pytest.raises(ValueError, match=r"DSAFLOW_SPARSE_MLA_KERNEL=hopper: .*hopper_seesaw: device cpu"):
        sparse_mla_kernels(q, kv, idx, 0.1, 32)
    forced_kernel("triton_prefill")  # a grad-only kernel, forced on a call without grad
    with pytest.raises(ValueError, match=r"triton_prefill: no grad"):
        sparse_mla_kernels(q, kv, idx, 0.1, 32)
    forced_kernel("triton")
    out, lse = sparse_mla_kernels(q, kv, idx, 0.1, 32)
    ref_out, ref_lse = sparse_mla_naive(q, kv, idx, 0.1, 32)
    assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)
    forced_kernel("fastest")
    with pytest.raises(ValueError, match="use one of auto, triton, hopper, hopper_seesaw"):
        sparse_mla_kernels(q, kv, idx, 0.1, 32)


@pytest.mark.gpu
@hopper_only
def test_no_grad_16_head_calls_run_the_split_k_decode(forced_kernel):
    """On sm_90 a no-grad `sparse_mla` call with 16 heads (a TP-8 shard) is the split-K kernel, bit for bit: the
    Gluon forward takes 64-head blocks."""
    from dsaflow.ops.sparse_mla.dispatch import explain_sparse_mla
    from dsaflow.ops.sparse_mla.triton_decode import sparse_mla_decode_triton

    q, kv, idx = make_inputs(4, 2, 16, 3000, 512, torch.bfloat16, "cuda", seed=24)
    choice = explain_sparse_mla(q, kv, idx, 512, grad=False)
    assert choice.kernel == "triton_decode" and "H=16" in dict(choice.refused)["hopper_seesaw"]
    with torch.no_grad():
        out, lse = sparse_mla_kernels(q, kv, idx, 0.04, 512)
    ref_out, ref_lse = sparse_mla_decode_triton(q, kv, idx, 0.04, 512)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_no_grad_rule_takes_the_hopper_forward_from_half_the_sms():
    """128 heads, topk 2048, 132 SMs (the CPU stand-in): 32 sequences x 1 token (64 head-block programs, 2 splits
    for the split-K kernel) and up take the Hopper forward; 16 (4 splits) keep the split-K kernel; a prefill does."""
    from dsaflow.ops.sparse_mla.dispatch import no_grad_takes_hopper_forward

    idx = torch.zeros(1, 1, 2048, dtype=torch.int32)
    assert no_grad_takes_hopper_forward(_t(32, 1, 128, 576), idx, 512)
    assert no_grad_takes_hopper_forward(_t(128, 1, 128, 576), idx, 512)
    assert not no_grad_takes_hopper_forward(_t(16, 1, 128, 576), idx, 512)
    assert no_grad_takes_hopper_forward(_t(1, 4096, 128, 576), idx, 512)


@pytest.mark.gpu
def test_training_forward_uses_the_hopper_kernel_and_matches_the_portable_one(forced_kernel):
    """At V3.2 shapes on sm_90 the differentiable op runs the Gluon forward; its out/lse (and so the Triton backward
    built on them) agree with the portable forward to bf16 rounding."""
    from dsaflow.ops.sparse_mla.dispatch import explain_sparse_mla

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, 256, 128, 576, generator=g).to("cuda", torch.bfloat16).requires_grad_(True)
    kv = torch.randn(1, 4096, 576, generator=g).to("cuda", torch.bfloat16).requires_grad_(True)
    idx = torch.randint(0, 4096, (1, 256, 2048), generator=g, dtype=torch.int32).to("cuda")
    assert explain_sparse_mla(q, kv, idx, 512).kernel == "hopper_seesaw"
    out_h, lse_h = sparse_mla_kernels(q, kv, idx, 576**-0.5, 512)
    forced_kernel("triton")
    assert explain_sparse_mla(q, kv, idx, 512).kernel == "triton_prefill"
    out_t, lse_t = sparse_mla_kernels(q, kv, idx, 576**-0.5, 512)
    assert (out_h.float() - out_t.float()).abs().max().item() < 2e-2
    assert (lse_h - lse_t).abs().max().item() < 1e-3


@pytest.mark.gpu
@hopper_only
def test_dispatch_choices_at_v32_shapes():
    """The table's choice for the shapes that matter on sm_90 (rules only: nothing is launched)."""
    from dsaflow.ops.sparse_mla.dispatch import explain_sparse_mla

    def choice(B, T, H, grad, dtype=torch.bfloat16, d_qk=576, d_v=512):
        q = torch.empty(B, T, H, d_qk, device="cuda", dtype=dtype)
        kv = torch.empty(1, 32768, d_qk, device="cuda", dtype=dtype).expand(B, -1, -1)
        idx = torch.zeros(B, T, 2048, device="cuda", dtype=torch.int32)
        return explain_sparse_mla(q, kv, idx, d_v, grad=grad).kernel

    assert choice(1, 4096, 128, grad=True) == "hopper_seesaw"  # training
    assert choice(1, 4096, 128, grad=False) == "hopper_seesaw"  # prefill
    assert choice(32, 1, 128, grad=False) == "hopper_seesaw"  # decode, grid covers half the SMs
    assert choice(16, 1, 128, grad=False) == "triton_decode"  # decode, split-K is faster
    assert choice(128, 1, 16, grad=False) == "triton_decode"  # TP-8 decode shard
    assert choice(128, 1, 32, grad=False) == "triton_decode"
    assert choice(1, 64, 128, grad=True, dtype=torch.float32, d_qk=192, d_v=128) == "triton_prefill"
