"""Serving a trained MoE model on CPU: greedy tokens are identical across pipeline=single / pp2 / pp4 and across
serve.microbatches=1 / the default (routed experts and the shared expert in every prefill and decode pass)."""

import pytest
from test_serve_pipelined import MODEL, PIPELINES, SERVE, shared_checkpoint, workload

from dsaflow.config.compose import compose
from dsaflow.model import moe_layers
from dsaflow.plan import build_plan
from dsaflow.serve.generate import build_engine

MOE_MODEL = ["model=tiny_moe", *MODEL]


@pytest.fixture(scope="module")
def trained_moe(tmp_path_factory):
    return shared_checkpoint(tmp_path_factory, "model=tiny_moe")


def moe_engine(run, pipeline, microbatches=None):
    mb = [] if microbatches is None else [f"serve.microbatches={microbatches}"]
    cfg = compose(["mode=serve", f"pipeline={pipeline}", *MOE_MODEL, *SERVE, f"serve.checkpoint={run}", *mb])
    eng = build_engine(cfg, build_plan(cfg), 0, "cpu", all_stages=True)
    eng.capture()
    return eng


@pytest.mark.slow
def test_moe_greedy_tokens_identical_across_pipelines_and_groups(trained_moe):
    prompts, limits = workload()
    ref_eng = moe_engine(trained_moe, "single", 1)
    assert sum(len(moe_layers(m)) for m in ref_eng.stages.values()) == 7  # layer 0 dense, 1-7 MoE
    ref = ref_eng.generate(prompts, limits)
    assert [len(o) for o in ref] == limits
    assert len({tuple(o) for o in ref}) > 32  # the trained model does not say one thing to everyone
    for pipeline in PIPELINES:
        for mb in (1, None):
            eng = moe_engine(trained_moe, pipeline, mb)
            if eng.groups == 1 and pipeline == "single":  # the configuration `ref` was served with
                continue
            assert eng.generate(prompts, limits) == ref, (pipeline, mb)
