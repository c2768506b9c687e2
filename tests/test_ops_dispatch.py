"""The dispatch of the glue ops (rope, rms_norm, head_proj) on CPU: the kernel each table picks and the reason of every
candidate refused before it, for CPU tensors and for CUDA ones (faked by `is_cuda`: the rules read shapes, dtypes and
the device, never values). The other ops' tables are tested beside their kernels (test_indexer_topk_kernels.py,
test_ops_hopper.py, test_ops_cudnn_peer.py, test_ops_indexer_loss.py, test_ops_dense_indexer_kl.py)."""

from __future__ import annotations

import pytest
import torch
from ops_helpers import FakeCuda

from dsaflow.ops.head_proj import absorb_query, explain_head_proj, head_output
from dsaflow.ops.kernel_table import Choice
from dsaflow.ops.rmsnorm import explain_rms_norm
from dsaflow.ops.rope import explain_rope, rope, rope_into


def test_rope_table():
    x, cos, sin = torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)
    assert explain_rope(x, cos, sin) == Choice("reference", ())
    assert explain_rope(x, cos, sin, out=torch.empty_like(x)) == Choice("reference", ())
    cuda = explain_rope(FakeCuda(x), cos, sin)
    assert cuda == Choice(
        "triton_rope", (("reference", "device cuda runs the kernel"), ("identity", "rope_dim=8 rotates"))
    )
    assert explain_rope(FakeCuda(x), cos, sin, out=x).refused[1] == ("identity", "rope_into writes out")
    assert explain_rope(FakeCuda(x), cos[..., :0], sin[..., :0], 0).kernel == "identity"
    refused = explain_rope(FakeCuda(x), cos, sin, 7)
    assert refused.kernel is None and "rope_dim=7 of d=8" in dict(refused.refused)["triton_rope"]
    refused = explain_rope(FakeCuda(x.double()), cos, sin)
    assert refused.kernel is None and "dtype torch.float64" in dict(refused.refused)["triton_rope"]
    refused = explain_rope(FakeCuda(x), cos[:, :2], sin)
    assert refused.kernel is None and "cos of shape (2, 2, 4)" in dict(refused.refused)["triton_rope"]


def test_rope_runs_the_reference_on_cpu_and_names_the_refusals_it_raises(monkeypatch):
    from dsaflow.ops.rope import dispatch

    g = torch.Generator().manual_seed(0)
    x, cos, sin = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 2, 4, generator=g), torch.randn(1, 2, 4)
    out = torch.full_like(x, float("nan"))
    assert rope_into(x, cos, sin, out) is out and not out.isnan().any()
    assert torch.equal(rope(x, cos[..., :0], sin[..., :0], 0), x)
    monkeypatch.setattr(dispatch, "KERNELS", dispatch.KERNELS[1:])  # as on CUDA: the reference is not a candidate
    assert rope(x, cos[..., :0], sin[..., :0], 0) is x  # identity: nothing rotates
    with pytest.raises(ValueError, match=r"rope: no kernel takes x \(1, 2, 3, 8\).*triton_rope: rope_dim=7 of d=8"):
        rope(x, cos, sin, 7)


def test_rms_norm_table():
    x, w = torch.zeros(3, 8), torch.ones(8)
    assert explain_rms_norm(x, w) == Choice("reference", ())
    assert explain_rms_norm(FakeCuda(x), w) == Choice(
        "triton_rmsnorm", (("reference", "device cuda runs the kernels"),)
    )
    refused = explain_rms_norm(FakeCuda(x), torch.ones(7))
    assert refused.kernel is None and "weight [D] for x [..., D]" in dict(refused.refused)["triton_rmsnorm"]
    refused = explain_rms_norm(FakeCuda(torch.zeros(3, 16385)), torch.ones(16385))
    assert refused.kernel is None and "D=16385 > 16384" in dict(refused.refused)["triton_rmsnorm"]
    refused = explain_rms_norm(FakeCuda(x.double()), w)
    assert refused.kernel is None and "dtypes x=torch.float64" in dict(refused.refused)["triton_rmsnorm"]


def test_head_proj_table():
    """One kernel on every device, strided batched matmuls; its rule refuses what the matmuls cannot take."""
    q, w_uk = torch.zeros(1, 2, 4, 12), torch.zeros(4, 8, 16)
    o_lat, w_uv = torch.zeros(1, 2, 4, 16), torch.zeros(4, 6, 16)
    for x in (q, FakeCuda(q)):
        assert explain_head_proj("absorb_query", x, w_uk) == Choice("strided_bmm", ())
    assert explain_head_proj("head_output", o_lat, w_uv) == Choice("strided_bmm", ())
    refusals = {
        "activation dtype torch.float32 != weight dtype torch.float64": ("absorb_query", q, w_uk.double()),
        "q (1, 2, 4, 8) with w_uk (4, 8, 16)": ("absorb_query", q[..., :8], w_uk),  # no rope dims left
        "q (1, 2, 4, 12) with w_uk (3, 8, 16)": ("absorb_query", q, w_uk[:3]),
        "o_lat (1, 2, 4, 16) with w_uv (4, 16, 6)": ("head_output", o_lat, w_uv.transpose(1, 2)),
    }
    for reason, args in refusals.items():
        choice = explain_head_proj(*args)
        assert choice.kernel is None and reason in dict(choice.refused)["strided_bmm"], (reason, str(choice))
    with pytest.raises(ValueError, match="op 'absorb'"):
        explain_head_proj("absorb", q, w_uk)
    with pytest.raises(ValueError, match=r"absorb_query: no kernel takes q \(1, 2, 4, 12\).*strided_bmm: activation"):
        absorb_query(q, w_uk.double(), torch.zeros(1, 2, 2), torch.zeros(1, 2, 2))
    with pytest.raises(ValueError, match="head_output: no kernel takes .*expected"):
        head_output(o_lat, w_uv.transpose(1, 2))
