"""The loss head in chunks (dsaflow.model.loss_head): final norm + LM head + cross-entropy over token chunks equals
the unchunked F.cross_entropy(head(norm(h))) in loss, every gradient and argmax, and never keeps [tokens, vocab]."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsaflow.config.schema import ModelConfig
from dsaflow.model import build_model
from dsaflow.model.loss_head import IGNORE_INDEX, chunked_lm_loss
from dsaflow.ops.rmsnorm import rms_norm_naive
from dsaflow.train.pipeline import LMLoss

N_ROWS, T, D, V, EPS = 2, 37, 24, 96, 1e-6
# fp32: each loss term is logsumexp over V logits minus one of them, and each gradient a sum over at most N*T rows
# or V columns, in a different order than the unchunked matmul: a few ulps times the terms summed
RTOL = 1e-5


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N_ROWS, T, D, generator=g).requires_grad_()
    nw = (1 + 0.2 * torch.randn(D, generator=g)).requires_grad_()
    w = (0.3 * torch.randn(V, D, generator=g)).requires_grad_()
    target = torch.randint(0, V, (N_ROWS, T), generator=g)
    target[0, :6] = IGNORE_INDEX  # ignored positions: no loss, no gradient, not counted in the mean
    target[1, -3:] = IGNORE_INDEX
    return h, nw, w, target


def _reference(h, nw, w, target):
    logits = rms_norm_naive(h, nw, EPS) @ w.t()
    return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), ignore_index=IGNORE_INDEX), logits.argmax(-1)


def _close(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.mark.parametrize("chunk", [1, 7, N_ROWS * T, 4096])  # one row, ragged chunks, exactly one, more than all
def test_chunked_equals_unchunked_in_loss_gradients_and_argmax(chunk):
    h, nw, w, target = _inputs()
    ref, ref_argmax = _reference(h, nw, w, target)
    ref_grads = torch.autograd.grad(ref, (h, nw, w))
    loss, argmax = chunked_lm_loss(h, nw, w, target, chunk, EPS, want_argmax=True)
    grads = torch.autograd.grad(loss, (h, nw, w))
    assert abs(loss.item() - ref.item()) <= RTOL * ref.item()
    assert torch.equal(argmax, ref_argmax)
    for name, g, r in zip(("hidden", "norm weight", "head weight"), grads, ref_grads):
        assert _close(g, r) < RTOL, (chunk, name, _close(g, r))
    # ignored positions get no gradient at all
    assert grads[0][0, :6].abs().max() == 0 and grads[0][1, -3:].abs().max() == 0


def test_already_normed_hidden_takes_no_norm():
    """norm_weight=None (an MTP depth's output, normed by its own head_norm): the head reads the hidden state as is,
    equal to F.cross_entropy(h @ w.T) in loss and both gradients."""
    h, _, w, target = _inputs(3)
    ref = F.cross_entropy((h @ w.t()).reshape(-1, V), target.reshape(-1), ignore_index=IGNORE_INDEX)
    ref_grads = torch.autograd.grad(ref, (h, w))
    loss, _ = chunked_lm_loss(h, None, w, target, 7, EPS)
    grads = torch.autograd.grad(loss, (h, w))
    assert abs(loss.item() - ref.item()) <= RTOL * ref.item()
    for name, g, r in zip(("hidden", "head weight"), grads, ref_grads):
        assert _close(g, r) < RTOL, name


def test_the_graph_never_keeps_tokens_by_vocab():
    """What the autograd graph saves is the inputs plus one log-sum-exp per token: no tensor of N*T*V elements (the
    unchunked head saves its logits)."""
    h, nw, w, target = _inputs(1)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        loss, _ = chunked_lm_loss(h, nw, w, target, 8, EPS)
    assert saved and max(saved) <= max(h.numel(), w.numel()) < N_ROWS * T * V, saved
    loss.backward()
    assert h.grad is not None and w.grad is not None


def test_evaluation_needs_no_graph():
    h, nw, w, target = _inputs(2)
    with torch.no_grad():
        loss, argmax = chunked_lm_loss(h, nw, w, target, 5, EPS)
    ref, _ = _reference(h.detach(), nw.detach(), w.detach(), target)
    assert argmax is None and not loss.requires_grad
    assert abs(loss.item() - ref.item()) <= RTOL * ref.item()


def test_lm_loss_with_the_stage_head_equals_the_logits_path():
    """The trainer's LMLoss on the last stage's hidden state (head_in_loss) equals it on the stage's logits: loss,
    every parameter's gradient and the retrieval-accuracy counters."""
    cfg = ModelConfig(num_layers=2, dim=32, inter_dim=64, index_topk=8, vocab_size=61)
    model = build_model(cfg, "FS", seed=3)
    x = torch.randint(0, 61, (2, 20))
    target = torch.stack([torch.randint(0, 61, (2, 20)), torch.full((2, 20), IGNORE_INDEX), torch.full((2, 20), -1)], 1)
    target[:, 1, -2:] = target[:, 0, -2:]  # two answer positions per row, query 0
    target[:, 2, -2:] = 0
    results = []
    for head_in_loss in (False, True):
        model.zero_grad()
        model.head_in_loss = head_in_loss
        loss_fn = LMLoss(1, model if head_in_loss else None, chunk_tokens=9)
        out = model(x)
        assert out.shape[-1] == (cfg.dim if head_in_loss else cfg.vocab_size)
        loss = loss_fn(out, target)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.item(), grads, int(loss_fn.correct), int(loss_fn.total)))
    (ref_loss, ref_grads, *ref_acc), (loss, grads, *acc) = results
    assert abs(loss - ref_loss) <= RTOL * ref_loss and acc == ref_acc and ref_acc[1] == 2
    assert grads.keys() == ref_grads.keys()
    for n in ref_grads:
        assert _close(grads[n], ref_grads[n]) < RTOL, n


@pytest.mark.gpu
def test_gpu_bf16_chunked_head_matches_and_holds_a_fraction_of_the_memory():
    """CUDA, bf16 autocast, GLM-4.7-Flash's head (dim 2048, vocab 154,880) at 16K tokens: the chunked loss equals the
    unchunked one within bf16 rounding of the logits, and its extra peak memory (one chunk of logits, the head's
    gradient buffers) is under half of the unchunked head's (every token's bf16 and fp32 logits and their gradient:
    about 35 GiB)."""
    n, d, v = 16384, 2048, 154880
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, d, device="cuda", generator=g).requires_grad_()
    nw = (1 + 0.1 * torch.randn(d, device="cuda", generator=g)).requires_grad_()
    w = (0.02 * torch.randn(v, d, device="cuda", generator=g)).requires_grad_()
    target = torch.randint(0, v, (n,), device="cuda", generator=g)

    def run(chunked: bool):
        for t in (h, nw, w):
            t.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if chunked:
                loss, _ = chunked_lm_loss(h, nw, w, target, 2048, EPS)
            else:
                from dsaflow.ops.rmsnorm import rms_norm

                loss = F.cross_entropy(F.linear(rms_norm(h, nw, EPS), w).float(), target)
        loss.backward()
        torch.cuda.synchronize()
        return loss.item(), [t.grad.clone() for t in (h, nw, w)], torch.cuda.max_memory_allocated() - base

    ref_loss, ref_grads, ref_peak = run(False)
    loss, grads, peak = run(True)
    # the logits are bf16 products either way; GEMMs of 2048 rows and of 16K may round a logit differently by one
    # bf16 ulp (2^-8 relative), which moves the mean loss far less
    assert abs(loss - ref_loss) <= 1e-3 * ref_loss
    for name, got, ref in zip(("hidden", "norm weight", "head weight"), grads, ref_grads):
        assert _close(got.float(), ref.float()) < 2**-6, name
    assert peak < ref_peak / 2, (peak / 2**30, ref_peak / 2**30)
