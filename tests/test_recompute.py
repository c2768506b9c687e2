"""train.recompute=attention|block: the same gradients and indexer loss as none, fewer saved activations, each
attention recorded once, and no side effect of a layer repeated by its recomputation."""

import pytest
import torch
from model_helpers import SHARP_INIT, planned, tokens

import dsaflow.model.mla as mla_module
from dsaflow.config.compose import compose
from dsaflow.launch.resources import rank_memory
from dsaflow.pipeline.stages import stage_module
from dsaflow.plan import build_plan
from dsaflow.plan.estimates import attention_recompute_elems_per_token

B, T = 2, 24


def _step(recompute, monkeypatch, attn="sparse", chunk_tokens=1 << 14):
    """One forward + backward of the LM loss and the indexer loss on FSSF... (topk < T, so the indexer selects).
    recompute: True = "attention", False = "none", or the mode's name.
    Returns (grads by name, indexer loss, saved-tensor bytes, sparse_mla calls in forward, in all, cfg)."""
    cfg, plan = planned("(FSSS)*2", SHARP_INIT, "model.index_topk=8")
    stage = stage_module(cfg, plan, 0, seed=0).train()
    stage.recompute = {True: "attention", False: "none"}.get(recompute, recompute)
    stage.recompute_chunk_tokens = chunk_tokens
    calls = []
    real = mla_module.sparse_mla
    monkeypatch.setattr(mla_module, "sparse_mla", lambda *a: calls.append(1) or real(*a))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = stage(tokens(B, T), attn=attn, compute_indexer_loss=True)
        loss = logits.logsumexp(-1).mean() + stage.indexer_loss
    forward_calls = len(calls)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
    return grads, float(stage.indexer_loss.detach()), sum(saved), forward_calls, len(calls), cfg


@pytest.mark.parametrize("chunk_tokens", [1 << 14, 10])  # one chunk; 2 sequences x 5 queries per chunk (5 chunks)
def test_recompute_gives_the_same_gradients_and_saves_the_attention_intermediates(monkeypatch, chunk_tokens):
    ref, ref_loss, ref_saved, ref_fwd, ref_total, cfg = _step(False, monkeypatch)
    got, got_loss, got_saved, fwd, total, _ = _step(True, monkeypatch, chunk_tokens=chunk_tokens)
    chunks = -(-T // max(1, chunk_tokens // B))
    assert ref.keys() == got.keys() and any(".attn.indexer." in n for n in got)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    assert got_loss == pytest.approx(ref_loss, rel=1e-6)  # the recorder saw each attention once
    layers = cfg.num_layers
    assert ref_fwd == layers and ref_total == layers  # no recomputation without the option
    assert fwd == chunks * layers and total == 2 * fwd  # with it, every chunk's attention runs again in backward
    # q_abs, o_lat and the up-projected output are no longer saved (fp32 here: 4 bytes each)
    dropped = attention_recompute_elems_per_token(cfg) * B * T * 4 * layers
    assert ref_saved - got_saved >= 0.9 * dropped


@pytest.mark.parametrize("chunk_tokens", [1 << 14, 10])
def test_block_recompute_gives_the_same_gradients_and_keeps_only_the_block_inputs(monkeypatch, chunk_tokens):
    """Each block runs again in backward (every sparse_mla twice; three times when the attention is also chunked)
    and nothing of a block but its input is kept. Bit-identical in fp32 without query chunks."""
    ref, ref_loss, ref_saved, _, _, cfg = _step("none", monkeypatch)
    got, got_loss, got_saved, fwd, total, _ = _step("block", monkeypatch, chunk_tokens=chunk_tokens)
    layers, chunks = cfg.num_layers, -(-T // max(1, chunk_tokens // B))
    tol = 0 if chunks == 1 else 1e-5  # query chunks sum the weight gradients in another order
    assert ref.keys() == got.keys() and any(".attn.indexer." in n for n in got)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=tol, atol=tol / 10, msg=name)
    assert got_loss == pytest.approx(ref_loss, rel=tol / 10)
    if chunks == 1:
        assert fwd == layers and total == 2 * layers  # forward, then the block's recomputation
    else:
        assert fwd == chunks * layers and total == 3 * fwd  # and each chunk once more inside it
    # left: the head's and the forward-timed indexer KL's saved tensors (the block inputs live in the checkpoints)
    assert got_saved < ref_saved / 10


def test_block_recompute_in_dense_mode_gives_the_same_gradients(monkeypatch):
    """Dense attention with gradient everywhere (not the warm-up, whose main weights are frozen): the recorder sees
    each layer once, the recomputation runs the indexer again without recording it."""
    ref, ref_loss, *_ = _step("none", monkeypatch, attn="dense")
    got, got_loss, *_ = _step("block", monkeypatch, attn="dense")
    assert ref.keys() == got.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0, msg=name)
    assert got_loss == ref_loss


def test_block_recompute_keeps_each_microbatch_indices_apart():
    """Two forwards before either backward (a pipeline schedule's microbatches): the second overwrites the stage's
    index slot, and the first one's recomputation must still attend to its own indices."""
    cfg, plan = planned("(FSSS)*2", SHARP_INIT, "model.index_topk=8")
    grads = {}
    for mode in ("none", "block"):
        stage = stage_module(cfg, plan, 0, seed=0).train()
        stage.recompute = mode
        outs = [stage(tokens(B, T, seed=s)) for s in (1, 2)]
        (outs[0].logsumexp(-1).mean() + 2 * outs[1].logsumexp(-1).mean()).backward()
        grads[mode] = {n: p.grad for n, p in stage.named_parameters() if p.grad is not None}
    for name in grads["none"]:
        torch.testing.assert_close(grads["block"][name], grads["none"][name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("mode", ["attention", "block"])
def test_recompute_is_off_in_eval_and_with_a_cache(mode):
    """No grad (eval, serving): the option changes nothing and recomputes nothing."""
    cfg, plan = planned("(FSSS)*2", "model.index_topk=8")
    stage = stage_module(cfg, plan, 0, seed=0).eval()
    x = tokens(1, T)
    with torch.no_grad():
        ref = stage(x)
        stage.recompute = mode
        torch.testing.assert_close(stage(x), ref, rtol=0, atol=0)


def test_the_memory_estimate_drops_the_recomputed_activations():
    base = [
        "model=dsv32",
        "model.vocab_size=256",
        "model.inter_dim=2048",
        "model.moe=null",
        "model.num_layers=2",
        "index=all_full",
        "train.seq_len=131072",
        "train.batch_size=1",
        "pipeline.microbatches=1",
        "model.max_seq_len=131072",
    ]
    plain, rec = (compose(base + [f"train.recompute={r}"]) for r in ("none", "attention"))
    mem = {r: rank_memory(c, build_plan(c), 0, "cuda", "train") for r, c in (("none", plain), ("attention", rec))}
    per_layer = (attention_recompute_elems_per_token(plain.model) * 2 + plain.model.n_heads * 4) * 131072  # + lse
    drop = mem["none"]["activations"] - mem["attention"]["activations"]
    assert drop == 2 * per_layer  # two layers, nothing kept of their attention intermediates
    assert sum(mem["attention"].values()) < 130 * 2**30 < sum(mem["none"].values())  # an H200 fits only one


@pytest.mark.parametrize("mode", ["attention", "block"])
def test_no_absorbed_query_or_attention_output_spans_more_than_one_chunk(monkeypatch, mode):
    """Every [b, t, H, C + R] absorbed query and [b, t, H, C] attention output built, in the forward and in the
    backward's recomputations, covers at most one chunk of queries (b * t <= chunk)."""
    chunk = 10  # tokens; B = 2, T = 24: chunks of 5 queries per sequence
    sizes = []
    real_absorb, real_attn = mla_module.absorb_query, mla_module.sparse_mla

    def absorb(q, *a):
        out = real_absorb(q, *a)
        sizes.append(out.shape[0] * out.shape[1])
        return out

    def attn(q, *a, **k):
        out, lse = real_attn(q, *a, **k)
        sizes.append(out.shape[0] * out.shape[1])
        return out, lse

    monkeypatch.setattr(mla_module, "absorb_query", absorb)
    monkeypatch.setattr(mla_module, "sparse_mla", attn)
    cfg, plan = planned("(FSSS)*2", SHARP_INIT, "model.index_topk=8")
    stage = stage_module(cfg, plan, 0, seed=0).train()
    stage.recompute, stage.recompute_chunk_tokens = mode, chunk
    stage(tokens(B, T)).logsumexp(-1).mean().backward()
    assert sizes and max(sizes) <= chunk
    assert len(sizes) == 2 * cfg.num_layers * -(-T // (chunk // B)) * (2 if mode == "attention" else 3)
