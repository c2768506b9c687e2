"""Cross-stage indices in the model: stages that open on S read the indices the previous stage hands over, and the
chained stages compute exactly what one stage does (training forward and backward, and serving with caches)."""

import pytest
import torch
from model_helpers import planned_sharp, tokens

from dsaflow.pipeline.stages import build_stages, stage_cache

# 0F 1S | 2S 3S 4F | 5S | 6S 7S: stage 1 opens on S (reads layer 0), stage 2 has no F (passes layer 4's indices on),
# stage 3 opens on S (reads layer 4 across two boundaries)
SPLIT, WHOLE = "FS|SSF|S|SS", "FSSSFSSS"
CROSS = "pipeline.cross_stage_indices=true"


def chained(stages, x, pos=None, caches=None, attn="sparse"):
    """The stages in order, each handing its indices on: `forward_with_indices`, or with caches a serving pass."""
    indices = None
    for i, s in enumerate(stages):
        received = indices if s.incoming_source is not None else None
        if caches is None:
            x, indices = s.forward_with_indices(x, received, attn=attn)
        else:
            run = s.forward_decode if x.shape[1] == 1 else s.forward_prefill
            x = run(x, pos, caches[i], indices_in=received, attn=attn)
            indices = s.take_indices(x)
    return x


def test_plan_and_stages_read_across():
    model, plan = planned_sharp(SPLIT, CROSS, "model.index_topk=4")
    assert plan.index_boundaries == (0, 1, 2)
    stages = build_stages(model, plan, seed=1)
    assert [s.incoming_source for s in stages] == [None, 0, 4, 4]
    with_indexer = {n.split(".")[1] for s in stages for n, _ in s.named_parameters() if ".indexer." in n}
    assert with_indexer == {"0", "4"}  # S layers carry no indexer weights
    with pytest.raises(ValueError, match="pass them as indices_in"):
        stages[1](torch.zeros(1, 4, model.dim))


@pytest.mark.parametrize("attn", ["sparse", "dense"])
def test_chained_stages_match_one_stage_forward_and_backward(attn):
    model, plan = planned_sharp(SPLIT, CROSS, "model.index_topk=4")
    whole_model, whole = planned_sharp(WHOLE, "model.index_topk=4")
    stages, ref = build_stages(model, plan, seed=1), build_stages(whole_model, whole, seed=1)[0]
    x = tokens(2, 12)
    got, want = chained(stages, x, attn=attn), ref(x, attn=attn)
    assert torch.equal(got, want)
    got.square().mean().backward()
    want.square().mean().backward()
    grads = {n: p.grad for s in stages for n, p in s.named_parameters()}
    for n, p in ref.named_parameters():
        if ".indexer." in n:  # top-k carries no gradient: the LM loss never reaches an indexer
            assert p.grad is None and grads[n] is None
        else:
            assert torch.allclose(grads[n], p.grad, rtol=1e-5, atol=1e-7), n


@torch.no_grad()
def test_serving_caches_copy_received_indices_and_match_one_stage():
    """Prefill in chunks, then decode: the received indices go through each stage's static index buffer."""
    model, plan = planned_sharp(SPLIT, CROSS, "model.index_topk=4")
    whole_model, whole = planned_sharp(WHOLE, "model.index_topk=4")
    stages, ref = build_stages(model, plan, seed=1), build_stages(whole_model, whole, seed=1)
    caches = [stage_cache(model, plan, i, 2, 16, 4) for i in range(plan.num_stages)]
    ref_caches = [stage_cache(whole_model, whole, 0, 2, 16, 4)]
    x = tokens(2, 11)
    for t0, t1 in [(0, 4), (4, 8), (8, 9), (9, 10), (10, 11)]:
        pos = torch.arange(t0, t1).expand(2, -1)
        got = chained(stages, x[:, t0:t1], pos, caches)
        run = ref[0].forward_decode if t1 - t0 == 1 else ref[0].forward_prefill
        want = run(x[:, t0:t1], pos, ref_caches[0])
        assert torch.equal(got, want), (t0, t1)
        # stages 2 and 3 (no F before their S layers) read layer 4's indices, copied into their own static buffers
        n = t1 - t0
        assert caches[1].index_writer == 4 and caches[2].index_writer == caches[3].index_writer == 4
        assert torch.equal(caches[2].index[:2, :n], caches[1].index[:2, :n])
        assert torch.equal(caches[3].index[:2, :n], caches[1].index[:2, :n])
        assert caches[3].index.data_ptr() != caches[1].index.data_ptr()


@torch.no_grad()
def test_training_sends_only_the_columns_a_sequence_can_fill():
    """T < topk: the cut columns are all -1, the receiver pads them back, and the bytes match the plan's payload."""
    from dsaflow.plan.estimates import index_payload_bytes
    from dsaflow.train.pipeline import TrainStage

    model, plan = planned_sharp(SPLIT, CROSS, "model.index_topk=16")
    stages = build_stages(model, plan, seed=1)
    x = tokens(2, 12)
    full_out, full = stages[0].forward_with_indices(x)
    first, second = TrainStage(stages[0], sends_indices=True), TrainStage(stages[1], sends_indices=True)
    out, sent = first(x)
    assert sent.shape == (2, 12, 12) and torch.equal(sent, full[..., :12]) and (full[..., 12:] == -1).all()
    assert sent.nbytes == index_payload_bytes(model, 24, 12)
    second.live = True  # a real microbatch: the received ids are used as they are
    h, _ = second(out, sent)
    want, _ = stages[1].forward_with_indices(full_out, full)
    assert torch.equal(h, want)
