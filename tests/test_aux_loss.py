"""The stage-local indexer loss reaches autograd inside the stage's own backward (sparse: after each group's
attention backward; dense: through the stage output, `attach_aux_loss`), never through a `.backward()` inside the
forward."""

from __future__ import annotations

import torch
from model_helpers import planned

from dsaflow.pipeline.stages import stage_module
from dsaflow.train.pipeline import TrainStage, attach_aux_loss


def test_attach_aux_loss_adds_weighted_gradient():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, generator=g, requires_grad=True)
    w = torch.randn(4, generator=g, requires_grad=True)
    out = x * 2.0
    aux = (w**2).sum()
    y = attach_aux_loss(out, aux, weight=0.5)
    assert torch.equal(y, out) and not y._is_view()
    (y * 3.0).sum().backward()
    assert torch.allclose(x.grad, torch.full_like(x, 6.0))
    assert torch.allclose(w.grad, 0.5 * 2 * w.detach())


def test_train_stage_computes_the_sparse_indexer_loss_inside_the_output_backward():
    mcfg, plan = planned("(FS)*4")
    stage = stage_module(mcfg, plan, 0, seed=0).train()
    wrapper = TrainStage(stage, indexer_loss_weight=1.0)
    wrapper.live = True
    tokens = torch.randint(0, mcfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    out = wrapper(tokens)
    idx_params = stage.indexer_parameters()
    assert idx_params and all(p.grad is None for p in idx_params), "no backward may run inside the forward"
    assert not wrapper.indexer_losses  # the KL runs in the backward, after each group's attention backward
    out.float().logsumexp(-1).mean().backward()
    assert len(wrapper.indexer_losses) == 1 and wrapper.indexer_losses[0] > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in idx_params)


def test_train_stage_attaches_the_dense_indexer_loss_to_the_output():
    mcfg, plan = planned("(FS)*4")
    stage = stage_module(mcfg, plan, 0, seed=0).train()
    wrapper = TrainStage(stage, indexer_loss_weight=1.0)
    wrapper.live, wrapper.attn = True, "dense"
    tokens = torch.randint(0, mcfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    out = wrapper(tokens)
    idx_params = stage.indexer_parameters()
    assert all(p.grad is None for p in idx_params), "no backward may run inside the forward"
    assert len(wrapper.indexer_losses) == 1 and wrapper.indexer_losses[0] > 0
    out.float().logsumexp(-1).mean().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in idx_params)


def test_shape_inference_calls_compute_no_indexer_loss():
    mcfg, plan = planned("(FS)*4")
    stage = stage_module(mcfg, plan, 0, seed=0).train()
    wrapper = TrainStage(stage)  # live stays False: torch's shape inference calls the module like this
    out = wrapper(torch.zeros(1, 8, dtype=torch.long))
    out.float().sum().backward()
    assert not wrapper.indexer_losses
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in stage.indexer_parameters())
