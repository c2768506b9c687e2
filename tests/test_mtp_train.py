"""Training with multi-token prediction (model.mtp_layers, train.mtp_loss_weight): the MTP layer's loss against a
naive fp32 reference, and PP=1 against PP=2 under 1F1B and ZBVZeroBubble, with block recompute and IndexCache roles
(gloo, CPU): the same per-step LM losses, `mtp_loss` and gradients, the MTP layer's included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from train_harness import run_configs, tiny_cfg

from dsaflow.config.schema import ModelConfig
from dsaflow.data import IGNORE
from dsaflow.model import build_model
from dsaflow.train.pipeline import LMLoss

STEPS = 3
# (stages, ranks, schedule, recompute): 1F1B, and a zero-bubble schedule (its split input / weight backward, two
# stages per rank in a V) with block recompute; IndexCache roles "FS" (S layers reusing their F layer's indices on
# every stage)
LAYOUTS = [(2, 2, "1F1B", "none"), (4, 2, "ZBVZeroBubble", "block")]


def mtp_cfg(stages=1, ranks=None, schedule="1F1B", recompute="none"):
    cfg = tiny_cfg(stages, ranks, schedule, steps=STEPS, final_ckpt=False, recompute=recompute, mtp_loss_weight=0.3)
    cfg.model.mtp_layers = 1
    cfg.data.loss_on = "all"  # every position has an LM target, so the MTP layer learns at every position too
    return cfg


def test_mtp_loss_equals_a_naive_reference():
    """The depth-1 logits and loss against the module docstring's formula written out in plain torch."""
    cfg = ModelConfig(num_layers=2, mtp_layers=1, vocab_size=50)
    model = build_model(cfg, seed=3).eval()
    x = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.forward_train(x, mtp_tokens=x)
        trunk = build_model(cfg, seed=3).eval()  # the same weights without a head: the hidden state before the norm
        trunk.head = None
        main = trunk.forward_train(x)
    mtp = model.mtp["2"]
    shifted = torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)
    with torch.no_grad():
        h0 = model.norm(main)
        inp = mtp.eh_proj(torch.cat([mtp.enorm(mtp.embed(shifted)), mtp.hnorm(h0)], dim=-1))
        block = build_model(ModelConfig(num_layers=1, vocab_size=50), seed=0).eval()
        block.embed, block.norm, block.head = None, None, None
        own = ("embed", "enorm", "hnorm", "eh_proj", "head_norm")
        block.layers["0"].load_state_dict({k: v for k, v in mtp.state_dict().items() if k.split(".")[0] not in own})
        want = model.head(mtp.head_norm(block.forward_train(inp))).float()
    assert out.shape == (2, 2, 12, 50)
    assert torch.allclose(out[:, 1], want, atol=1e-5, rtol=1e-5)
    # the loss: LM + w x CE(depth 1 at i, t[i + 2]); the last position has no target
    lm = torch.cat([x[:, 1:], torch.full_like(x[:, :1], IGNORE)], dim=1)
    target = torch.stack([lm, torch.full_like(lm, IGNORE), torch.full_like(lm, -1)], dim=1)
    loss_fn = LMLoss(0, mtp_weight=0.3)
    got = loss_fn(out, target)
    main_ce = F.cross_entropy(out[:, 0, :-1].reshape(-1, 50), x[:, 1:].reshape(-1))
    mtp_ce = F.cross_entropy(out[:, 1, :-2].reshape(-1, 50), x[:, 2:].reshape(-1))
    assert torch.allclose(got, main_ce + 0.3 * mtp_ce, atol=1e-6)
    assert torch.allclose(loss_fn.mtp_losses[0], mtp_ce, atol=1e-6)


def test_mtp_through_the_chunked_head_equals_the_logits_path():
    """head_in_loss: the last stage hands LMLoss [B, 1 + D, T, dim] (the main hidden state after the final norm,
    each MTP depth's head-normed output) and every depth's cross-entropy runs through the shared head in chunks with
    no further norm: loss, LM and MTP parts and every gradient equal the [B, 1 + D, T, vocab] logits path in fp32,
    and no [.., vocab] tensor is saved for the backward. Non-unit norm weights, so a norm applied twice or missed
    would show."""
    cfg = ModelConfig(num_layers=2, mtp_layers=2, dim=32, inter_dim=64, index_topk=8, vocab_size=61)
    model = build_model(cfg, "FS", seed=5)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    x = torch.randint(0, 61, (2, 20), generator=g)
    lm = torch.cat([x[:, 1:], torch.full_like(x[:, :1], IGNORE)], dim=1)
    lm[0, :3] = IGNORE
    target = torch.stack([lm, torch.full_like(lm, IGNORE), torch.full_like(lm, -1)], dim=1)
    results = []
    for head_in_loss in (False, True):
        model.zero_grad()
        model.head_in_loss = head_in_loss
        loss_fn = LMLoss(0, model if head_in_loss else None, chunk_tokens=7, mtp_weight=0.3)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            out = model.forward_train(x, mtp_tokens=x, compute_indexer_loss=False)
            loss = loss_fn(out, target)
        assert out.shape == (2, 3, 20, cfg.dim if head_in_loss else cfg.vocab_size)
        if head_in_loss:
            assert all(len(shape) == 0 or shape[-1] != cfg.vocab_size for shape in saved), saved
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.item(), loss_fn.lm_losses[0].item(), loss_fn.mtp_losses[0].item(), grads))
    (*ref, ref_grads), (*got, grads) = results
    # fp32: log-sum-exps over 61 logits summed over 40 rows per depth in a chunked order, a few ulps each
    for r, v in zip(ref, got):
        assert abs(v - r) <= 1e-5 * abs(r), (ref, got)
    assert grads.keys() == ref_grads.keys() and any(n.startswith("mtp.") for n in grads)
    for n, r in ref_grads.items():
        assert (grads[n] - r).norm() <= 1e-5 * r.norm().clamp_min(1e-12), n


def dp2_cfg():
    """PP=1 x dp 2 with the PP=1 run's global batch (8) and microbatch size (2): each replica runs 2 of them."""
    cfg = mtp_cfg()
    cfg.parallel.dp, cfg.pipeline.microbatches = 2, 2
    return cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    ref = run_configs(1, [mtp_cfg(), mtp_cfg(recompute="block")], root / "pp1")
    got = run_configs(2, [*(mtp_cfg(*lay) for lay in LAYOUTS), dp2_cfg()], root / "pp2")
    return ref, dict(zip([*LAYOUTS, "dp2"], got))


def test_dp2_reduces_mtp_loss_and_eval_mtp_loss_over_replicas(runs):
    """Every microbatch has the same count of MTP targets (loss_on=all), so the mean over replicas of each one's
    microbatch means is the PP=1 run's mean: per step `loss` and `mtp_loss`, and the final evaluation's `eval_loss`
    and `eval_mtp_loss` (each replica evaluates half of the held-out rows)."""
    (ref, _), got = runs
    run = got["dp2"]
    for r, g in zip(ref["history"], run["history"], strict=True):
        for key in ("loss", "mtp_loss", "eval_loss", "eval_mtp_loss"):
            assert (key in r) == (key in g), key
            if key in r:
                assert abs(r[key] - g[key]) <= 1e-5 * abs(r[key]), (key, r[key], g[key])
    assert "eval_mtp_loss" in ref["history"][-1]


def test_pp2_with_mtp_matches_pp1_under_every_tested_schedule(runs):
    (ref, ref_block), got = runs
    assert all("mtp_loss" in h for h in ref["history"])
    assert ref["history"][-1]["mtp_loss"] < ref["history"][0]["mtp_loss"]  # it learns
    for layout in LAYOUTS:
        run = got[layout]
        base = ref_block if layout[3] == "block" else ref
        for r, g in zip(base["history"], run["history"], strict=True):
            for key in ("loss", "mtp_loss"):
                assert abs(r[key] - g[key]) <= 1e-5 * abs(r[key]), (layout, key, r[key], g[key])
        r, g = base["grads"][1], run["grads"][1]
        assert g.keys() == r.keys()
        mtp = [k for k in r if k.startswith("mtp.")]
        assert any(".attn.indexer." in k for k in mtp) and any(k.endswith("eh_proj.weight") for k in mtp)
        for k in r:
            assert r[k].abs().sum() > 0 or "indexer" in k, k
            err = (g[k] - r[k]).norm() / r[k].norm().clamp_min(1e-12)
            # indexer KL gradients are differences of near-equal terms, summed in a split-dependent order
            assert err < (1e-4 if ".attn.indexer." in k else 1e-5), (layout, k, float(err))
    # block recompute computes the same step
    for a, b in zip(ref["history"], ref_block["history"]):
        assert abs(a["mtp_loss"] - b["mtp_loss"]) <= 1e-5 * a["mtp_loss"]


def test_the_plan_counts_the_mtp_layer_on_the_last_stage():
    """Parameters per stage in the plan equal the built stages' (MoE block, indexer, embedding copy, eh_proj, norms)."""
    from dsaflow.config.compose import compose
    from dsaflow.pipeline.stages import build_stages
    from dsaflow.plan import build_plan

    cfg = compose(["model=tiny_moe", "model.mtp_layers=1", "pipeline=pp2", "track=none"])
    plan = build_plan(cfg)
    stages = build_stages(cfg.model, plan)
    for st, module in zip(plan.estimates["stages"], stages):
        assert st["params"] == sum(p.numel() for p in module.parameters()), st["index"]
    last = plan.estimates["stages"][-1]
    assert last["mtp_layers"] == 1 and last["mtp_params"] == sum(p.numel() for p in stages[-1].mtp.parameters())
    assert plan.estimates["stages"][0]["mtp_layers"] == 0
