"""The reference generate (dsaflow/serve/reference.py) gives the engine's tokens, token for token: greedy, sampled and
with an EOS id, for a batch of prompts of mixed lengths and limits, on one stage and on two stages whose second opens
on S layers that read the first stage's indices."""

import random

import pytest
import torch

from dsaflow.config.compose import compose
from dsaflow.plan import build_plan
from dsaflow.serve import reference
from dsaflow.serve.generate import build_engine

# F layers 0, 3, 6: pp2 cuts after layer 3, so stage 1 opens on S layers that read layer 3's indices
MODEL = ["model.num_layers=8", "index.pattern=FSS", "model.index_topk=8", "track=none"]
# 12 requests over 8 rows in prefill chunks of 16 tokens: the engine refills rows and mixes prefill with decode
SERVE = ["serve.max_batch=8", "serve.max_context=96", "serve.prefill_chunk=16"]
PIPELINES = {"single": [], "pp2": ["pipeline=pp2", "pipeline.cross_stage_indices=true"]}


def workload(n=12, seed=0):
    """n random prompts of 1 to 40 tokens, each with its own limit of 1 to 20 new tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.choice([1, 2, 5, 9, 16, 17, 31, 40]))] for _ in range(n)]
    return prompts, [rng.randint(1, 20) for _ in prompts]


def engine_tokens(pipeline: str, prompts, limits, *serve):
    """-> (the engine's tokens, its stage modules) for the seeded random init, every stage in this process."""
    cfg = compose(["mode=serve", *MODEL, *SERVE, *PIPELINES[pipeline], *serve])
    eng = build_engine(cfg, build_plan(cfg), 0, "cpu", all_stages=True)
    eng.capture()
    return eng.generate(prompts, limits), eng.stages


def reference_tokens(stages, prompts, limits, **sampling):
    caches = reference.allocate_caches(stages, len(prompts), 96, max(len(p) for p in prompts))
    return reference.generate(stages, caches, prompts, limits, **sampling)


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_greedy_tokens_equal_the_engines(pipeline):
    prompts, limits = workload()
    want, stages = engine_tokens(pipeline, prompts, limits)
    assert (pipeline == "pp2") == any(s.incoming_source is not None for s in stages.values())
    got = reference_tokens(stages, prompts, limits)
    assert got == want
    assert [len(o) for o in got] == limits
    # random weights, yet the greedy tokens vary from request to request and from step to step
    assert len({t for o in got for t in o}) > 40 and len({tuple(o) for o in got}) == len(prompts)
    # the first token is the argmax of a forward over the whole prompt without any cache
    with torch.no_grad():
        for p, o in zip(prompts, got):
            h, indices = torch.tensor([p]), None
            for stage in stages.values():
                h, indices = stage.forward_with_indices(h, indices if stage.incoming_source is not None else None)
            assert int(h[0, -1].argmax()) == o[0]


def test_sampled_tokens_and_eos_equal_the_engines():
    """Sampling draws from (request, token index) keys, so the engine's groups and refills change nothing; with an EOS
    id a request stops right after emitting it."""
    prompts, limits = workload(seed=1)
    sampling = {"temperature": 0.8, "top_p": 0.9, "seed": 3}
    want, stages = engine_tokens("single", prompts, limits, *[f"serve.{k}={v}" for k, v in sampling.items()])
    assert reference_tokens(stages, prompts, limits, **sampling) == want
    greedy = reference_tokens(stages, prompts, limits)
    assert want != greedy
    eos = max(range(256), key=lambda t: sum(t in o[:-1] for o in greedy))  # a token that ends several requests early
    cut = [o[: o.index(eos) + 1] if eos in o else o for o in greedy]
    assert sum(len(c) < len(o) for c, o in zip(cut, greedy)) >= 2
    want, _ = engine_tokens("single", prompts, limits, f"serve.eos_id={eos}")
    assert reference_tokens(stages, prompts, limits, eos_id=eos) == want == cut
