"""Indexer KL loss: graph only through indexer weights, equal to a textbook float64 recomputation, PP-independent."""

import pytest
import torch
from model_helpers import planned_sharp, tokens

from dsaflow.model.rope import apply_rope, apply_rope_prefix, rope_angles
from dsaflow.pipeline.stages import build_stages


def textbook_head_probs(attn, x, pos, m):
    """Non-absorbed MLA softmax probs per head over all causal keys, float64: [B, H, T, T]."""
    B, T, _ = x.shape
    H, N, R, C = m.n_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
    cos, sin = (t.double() for t in rope_angles(pos, R, m.rope_theta))
    q = attn.wq_b(attn.q_norm(attn.wq_a(x))).view(B, T, H, N + R)
    c_kv, k_pe = attn.wkv_a(x).split([C, R], -1)
    k_nope = attn.wkv_b(attn.kv_norm(c_kv)).view(B, T, H, -1)[..., :N]
    s = torch.einsum("bthn,bshn->bhts", q[..., :N], k_nope)
    s = s + torch.einsum("bthr,bsr->bhts", apply_rope(q[..., N:], cos, sin), apply_rope(k_pe, cos, sin))
    s = s * (N + R) ** -0.5
    causal = torch.arange(T).view(1, -1) <= pos.unsqueeze(-1)  # [B, T, S]
    return s.masked_fill(~causal.unsqueeze(1), float("-inf")).softmax(-1)


def textbook_index_scores(attn, x, pos, m):
    """Index scores [B, T, S] float64 (-inf where not causal) by broadcasting."""
    ix = attn.indexer
    B, T, _ = x.shape
    cos, sin = (t.double() for t in rope_angles(pos, m.index_rope_head_dim, m.rope_theta))
    q = apply_rope_prefix(ix.wq_b(attn.q_norm(attn.wq_a(x))).view(B, T, m.index_n_heads, -1), cos, sin, 8)
    k = apply_rope_prefix(ix.k_norm(ix.wk(x)), cos, sin, 8)
    w = ix.weights_proj(x) * (m.index_n_heads * m.index_head_dim) ** -0.5
    dots = (q.unsqueeze(3) * k.unsqueeze(1).unsqueeze(1)).sum(-1).clamp_min(0)  # [B, T, H_I, S]
    scores = (dots * w.unsqueeze(-1)).sum(2)
    causal = torch.arange(T).view(1, -1) <= pos.unsqueeze(-1)
    return scores.masked_fill(~causal, float("-inf"))


def reference_loss(stage, inputs, pos, m, topk):
    """Sum over F layers of KL(mean over the F layer's group of head-mean probs on the key set || softmax(scores))."""
    f_layers = [l.layer_index for l in stage.layers.values() if l.role == "F"]
    total = 0.0
    for f in f_layers:
        attn_f = stage.layers[str(f)].attn.double()
        scores = textbook_index_scores(attn_f, inputs[f], pos, m)  # [B, T, S]
        order = scores.sort(dim=-1, descending=True, stable=True).indices[..., :topk]
        in_set = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, order, True) & torch.isfinite(scores)
        group = [l.layer_index for l in stage.layers.values() if l.source == f]
        dists = []
        for l in group:
            p = textbook_head_probs(stage.layers[str(l)].attn.double(), inputs[l], pos, m) * in_set.unsqueeze(1)
            p = p / p.sum(-1, keepdim=True).clamp_min(1e-300)  # each head renormalised on the set
            dists.append(p.mean(1))
        target = torch.stack(dists).mean(0)
        logq = scores.masked_fill(~in_set, float("-inf")).log_softmax(-1)
        kl = torch.where(in_set, target * (target.clamp_min(1e-300).log() - logq), torch.zeros_like(target)).sum(-1)
        valid = in_set.any(-1)
        total = total + (kl * valid).sum() / valid.sum()
    return total


@pytest.mark.parametrize("attn,topk", [("sparse", 4), ("dense", 16)])
def test_indexer_loss_matches_textbook_recomputation(attn, topk):
    model, plan = planned_sharp("FSSFS", "model.num_layers=5", f"model.index_topk={topk}")
    (stage,) = build_stages(model, plan, seed=2)
    inputs = {}
    for key, layer in stage.layers.items():
        layer.attn.register_forward_hook(lambda mod, args, out, i=int(key): inputs.__setitem__(i, args[0].detach()))
    T = 11
    stage.train()
    stage(tokens(2, T), attn=attn, compute_indexer_loss=True)
    got = stage.indexer_loss
    assert got is not None and got.ndim == 0 and got.item() > 1e-3
    pos = torch.arange(T).expand(2, T)
    ref = reference_loss(stage, {i: x.double() for i, x in inputs.items()}, pos, model, topk if attn == "sparse" else T)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-6)


def test_indexer_loss_gradients_reach_only_indexer_weights():
    model, plan = planned_sharp("FSSS|FSSS")
    stage = build_stages(model, plan)[0]
    stage.train()
    stage.compute_indexer_loss = True
    stage(tokens(2, 10))
    stage.indexer_loss.backward()
    indexer = {n for n, _ in stage.named_parameters() if ".attn.indexer." in n}
    assert indexer and {n for n, _ in stage.named_parameters() if "indexer" in n} == indexer
    for n, p in stage.named_parameters():
        if n in indexer:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
        else:
            assert p.grad is None or not p.grad.any(), n
    stage.zero_grad(set_to_none=True)
    stage(tokens(2, 10)).pow(2).mean().backward()  # the main path never reaches the indexer
    assert all(p.grad is None for n, p in stage.named_parameters() if n in indexer)
    assert all(p.grad is not None for n, p in stage.named_parameters() if n not in indexer)
    stage.eval()
    stage(tokens(2, 10))
    assert stage.indexer_loss is None  # only in training mode
    stage.train()
    stage(tokens(2, 10), compute_indexer_loss=False)
    assert stage.indexer_loss is None


def test_indexer_gradients_are_identical_under_pp1_and_pp2():
    model, plan1 = planned_sharp("FSSSFSSS")
    _, plan2 = planned_sharp("FSSS|FSSS")
    (one,) = build_stages(model, plan1, seed=5)
    two = build_stages(model, plan2, seed=5)
    x = tokens(2, 12, seed=3)
    for s in (one, *two):
        s.train()
        s.compute_indexer_loss = True
    one(x)
    one.indexer_loss.backward()
    two[1](two[0](x))
    (two[0].indexer_loss + two[1].indexer_loss).backward()
    grads2 = {n: p.grad for s in two for n, p in s.named_parameters() if ".indexer." in n}
    grads1 = {n: p.grad for n, p in one.named_parameters() if ".indexer." in n}
    assert grads1.keys() == grads2.keys() and len(grads1) == 10
    for n in grads1:
        torch.testing.assert_close(grads2[n], grads1[n], rtol=1e-5, atol=1e-7)


def test_indexer_loss_stays_fp32_under_bf16_autocast():
    """KL >= 0 and equal to the fp32 value up to bf16 noise in the model itself (not in the loss arithmetic)."""
    model, plan = planned_sharp("FSSS|FSSS", "model.init_std=0.02")
    stage = build_stages(model, plan)[0]
    stage.train()
    x = tokens(2, 16, seed=4)
    stage(x, compute_indexer_loss=True)
    fp32 = stage.indexer_loss.detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stage(x, compute_indexer_loss=True)
    loss = stage.indexer_loss
    assert loss.dtype == torch.float32 and 0 < loss.item() and fp32.item() > 0
    torch.testing.assert_close(loss.detach(), fp32, rtol=0.05, atol=1e-8)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in stage.indexer_parameters())
