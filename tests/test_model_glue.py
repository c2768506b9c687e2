"""The model with the projection / RoPE / RMSNorm ops == the model with their torch references (the code they
replaced): loss, indexer loss and every parameter gradient of a stage's forward + backward.

On CPU the RoPE and RMSNorm dispatch to the references anyway, so the CPU test checks the strided-bmm projections
against einsum / cat in fp32. The `gpu` tests run the Triton kernels in fp32 (tight) and under bf16 autocast.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import planned_sharp, tokens

from dsaflow.model import mla, norms, rope
from dsaflow.ops.head_proj import absorb_query_naive, head_output_naive
from dsaflow.ops.rmsnorm import rms_norm_naive
from dsaflow.ops.rope import rope_naive
from dsaflow.pipeline.stages import stage_module


def use_references(monkeypatch):
    monkeypatch.setattr(mla, "absorb_query", absorb_query_naive)
    monkeypatch.setattr(mla, "head_output", head_output_naive)
    monkeypatch.setattr(norms, "rms_norm", rms_norm_naive)
    monkeypatch.setattr(rope, "rope", rope_naive)


def step(device, autocast: bool, attn: str = "sparse"):
    """(loss, indexer loss, {name: grad}) of one forward + backward of a 4-layer FSFS stage on B=2, T=13 tokens."""
    model, plan = planned_sharp("FSFS", "model.num_layers=4")
    stage = stage_module(model, plan, 0, seed=0).to(device).train()
    x = tokens(2, 13, seed=3).to(device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        out = stage(x, attn=attn, compute_indexer_loss=True)
    loss = out.float().logsumexp(-1).mean()
    aux = stage.indexer_loss
    (loss + aux).backward()
    grads = {n: p.grad.detach().clone() for n, p in stage.named_parameters() if p.grad is not None}
    return loss.detach(), aux.detach(), grads


def compare(device, autocast, monkeypatch, tol, attn="sparse"):
    loss, aux, grads = step(device, autocast, attn)
    with monkeypatch.context() as m:
        use_references(m)
        ref_loss, ref_aux, ref_grads = step(device, autocast, attn)
    torch.testing.assert_close(loss, ref_loss, rtol=tol, atol=tol)
    torch.testing.assert_close(aux, ref_aux, rtol=tol, atol=tol)
    assert grads.keys() == ref_grads.keys() and any("wkv_b" in n for n in grads)
    for n in grads:
        err = ((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-30)).item()
        assert err < tol, (n, err)


@pytest.mark.parametrize("attn", ["sparse", "dense"])
def test_cpu_stage_with_projection_ops_equals_references_fp32(monkeypatch, attn):
    compare("cpu", False, monkeypatch, 1e-5, attn)


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["sparse", "dense"])
def test_gpu_stage_with_kernels_equals_references_fp32(monkeypatch, attn):
    compare("cuda", False, monkeypatch, 1e-4, attn)


@pytest.mark.gpu
def test_gpu_stage_with_kernels_equals_references_bf16_autocast(monkeypatch):
    compare("cuda", True, monkeypatch, 3e-2)
