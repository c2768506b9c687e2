"""MoE on the GPU: each grouped-GEMM kernel against the per-expert fp32 loop (forward and every gradient) with the
allocator's free memory poisoned with NaN first, a CUDA graph replay of a MoE layer bit-equal to eager with no host
sync, and greedy tokens of a trained tiny_moe identical across pipelines and groups with graphs on. Run on a GPU
machine:

    .venv/bin/python -m pytest -q -m gpu tests/test_moe_gpu.py
"""

import pytest
import torch
from test_moe_serve import MOE_MODEL
from test_serve_pipelined import PIPELINES, train_checkpoint, workload
from test_serve_pipelined_gpu import SERVE as GPU_SERVE

from dsaflow.config.compose import compose
from dsaflow.config.moe_schema import MoEConfig
from dsaflow.model.moe import MoE
from dsaflow.ops.moe import explain_grouped_mm, moe_experts, moe_experts_naive
from dsaflow.plan import build_plan
from dsaflow.serve.generate import build_engine

pytestmark = pytest.mark.gpu


def poison_free_memory():
    """Fill a large block with NaN and free it: the caching allocator hands it to the next allocations, so a kernel
    output any row of which is never written shows NaN."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    block = torch.full((64 << 20,), float("nan"), device="cuda")
    del block


def _inputs(dtype, N=301, D=256, I=128, E=16, k=4, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, D, device="cuda", generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(N)])
    ids[ids == 5] = 6  # expert 5 gets no row
    weights = torch.rand(N, k, device="cuda", generator=g)
    gate_up = (torch.randn(E, 2 * I, D, device="cuda", generator=g) * 0.05).to(dtype)
    down = (torch.randn(E, D, I, device="cuda", generator=g) * 0.05).to(dtype)
    return [t.requires_grad_(t.is_floating_point()) for t in (x, ids, weights, gate_up, down)]


@pytest.mark.parametrize(
    "dtype, kernel, tol",
    [
        (torch.float32, "triton", 1e-5),  # full fp32 products (no TF32)
        (torch.bfloat16, "triton", 2e-2),  # bf16 inputs and outputs, fp32 accumulation
        (torch.bfloat16, "torch_grouped", 2e-2),
    ],
)
def test_each_kernel_matches_the_per_expert_loop(monkeypatch, dtype, kernel, tol):
    monkeypatch.setenv("DSAFLOW_MOE_GEMM", kernel)
    inputs = _inputs(dtype)
    assert explain_grouped_mm(inputs[0], inputs[3]).kernel == kernel
    poison_free_memory()
    out = moe_experts(*inputs)
    ref = moe_experts_naive(*inputs)
    assert not out.isnan().any()
    err = (out.float() - ref).norm() / ref.norm()
    assert err < tol, f"forward: relative error {err:.2e}"
    grad = torch.randn_like(ref)
    diff = [t for t in inputs if t.requires_grad]
    poison_free_memory()
    got = torch.autograd.grad(out.float(), diff, grad)
    want = torch.autograd.grad(ref, diff, grad)
    for name, a, b in zip(["x", "weights", "gate_up", "down"], got, want):
        assert not a.isnan().any(), name
        e = (a.float() - b.float()).norm() / b.float().norm()
        assert e < tol, f"gradient of {name}: relative error {e:.2e}"


def small_moe_layer() -> MoE:
    """A 256-wide MoE layer (16 experts, 4 per token, grouped routing), weights ~ N(0, 0.05), on the CPU in fp32."""
    layer = MoE(256, MoEConfig(n_routed_experts=16, num_experts_per_tok=4, moe_inter_dim=128, n_group=4, topk_group=2))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return layer


def assert_replays_bit_equal_and_sync_nothing(layer, shape=(8, 1, 256)) -> None:
    """Warm `layer` up on a side stream with host syncs made errors, capture it in a CUDA graph, then replay it on
    three fresh bf16 inputs of `shape`: each replay must equal an eager call bit for bit."""
    static_x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(2):
                layer(static_x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_out = layer(static_x)
    for seed in range(3):
        g = torch.Generator("cuda").manual_seed(seed)
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
        static_x.copy_(x)
        graph.replay()
        with torch.no_grad():
            assert torch.equal(static_out, layer(x)), seed


def test_a_moe_layer_replays_from_a_cuda_graph_bit_equal_and_syncs_nothing():
    assert_replays_bit_equal_and_sync_nothing(small_moe_layer().cuda().to(torch.bfloat16))


@pytest.fixture(scope="module")
def trained_moe_gpu(tmp_path_factory):
    return train_checkpoint(tmp_path_factory.mktemp("trained_moe_gpu") / "run", "model=tiny_moe")


def moe_gpu_engine(run, pipeline, microbatches):
    mb = [] if microbatches is None else [f"serve.microbatches={microbatches}"]
    cfg = compose(
        ["mode=serve", f"pipeline={pipeline}", *MOE_MODEL, *GPU_SERVE, f"serve.checkpoint={run}", *mb]
        + ["serve.batching=fixed"]
    )
    groups = microbatches or {"single": 1, "pp2": 2, "pp4": 4}[pipeline]
    cfg.graphs.blocks[0].shape_classes = [c for c in (1, 2, 4, 8) if c <= 8 // groups]
    cfg.graphs.blocks[1].shape_classes = [8, 16]
    eng = build_engine(cfg, build_plan(cfg), 0, "cuda:0", all_stages=True)
    report = eng.capture()
    assert report.records and all(r.status == "captured" for r in report.records)
    eng.strict_sync = True  # every decode pass under set_sync_debug_mode("error")
    return eng


def test_moe_greedy_tokens_identical_across_pipelines_and_groups_with_graphs(trained_moe_gpu):
    prompts, limits = workload()
    ref = moe_gpu_engine(trained_moe_gpu, "single", 1).generate(prompts, limits)
    assert [len(o) for o in ref] == limits and len({tuple(o) for o in ref}) > 32
    for pipeline in PIPELINES:
        for mb in (1, None):
            eng = moe_gpu_engine(trained_moe_gpu, pipeline, mb)
            captures = eng.graphs.captures
            assert eng.generate(prompts, limits) == ref, (pipeline, mb)
            assert eng.graphs.captures == captures  # replays only
