"""Indexer top-k kernels vs the naive reference: the radix select (`triton_select`) and the whole op.

Without CUDA these run in the Triton CPU interpreter (conftest.py) at tiny sizes. Scores are built with many exact
ties (quantized values, whole rows of one value, values that agree in 1, 2 or 3 of the 4 radix bytes), -inf rows,
padding rows (position < 0), topk > visible keys and topk > S; the selected indices must equal
`naive.topk_from_scores` exactly (order included). Outputs are poisoned before the kernel writes them. Whole-op tests
use small integer q, k, w so every score is exact in fp32 and the op must equal `indexer_topk_naive` bit for bit.
`gpu` tests: DeepSeek-V3.2 shapes (64 heads x 128, topk 2048, bf16), 256K rows, more than 65,535 batch rows, and
CUDA-graph replay == eager.
"""

from __future__ import annotations

import pytest
import torch
from ops_helpers import FakeCuda

from dsaflow.ops.indexer_topk import indexer_topk_naive, topk_from_scores
from dsaflow.ops.indexer_topk.dispatch import explain_indexer_topk
from dsaflow.ops.indexer_topk.triton_indexer import indexer_logits_triton, indexer_topk_triton, query_chunk
from dsaflow.ops.indexer_topk.triton_select import radix_topk_triton, select_config

DEV = "cuda" if torch.cuda.is_available() else "cpu"
POISON = -12345


def masked(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    s = torch.arange(scores.shape[-1], device=scores.device)
    return scores.masked_fill(s.view(1, 1, -1) > positions.unsqueeze(-1), float("-inf"))


def tie_scores(B: int, T: int, S: int, g: torch.Generator) -> torch.Tensor:
    """Rows cycling through tie patterns that stop the radix select at each of its four bytes."""
    rows = []
    for r in range(B * T):
        kind = r % 7
        if kind == 0:
            row = torch.randn(S, generator=g)  # distinct
        elif kind == 1:
            row = torch.zeros(S)  # one value everywhere (and -0.0 == +0.0)
            row[::3] = -0.0
        elif kind == 2:
            row = torch.randint(-2, 3, (S,), generator=g).float()  # 5 values
        elif kind == 3:  # 1 + j ulp: equal in the top three bytes, the last byte decides
            row = 1.0 + torch.randint(0, 6, (S,), generator=g).float() * 2.0**-23
        elif kind == 4:  # equal in the top two bytes
            row = 1.0 + torch.randint(0, 4, (S,), generator=g).float() * 2.0**-13
        elif kind == 5:
            row = torch.full((S,), float("-inf"))  # nothing selectable: all -1
            row[S // 2] = 3.0
        else:
            row = torch.randn(S, generator=g).round()  # wide range, heavy ties, negatives and +-0
        rows.append(row)
    return torch.stack(rows).view(B, T, S)


# sampled: "sort": small sample, one compaction program per row; "whole": no floor, every visible key is a candidate
# (the path a missed sample takes); "split": many compaction programs per row, each writing its own segment.
SELECT_CFGS = {
    "sort": dict(BLOCK=64, BLOCK_FINISH=64, SAMPLE=16, programs=4),
    "whole": dict(BLOCK=64, BLOCK_FINISH=32, SAMPLE=16, whole_row=True, programs=4),
    "split": dict(BLOCK=32, SAMPLE=32, programs=64),
}


# the whole-op tests below pass this on CPU: the interpreter's sort of a 4096 sample / cap takes minutes
CPU_SELECT = SELECT_CFGS["sort"] if DEV == "cpu" else None


@pytest.mark.parametrize("algo", list(SELECT_CFGS))
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("S,topk", [(300, 16), (70, 64), (40, 100)])
def test_radix_select_equals_naive(algo, seed, S, topk):
    g = torch.Generator().manual_seed(seed)
    B, T = 2, 7
    scores = tie_scores(B, T, S, g)
    positions = torch.randint(-3, S + 5, (B, T), generator=g)
    positions[0, 0], positions[1, 1], positions[1, 2] = -1, S - 1, 0
    out = torch.full((B, T, topk), POISON, dtype=torch.int32)
    got = radix_topk_triton(scores.to(DEV), positions.to(DEV), topk, out=out.to(DEV), overrides=SELECT_CFGS[algo])
    ref = topk_from_scores(masked(scores, positions), topk)
    assert (got.cpu() != POISON).all(), "every output slot must be written"
    assert torch.equal(got.cpu(), ref)


def test_sampled_floor_that_misses_falls_back_to_the_whole_row():
    """The sampled positions hold the only large scores: the sample's floor keeps fewer than topk candidates, so the
    kernel must redo the pass without a floor; the result stays exact."""
    S, topk, sample = 300, 20, 16
    g = torch.Generator().manual_seed(9)
    scores = torch.randn(1, 2, S, generator=g)
    sampled = torch.arange(sample) * S // sample
    scores[:, :, sampled] = 10.0 + torch.arange(sample).float()
    positions = torch.tensor([[S - 1, S - 1]])
    scores[0, 1, sampled[::2]] = 5.0  # ties inside the sample too
    got = radix_topk_triton(scores, positions, topk, overrides=dict(BLOCK=64, SAMPLE=sample))
    assert torch.equal(got, topk_from_scores(masked(scores, positions), topk))


@pytest.mark.parametrize("algo", ["sort", "split", "whole"])
def test_select_orders_distinct_and_equal_scores(algo):
    """Rows of distinct scores (one with a -inf survivor, which must come out as -1 last), equal scores only below
    the kk-th, equal scores among the survivors and at the kk-th: every row equals the reference, order included."""
    S, topk = 120, 24
    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(S, generator=g) for _ in range(5)]
    rows[1][7] = float("-inf")  # visible -inf: a survivor when topk >= visible keys
    rows[2][torch.randperm(S, generator=g)[:60]] = -5.0  # equal scores, all below the kk-th
    rows[3][torch.randperm(S, generator=g)[:10]] = 9.0  # equal scores among the survivors
    rows[4] = torch.randn(S, generator=g).round(decimals=1)  # many equal scores at the kk-th
    scores = torch.stack(rows).view(1, 5, S)
    positions = torch.tensor([[S - 1, 20, S - 1, 70, S - 1]])
    out = torch.full((1, 5, topk), POISON, dtype=torch.int32)
    got = radix_topk_triton(scores.to(DEV), positions.to(DEV), topk, out=out.to(DEV), overrides=SELECT_CFGS[algo])
    ref = topk_from_scores(masked(scores, positions), topk)
    assert ref[0, 1, 20] == -1 and (ref[0, 1, 21:] == -1).all()
    assert torch.equal(got.cpu(), ref)


@pytest.mark.parametrize("algo", list(SELECT_CFGS))
def test_radix_select_rows_longer_than_a_block_and_strided_inputs(algo):
    """Several blocks per row (BLOCK 32), a non-contiguous positions view and an output view inside a wider buffer."""
    g = torch.Generator().manual_seed(7)
    B, T, S, topk = 2, 5, 200, 24
    scores = tie_scores(B, T, S, g)
    pos_all = torch.randint(0, S, (B, 2 * T), generator=g)
    positions = pos_all[:, ::2]
    big = torch.full((B, T + 3, topk), POISON, dtype=torch.int32)
    radix_topk_triton(scores, positions, topk, out=big[:, 1 : T + 1], overrides={**SELECT_CFGS[algo], "BLOCK": 32})
    assert (big[:, 0] == POISON).all() and (big[:, T + 1 :] == POISON).all(), "writes outside the view"
    assert torch.equal(big[:, 1 : T + 1], topk_from_scores(masked(scores, positions), topk))


def int_inputs(B, T, H, D, S, g):
    """Small integers: every dot, relu and weighted sum is exact in fp32, so ties are exact and frequent."""
    q = torch.randint(-2, 3, (B, T, H, D), generator=g).float()
    k = torch.randint(-1, 2, (B, S, D), generator=g).float()
    k[:, ::4] = 0.0  # whole zero keys: exact 0 scores for every query
    w = torch.randint(-2, 3, (B, T, H), generator=g).float()
    return q, k, w


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("chunk", [None, 3])
def test_indexer_topk_op_equals_naive_exactly(seed, chunk):
    g = torch.Generator().manual_seed(seed)
    B, T, H, D, S, topk = 2, 6, 4, 16, 45, 12
    q, k, w = int_inputs(B, T, H, D, S, g)
    positions = torch.tensor([[-1, 0, 5, 11, 30, 44], [44, 44, 3, -7, 20, 12]])
    ref = indexer_topk_naive(q, k, w, positions, topk)
    got = indexer_topk_triton(
        q.to(DEV),
        k.to(DEV),
        w.to(DEV),
        positions.to(DEV),
        topk,
        chunk=chunk,
        select_overrides=CPU_SELECT,
    )
    assert torch.equal(got.cpu(), ref)
    radix = indexer_topk_triton(
        q.to(DEV),
        k.to(DEV),
        w.to(DEV),
        positions.to(DEV),
        topk,
        chunk=chunk,
        select_overrides=SELECT_CFGS["whole"],
    )
    assert torch.equal(radix.cpu(), ref)


def test_indexer_topk_op_wider_than_context():
    """topk > S: every visible key in order, then -1."""
    g = torch.Generator().manual_seed(3)
    q, k, w = int_inputs(1, 3, 2, 16, 5, g)
    positions = torch.tensor([[0, 2, 4]])
    ref = indexer_topk_naive(q, k, w, positions, 8)
    got = indexer_topk_triton(q.to(DEV), k.to(DEV), w.to(DEV), positions.to(DEV), 8, select_overrides=CPU_SELECT)
    assert torch.equal(got.cpu(), ref)


def test_explain_walks_the_table(monkeypatch):
    """CPU tensors take the reference; every CUDA shape, long or short rows, prefill or decode, the radix select
    (the rules read the device and fp8 only; a CUDA tensor is faked by its `is_cuda`)."""
    from dsaflow.ops.indexer_topk.dispatch import KERNELS

    q, k = torch.zeros(1, 2048, 2, 16), torch.zeros(1, 8192, 16)
    assert explain_indexer_topk(q, k, None, None, 64).kernel == "reference"
    assert [name for name, _ in KERNELS] == ["reference", "triton_radix"]
    for qq, kk in ((q, k), (q, k[:, :4096]), (q[:, :1], k), (q[:, :1], k[:, :1025])):
        choice = explain_indexer_topk(FakeCuda(qq), kk, None, None, 64)
        assert choice.kernel == "triton_radix" and choice.refused == (("reference", "device cuda runs the kernels"),)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    assert explain_indexer_topk(FakeCuda(q), k, None, None, 64).kernel == "triton_radix"
    refused = explain_indexer_topk(FakeCuda(q), k, None, None, 64, fp8=True)
    assert refused.kernel is None and "needs fp8 tensor cores" in dict(refused.refused)["triton_radix"]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert explain_indexer_topk(FakeCuda(q), k, None, None, 64, fp8=True).kernel == "triton_radix"


def test_select_config_and_query_chunk_are_shape_only():
    with pytest.raises(ValueError, match=r"unknown config keys \['algo'\]"):
        radix_topk_triton(torch.zeros(1, 1, 8), torch.zeros(1, 1, dtype=torch.long), 2, overrides=dict(algo="scan"))
    few, many = select_config(8192, rows=64), select_config(8192, rows=2048)
    assert (few["BLOCK_FINISH"], few["warps_finish"]) == (1024, 8) and (many["BLOCK_FINISH"], many["warps_finish"]) == (
        512,
        4,
    )
    assert select_config(100, rows=1)["BLOCK_FINISH"] == 128  # never wider than the row
    assert query_chunk(1, 16384, 131200) % 64 == 0 and query_chunk(1, 16384, 65664) % 64 == 0
    assert query_chunk(1, 5, 100) == 5 and query_chunk(1, 10**6, 2**27) == 2


def test_logits_unwritten_tiles_are_only_invisible_ones():
    """write_invisible=False may leave only tiles no query of the tile can see; every visible score is written."""
    g = torch.Generator().manual_seed(4)
    B, T, H, D, S = 1, 4, 2, 16, 64
    q, k, w = int_inputs(B, T, H, D, S, g)
    positions = torch.tensor([[3, 10, 17, 20]])
    buf = torch.full((B, T, S), float("nan"))
    out = indexer_logits_triton(q, k, w, positions, out=buf, overrides=dict(BLOCK_S=16), write_invisible=False)
    full = indexer_logits_triton(q, k, w, positions, overrides=dict(BLOCK_S=16))
    vis = torch.arange(S).view(1, 1, -1) <= positions.unsqueeze(-1)
    assert torch.equal(out[vis], full[vis])
    assert torch.isnan(out[..., 32:]).all(), "tiles past every query's position need no write"


@pytest.mark.parametrize("H", [3, 8, 20])
def test_one_query_logits_equal_the_naive_scores(H):
    """Decode steps (T == 1) take the one-query kernel (heads as the rows of one dot): exact scores on integer
    inputs, -inf past the position, padding rows (position -1) all -inf, the same int64 sort keys as the tiled
    kernel (forced by an override), and with write_invisible=False only invisible tiles left as they were."""
    from dsaflow.ops.indexer_topk.naive import indexer_scores_naive

    g = torch.Generator().manual_seed(H)
    B, D, S = 5, 16, 300
    q, k, w = (t.to(DEV) for t in int_inputs(B, 1, H, D, S, g))
    positions = torch.tensor([[0], [5], [-1], [128], [299]], device=DEV)
    ref = indexer_scores_naive(q, k, w, positions)
    got = indexer_logits_triton(q, k, w, positions, out=torch.full((B, 1, S), float("nan"), device=DEV))
    assert torch.equal(got, ref)
    keys = indexer_logits_triton(q, k, w, positions, out=torch.empty(B, 1, S, dtype=torch.long, device=DEV))
    tiled = indexer_logits_triton(q, k, w, positions, out=torch.empty_like(keys), overrides=dict(BLOCK_S=128))
    assert torch.equal(keys, tiled)
    part = indexer_logits_triton(
        q, k, w, positions, out=torch.full((B, 1, S), float("nan"), device=DEV), write_invisible=False
    )
    vis = torch.arange(S, device=DEV).view(1, 1, -1) <= positions.unsqueeze(-1)
    assert torch.equal(part[vis], ref[vis])
    assert torch.isnan(part[1, 0, 128:]).all() and torch.isnan(part[2]).all()  # whole tiles past the position
    assert torch.equal(indexer_topk_triton(q, k, w, positions, 7), indexer_topk_naive(q, k, w, positions, 7))


# ---------------------------------------------------------------------------------------------- GPU, real shapes
def v32_inputs(B, T, S, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, 64, 128, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(B, S, 128, generator=g).to("cuda", torch.bfloat16)
    w = torch.randn(B, T, 64, generator=g).to("cuda", torch.bfloat16)
    return q, k, w


@pytest.mark.gpu
@pytest.mark.parametrize("S", [8192, 131072])
def test_gpu_radix_equals_the_stable_sort_v32(S):
    """Same fp32 logits -> the radix select and the whole op equal the stable-sort reference exactly."""
    T, topk = 256, 2048
    q, k, w = v32_inputs(1, T, S, seed=S)
    positions = torch.arange(S - T, S, device="cuda").unsqueeze(0)
    positions[0, :4] = torch.tensor([-1, 5, 1000, 2047])  # padding, short contexts, exactly topk visible
    scores = indexer_logits_triton(q, k, w, positions)
    out = torch.full((1, T, topk), POISON, device="cuda", dtype=torch.int32)
    ref = topk_from_scores(scores, topk)
    for cfg in ({}, dict(whole_row=True), dict(programs=4096)):  # default; no floor; more splits
        got = radix_topk_triton(scores, positions, topk, out=out.fill_(POISON), overrides=cfg)
        assert torch.equal(got, ref), cfg
    assert torch.equal(indexer_topk_triton(q, k, w, positions, topk), ref)


@pytest.mark.gpu
def test_gpu_radix_ties_and_256k_rows():
    g = torch.Generator().manual_seed(11)
    B, T, S, topk = 1, 21, 262144, 2048
    scores = tie_scores(B, T, S, g).cuda()
    positions = torch.randint(0, S, (B, T), generator=g).cuda()
    positions[0, :3] = torch.tensor([S - 1, -1, 100])
    ref = topk_from_scores(masked(scores, positions), topk)
    for cfg in ({}, dict(whole_row=True)):
        assert torch.equal(radix_topk_triton(scores, positions, topk, overrides=cfg), ref), cfg


@pytest.mark.gpu
def test_gpu_logits_grid_takes_more_than_65535_batch_rows():
    B, T, H, D, S, topk = 70_000, 1, 2, 16, 40, 8
    g = torch.Generator().manual_seed(5)
    q, k, w = (x.cuda() for x in int_inputs(B, T, H, D, S, g))
    positions = torch.randint(-1, S, (B, T), generator=g).cuda()
    ref = indexer_topk_naive(q, k, w, positions, topk)
    assert torch.equal(indexer_topk_triton(q, k, w, positions, topk), ref)


@pytest.mark.gpu
def test_gpu_one_query_logits_match_the_tiled_kernel_v32():
    """Decode steps at V3.2's indexer (64 heads x 128, bf16): the one-query kernel's scores equal the tiled kernel's
    up to the order of the head sum, its top-k equals the exact select over its own scores, and graph replay of the
    op equals eager."""
    B, S, topk = 8, 32768, 2048
    q, k, w = v32_inputs(B, 1, S, seed=9)
    positions = torch.tensor([[-1], [0], [100], [2047], [2048], [9000], [20000], [S - 1]], device="cuda")
    poison = torch.full((B, 1, S), float("nan"), device="cuda")
    one = indexer_logits_triton(q, k, w, positions, out=poison.clone())
    tiled = indexer_logits_triton(q, k, w, positions, out=poison.clone(), overrides=dict(BLOCK_S=128))
    vis = torch.arange(S, device="cuda").view(1, 1, -1) <= positions.unsqueeze(-1)
    assert torch.equal(torch.isinf(one), ~vis) and torch.equal(torch.isinf(tiled), ~vis)
    scale = tiled[vis].abs().max()
    assert ((one[vis] - tiled[vis]).abs() <= 1e-5 * scale).all()
    eager = indexer_topk_triton(q, k, w, positions, topk)
    assert torch.equal(eager, topk_from_scores(one, topk))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_idx = indexer_topk_triton(q, k, w, positions, topk)
    g_idx.fill_(POISON)
    graph.replay()
    assert torch.equal(g_idx, eager)


@pytest.mark.gpu
def test_gpu_indexer_topk_graph_equals_eager():
    B, T, S, topk = 2, 512, 32768, 2048
    q, k, w = v32_inputs(B, T, S, seed=3)
    positions = torch.arange(S - T, S, device="cuda").repeat(B, 1)
    positions[1, :5] = torch.tensor([-1, -1, 0, 100, 3000])
    eager = indexer_topk_triton(q, k, w, positions, topk, chunk=128)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_idx = indexer_topk_triton(q, k, w, positions, topk, chunk=128)
    g_idx.fill_(POISON)
    graph.replay()
    assert torch.equal(g_idx, eager)
