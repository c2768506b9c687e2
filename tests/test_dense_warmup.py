"""Dense warm-up at O(T) memory: dense attention without a cache is causal SDPA and its indexer loss is streamed.

No [B, T, S] tensor: `causal_indices` and the [B, T, S] recorders must not run; outputs and losses equal the
sparse path when top-k covers every key; padding and unaligned positions stay right.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import planned_sharp, tokens

import dsaflow.model.indexer_loss as indexer_loss_mod
import dsaflow.model.mla as mla_mod
from dsaflow.pipeline.stages import build_stages


def _forbid(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a [B, T, S] tensor was built in dense training mode")

    monkeypatch.setattr(mla_mod, "causal_indices", boom)
    monkeypatch.setattr(indexer_loss_mod, "attention_target", boom)  # the sparse-path target ([B, T, K] per key set)
    monkeypatch.setattr(indexer_loss_mod, "indexer_kl", boom)


def test_dense_training_builds_no_t_by_s_tensor_and_trains_only_indexers(monkeypatch):
    T = 24
    model, plan = planned_sharp("FSSFS", "model.num_layers=5", f"model.index_topk={T}")
    (stage,) = build_stages(model, plan, seed=3)
    stage.train()
    x = tokens(2, T, seed=1)
    ref_out = stage(x, attn="sparse", compute_indexer_loss=True)  # top-k = T: every causal key, same target
    ref_loss = stage.indexer_loss.detach()
    _forbid(monkeypatch)
    out = stage(x, attn="dense", compute_indexer_loss=True)
    loss = stage.indexer_loss
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-4, atol=1e-6)
    loss.backward()
    for n, p in stage.named_parameters():
        if ".attn.indexer." in n:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
        else:
            assert p.grad is None, n


def test_dense_padding_queries_leave_real_tokens_unchanged(monkeypatch):
    model, plan = planned_sharp("FSSS|FSSS")
    stages = build_stages(model, plan)
    x = tokens(1, 9, seed=2)
    padded = torch.cat([x, tokens(1, 3, seed=5)], dim=1)
    pos = torch.cat([torch.arange(9), torch.full((3,), -1)]).unsqueeze(0)
    for s in stages:
        s.train()
    _forbid(monkeypatch)  # positions given but causal-aligned: still the SDPA path
    h, h_pad = x, padded
    losses = []
    for s in stages:
        h = s(h, attn="dense", compute_indexer_loss=True)
        ref_loss = s.indexer_loss
        h_pad = s(h_pad, positions=pos, attn="dense", compute_indexer_loss=True)
        losses.append((s.indexer_loss, ref_loss))
    torch.testing.assert_close(h_pad[:, :9], h, rtol=1e-4, atol=1e-4)
    for got, ref in losses:  # padding queries are left out of the mean; real queries see the same keys
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)


@torch.no_grad()
def test_dense_with_unaligned_positions_equals_sparse_covering_every_key():
    """Positions that are not the row index (here shifted by 2, with left padding) take the exact fallback
    (sparse_mla over every visible key), which must equal sparse attention whose top-k covers every key."""
    T = 10
    model, plan = planned_sharp("FSSS|FSSS", f"model.index_topk={T}")
    stages = build_stages(model, plan)
    pos = torch.cat([torch.full((2,), -1), torch.arange(T - 2)]).unsqueeze(0)
    x = tokens(1, T, seed=6)
    outs = {}
    for attn in ("sparse", "dense"):
        h = x
        for s in stages:
            h = s(h, positions=pos, attn=attn)
        outs[attn] = h
    torch.testing.assert_close(outs["dense"], outs["sparse"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["FSSS|FSSS", "FSFS|FFSS"])
def test_dense_indexer_gradients_equal_under_pp1_and_pp2(layout):
    model, plan1 = planned_sharp(layout.replace("|", ""))
    _, plan2 = planned_sharp(layout)
    (one,) = build_stages(model, plan1, seed=5)
    two = build_stages(model, plan2, seed=5)
    x = tokens(2, 12, seed=3)
    for s in (one, *two):
        s.train()
    one(x, attn="dense", compute_indexer_loss=True)
    one.indexer_loss.backward()
    h = two[0](x, attn="dense", compute_indexer_loss=True)
    l0 = two[0].indexer_loss
    two[1](h, attn="dense", compute_indexer_loss=True)
    (l0 + two[1].indexer_loss).backward()
    g1 = {n: p.grad for n, p in one.named_parameters() if ".indexer." in n}
    g2 = {n: p.grad for s in two for n, p in s.named_parameters() if ".indexer." in n}
    assert g1.keys() == g2.keys() and g1
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], rtol=1e-5, atol=1e-7)
