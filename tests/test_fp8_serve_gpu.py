"""FP8 weights on the GPU: a trained tiny_moe served with serve.weights=fp8 under CUDA graphs (every decode pass
under set_sync_debug_mode("error"): nothing syncs the host) against the same weights in bf16, and a converted MoE
layer replayed from a CUDA graph bit-equal to eager. Run on a GPU machine:

    .venv/bin/python -m pytest -q -m gpu tests/test_fp8_serve_gpu.py -s
"""

import pytest
import torch
from test_fp8_serve import passage, passage_prompts
from test_moe_gpu import assert_replays_bit_equal_and_sync_nothing, small_moe_layer
from test_moe_serve import MOE_MODEL
from test_serve_pipelined import train_checkpoint
from test_serve_pipelined_gpu import SERVE as GPU_SERVE

from dsaflow.config.compose import compose
from dsaflow.model.fp8_weights import FP8, quantize_stage_
from dsaflow.plan import build_plan
from dsaflow.serve.generate import build_engine

pytestmark = pytest.mark.gpu


def train_on_passage(root):
    """tiny_moe trained (150 steps, as the other serving tests train) on one passage repeated, which it learns by
    heart (loss about 0.08): it continues the passage with clear margins between its top two logits, as a trained
    language model does on most tokens, so FP8 rounding meets few near-ties -> the run dir."""
    (root / "passage.txt").write_bytes(passage() * 80)
    return train_checkpoint(root / "run", "model=tiny_moe", f"data.path={root / 'passage.txt'}")


@pytest.fixture(scope="module")
def trained_moe_gpu(tmp_path_factory):
    return train_on_passage(tmp_path_factory.mktemp("trained_moe_fp8_gpu"))


def fp8_engine(run, weights):
    cfg = compose(["mode=serve", "pipeline=single", *MOE_MODEL, *GPU_SERVE, f"serve.checkpoint={run}"])
    cfg.serve.weights = weights
    cfg.graphs.blocks[0].shape_classes = [1, 2, 4, 8]
    cfg.graphs.blocks[1].shape_classes = [8, 16]
    eng = build_engine(cfg, build_plan(cfg), 0, "cuda:0", all_stages=True)
    report = eng.capture()
    assert report.records and all(r.status == "captured" for r in report.records)
    eng.strict_sync = True  # every decode pass under set_sync_debug_mode("error")
    return eng


def test_fp8_greedy_tokens_with_graphs_match_bf16(trained_moe_gpu):
    prompts = passage_prompts()
    limits = [8] * len(prompts)
    eng = fp8_engine(trained_moe_gpu, "fp8")
    assert eng.stages[0].layers["1"].mlp.experts.gate_up_proj.dtype == FP8
    fp8 = eng.generate(prompts, limits)
    bf16 = fp8_engine(trained_moe_gpu, "bf16").generate(prompts, limits)
    same = sum(a == b for a, b in zip(fp8, bf16))
    print(f"FP8 vs bf16 weights, graphs on: {same} of 32 prompts' greedy tokens equal")
    # the model learned its passage: served on CPU with FP8 weights, all 32 agree with top-2 margins of 3+ logits
    assert same >= 30, same


def test_a_converted_moe_layer_replays_from_a_graph_bit_equal_and_syncs_nothing():
    class Holder(torch.nn.Module):  # quantize_stage_ converts layer by layer under `layers`
        def __init__(self, mlp):
            super().__init__()
            self.layers = torch.nn.ModuleDict({"1": torch.nn.ModuleDict({"mlp": mlp})})

    holder = quantize_stage_(Holder(small_moe_layer()), "cuda", torch.bfloat16)
    layer = holder.layers["1"]["mlp"]
    assert layer.experts.gate_up_proj.dtype == FP8 and layer.shared_experts.w1.weight.dtype == FP8
    assert_replays_bit_equal_and_sync_nothing(layer)
