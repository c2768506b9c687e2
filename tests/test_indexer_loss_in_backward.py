"""The indexer loss computed inside the backward (`IndexerLossInBackward`, what training runs) against the forward
timing (the reference): same logged values, same gradients everywhere, on the plain and the recomputed attention,
and the rules for when a stage accepts it. GPU: the target the sparse-attention backward fills."""

import pytest
import torch
from model_helpers import planned_sharp, tokens

from dsaflow.model import IndexerLossInBackward
from dsaflow.model import indexer_loss as indexer_loss_module
from dsaflow.pipeline.stages import build_stages


def _grads(stage):
    return {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}


def _both_modes(layout, x, weight, chunk=None, device="cpu", recompute="attention"):
    """(forward-mode loss, grads), (backward-mode logged values, grads) for LM-like loss + weight * indexer loss.
    chunk: recompute (`recompute` mode) with that many tokens per attention chunk; None: no recomputation."""
    model, plan = planned_sharp(layout)
    stage = build_stages(model, plan, seed=3)[0].to(device)
    x = x.to(device)
    stage.train()
    if chunk is not None:
        stage.recompute = recompute
        stage.recompute_chunk_tokens = chunk
    out = stage(x, compute_indexer_loss=True)
    loss = stage.indexer_loss
    (out.pow(2).mean() + weight * loss).backward()
    forward = (loss.detach(), _grads(stage))
    stage.zero_grad(set_to_none=True)
    sink = IndexerLossInBackward(weight)
    out = stage(x, indexer_loss_in_backward=sink)
    assert stage.indexer_loss is None and sink.values == []  # nothing before the backward
    out.pow(2).mean().backward()
    return forward, (sink.values, _grads(stage))


@pytest.mark.parametrize("layout", ["FSSSFSSS", "FSFSFFSS", "FFFFFFFF"])
def test_backward_mode_equals_forward_mode(layout):
    (loss, g_fwd), (values, g_bwd) = _both_modes(layout, tokens(2, 12, seed=1), weight=0.7)
    assert len(values) == 1
    torch.testing.assert_close(values[0], loss, rtol=1e-6, atol=1e-9)
    assert g_fwd.keys() == g_bwd.keys() and any(".attn.indexer." in n for n in g_bwd)
    for n in g_fwd:
        torch.testing.assert_close(g_bwd[n], g_fwd[n], rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("recompute", ["attention", "block"])
@pytest.mark.parametrize("chunk", [10, 1 << 14])
def test_backward_mode_under_recomputation(monkeypatch, recompute, chunk):
    """Chunks of 5 query rows (10 tokens / B=2; T=12: three chunks): each chunk's backward fills its own rows. Under
    `block` the whole layer runs again in backward: the target is still filled once and each KL runs once."""
    runs = []
    real = indexer_loss_module.indexer_kl
    monkeypatch.setattr(indexer_loss_module, "indexer_kl", lambda *a: runs.append(1) or real(*a))
    (loss, g_fwd), (values, g_bwd) = _both_modes("FSSSFSSS", tokens(2, 12, seed=2), 1.0, chunk, recompute=recompute)
    assert len(runs) == 2 + 2 and len(values) == 1  # forward timing: 2 F layers; backward timing: each KL once
    torch.testing.assert_close(values[0], loss, rtol=1e-6, atol=1e-9)
    for n in g_fwd:
        torch.testing.assert_close(g_bwd[n], g_fwd[n], rtol=1e-5, atol=1e-7, msg=n)


def test_backward_mode_logs_one_value_per_forward_and_only_trains_indexers_through_the_kl():
    model, plan = planned_sharp("FSSSFSSS")
    stage = build_stages(model, plan, seed=1)[0]
    stage.train()
    sink = IndexerLossInBackward(1.0)
    outs = [stage(tokens(1, 9, seed=s), indexer_loss_in_backward=sink) for s in (4, 5)]
    assert sink.values == []
    (outs[0].sum() * 0).backward()  # an LM gradient of zero: every gradient left is the indexer KL's
    assert len(sink.values) == 1 and sink.values[0].item() > 0
    for n, p in stage.named_parameters():
        if ".attn.indexer." in n:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
        else:
            assert p.grad is None or not p.grad.any(), n
    outs[1].sum().backward()
    assert len(sink.values) == 2


def test_backward_mode_refuses_what_it_cannot_do():
    model, plan = planned_sharp("FSSSFSSS")
    stage = build_stages(model, plan)[0]
    stage.train()
    with pytest.raises(ValueError, match="attn='dense'"):
        stage(tokens(1, 8), attn="dense", indexer_loss_in_backward=IndexerLossInBackward())
    with torch.no_grad(), pytest.raises(ValueError, match="grad=False"):
        stage(tokens(1, 8), indexer_loss_in_backward=IndexerLossInBackward())
    stage.eval()
    with pytest.raises(ValueError, match="training=False"):
        stage(tokens(1, 8), indexer_loss_in_backward=IndexerLossInBackward())


@pytest.mark.gpu
@pytest.mark.parametrize("chunk,recompute", [(None, "none"), (10, "attention"), (10, "block"), (1 << 14, "block")])
def test_gpu_backward_mode_equals_forward_mode(chunk, recompute):
    """On CUDA the two modes take their targets from different kernels (the target kernel in the forward, the
    attention backward's own probabilities); fp32, plain, recomputed attention and recomputed blocks."""
    (loss, g_fwd), (values, g_bwd) = _both_modes("FSSSFSSS", tokens(2, 48, seed=6), 0.5, chunk, "cuda", recompute)
    torch.testing.assert_close(values[0], loss, rtol=1e-4, atol=1e-7)
    assert g_fwd.keys() == g_bwd.keys()
    for n in g_fwd:
        torch.testing.assert_close(g_bwd[n], g_fwd[n], rtol=1e-3, atol=1e-6, msg=n)


@pytest.mark.parametrize("recompute", ["none", "block"])
def test_zero_bubble_split_backward_runs_each_kl_once(recompute):
    """torch's zero-bubble schedules split a stage backward into an input pass and a weight pass, which calls the
    KL node twice: the KL runs once, and the weight pass gets the same gradients as one plain backward. Under
    `block` each pass recomputes the blocks it needs; the recomputation records nothing and runs no KL."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    model, plan = planned_sharp("FSSSFSSS")
    stage = build_stages(model, plan, seed=2)[0]
    stage.train()
    stage.recompute = recompute
    h = stage.embed(tokens(2, 10, seed=7)).detach()
    stage.embed = None  # a middle stage: hidden states in, hidden states out
    sink = IndexerLossInBackward(1.0)
    h1 = h.clone().requires_grad_(True)
    stage(h1, indexer_loss_in_backward=sink).pow(2).mean().backward()
    plain = _grads(stage)
    stage.zero_grad(set_to_none=True)
    runs = []
    real = indexer_loss_module.indexer_kl
    indexer_loss_module.indexer_kl = lambda *a: runs.append(1) or real(*a)
    try:
        h2 = h.clone().requires_grad_(True)
        out = stage(h2, indexer_loss_in_backward=sink)
        loss = out.pow(2).mean()
        _, groups = stage_backward_input([loss], None, [h2], iter(list(stage.parameters())))
        assert len(runs) == 2  # the input pass ran both F layers' KL ...
        stage_backward_weight(iter(list(stage.parameters())), groups)
        assert len(runs) == 2  # ... and the weight pass reused them
    finally:
        indexer_loss_module.indexer_kl = real
    assert len(sink.values) == 2
    torch.testing.assert_close(sink.values[1], sink.values[0])
    zb = _grads(stage)
    assert zb.keys() == plain.keys()
    for n in plain:
        torch.testing.assert_close(zb[n], plain[n], rtol=1e-5, atol=1e-7, msg=n)
