"""The FP8 KV cache's kernels on a GPU (serve.kv_dtype=fp8), each against its naive reference, at DeepSeek-V3.2's
dims with ragged lengths; skipped without a CUDA device (tests/conftest.py). Run on a one-GPU machine with

    .venv/bin/python -m pytest -q -m gpu tests/test_kv_fp8_gpu.py

- the fused quantize-and-write kernel: bit-identical to torch's rounding (every e4m3 value and tie, V3.2 rows),
  bytes it must not touch keep their poison;
- the sparse MLA forward over the packed latent cache: the kernel with poisoned outputs (one split and split-K) and
  the public op (decode and prefill-sized passes, 128 and 16 heads) against the fp32 reference over the dequantized
  rows, CUDA-graph replay equal to eager;
- the indexer top-k over packed keys, bf16 and fp8 queries: the selected keys' reference scores are the best ones;
- the serving engine with an FP8 cache: graph replay gives eager's logits bit for bit, and the same greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
from test_graphs_gpu import assert_bitwise, make, prompts, run
from test_kv_fp8 import POISON, every_e4m3_and_its_ties, ragged_indices
from test_ops_triton import check_topk, rel_err

from dsaflow.config.kv_cache_format import Fp8RowFormat
from dsaflow.ops.indexer_topk import indexer_topk
from dsaflow.ops.indexer_topk.fp8 import dequantize_rows, quantize_rows
from dsaflow.ops.kv_fp8 import dequantize_fp8_rows, quantize_fp8_rows, write_fp8_rows
from dsaflow.ops.sparse_mla import explain_sparse_mla, sparse_mla, sparse_mla_naive
from dsaflow.ops.sparse_mla.triton_prefill import launch_sparse_mla_fwd

pytestmark = pytest.mark.gpu
V32 = Fp8RowFormat(512, 128, 64)  # 656 bytes
KEYS = Fp8RowFormat(128, 128)  # 132 bytes
# bf16 queries: the kernel rounds each dequantized key to bf16 (2^-9 relative) before the tensor-core dots, and the
# probabilities to bf16 before P.V; over 2048 keys the output's relative error stays near 2^-8
BF16_TOL = 1e-2


def test_write_kernel_is_bit_identical_on_the_gpu():
    f = Fp8RowFormat(1024, 1024)
    row = every_e4m3_and_its_ties().view(1, 1, -1)
    buf = torch.full((1, 1, f.nbytes), POISON, dtype=torch.uint8, device="cuda")
    write_fp8_rows(buf, torch.zeros(1, 1, 1, dtype=torch.long, device="cuda"), row.cuda(), f)
    assert torch.equal(buf.cpu(), quantize_fp8_rows(row, f))
    g = torch.Generator().manual_seed(0)
    B, T, S = 4, 37, 300
    x = torch.randn(B, T, 576, generator=g) * torch.logspace(-3, 2, 576)
    slots = torch.stack([torch.randperm(S, generator=g)[:T] for _ in range(B)]).unsqueeze(-1)
    ref = torch.full((B + 1, S, V32.nbytes), POISON, dtype=torch.uint8)
    got = ref.cuda()
    write_fp8_rows(ref, slots, x, V32)  # CPU: the reference
    write_fp8_rows(got, slots.cuda(), x.cuda(), V32)
    assert torch.equal(got.cpu(), ref)
    assert (ref[B] == POISON).all()


def latent_case(B, T, H, S, K, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, 576, generator=g).to("cuda", torch.bfloat16)
    packed = quantize_fp8_rows(torch.randn(B, S, 576, generator=g) * 2, V32).cuda()
    idx = ragged_indices(B, T, K, lengths, g).cuda()
    return q, packed, idx


@pytest.mark.parametrize("num_splits", [1, 4])
def test_sparse_mla_kernel_over_the_fp8_cache_with_poisoned_outputs(num_splits):
    q, packed, idx = latent_case(3, 2, 128, 3000, 2048, [3000, 700, 0], seed=1)
    ref, ref_lse = sparse_mla_naive(q.float(), dequantize_fp8_rows(packed, V32), idx, 0.04, 512)
    shape = (num_splits, 3, 2, 128) if num_splits > 1 else (3, 2, 128)
    out = torch.full((*shape, 512), float("nan"), device="cuda", dtype=torch.float32 if num_splits > 1 else q.dtype)
    lse = torch.full(shape, float("nan"), device="cuda")
    launch_sparse_mla_fwd(q, packed, idx, 0.04, 512, out, lse, num_splits)
    if num_splits > 1:
        w = torch.softmax(torch.nan_to_num(lse, neginf=-1e30), dim=0)
        out, lse = (w.unsqueeze(-1) * torch.nan_to_num(out)).sum(0), torch.logsumexp(lse, dim=0)
    assert not out.isnan().any() and (out[2] == 0).all() and torch.isinf(lse[2]).all()
    assert rel_err(out[:2], ref[:2]) < BF16_TOL
    assert (lse[:2] - ref_lse[:2]).abs().max() < BF16_TOL * ref_lse[:2].abs().max()


@pytest.mark.parametrize("B,T,H", [(8, 1, 128), (4, 1, 16), (2, 64, 128)])
def test_public_op_reads_the_fp8_cache_and_replays_in_a_graph(B, T, H):
    q, packed, idx = latent_case(B, T, H, 4096, 2048, [4096 - 997 * b for b in range(B)], seed=B + T)
    assert explain_sparse_mla(q, packed, idx, 512, grad=False).kernel == "triton_decode"
    out, lse = sparse_mla(q, packed, idx, 0.04, 512)
    ref, _ = sparse_mla_naive(q.float(), dequantize_fp8_rows(packed, V32), idx, 0.04, 512)
    assert rel_err(out, ref) < BF16_TOL
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = sparse_mla(q, packed, idx, 0.04, 512)
    graph.replay()
    assert torch.equal(g_out, out) and torch.equal(g_lse, lse)


@pytest.mark.parametrize("T,fp8", [(1, False), (1, True), (256, False), (256, True)])
def test_indexer_topk_over_fp8_keys(T, fp8):
    B, S, topk = (4 if T == 1 else 1), 8192, 2048  # the reference's [B, T, H, S] fp32 logits: at most 8.6 GB
    g = torch.Generator().manual_seed(T + fp8)
    q = torch.randn(B, T, 64, 128, generator=g).to("cuda", torch.bfloat16)
    w = torch.randn(B, T, 64, generator=g).to("cuda", torch.bfloat16)
    packed = quantize_fp8_rows(torch.randn(B, S, 128, generator=g), KEYS).cuda()
    positions = torch.arange(S - T, S, device="cuda").expand(B, T).clone()
    positions[-1, 0] = 1500 if T == 1 else -1  # a shorter row, or a padding query
    idx = indexer_topk(q, packed, w, positions, topk, fp8=fp8)
    keys = dequantize_fp8_rows(packed, KEYS)
    qr = dequantize_rows(*quantize_rows(q)) if fp8 else q.float()  # the queries the op scores with
    scores = torch.einsum("bthd,bsd->bths", qr[:1, :1], keys[:1]).relu().mul(w[:1, :1, :, None].float()).sum(2)
    check_topk(idx, qr, keys, w.float(), positions, topk, atol=2e-3 * scores.abs().max().item())


def test_engine_graphs_equal_eager_with_an_fp8_cache():
    cfg, plan = make(["serve.kv_dtype=fp8"])
    ps = prompts(5, seed=7)
    out_g, eg, report = run(cfg, plan, ps, strict=True)
    assert all(r.status == "captured" for r in report.records)
    assert eg.caches[0].kv[0].dtype == torch.uint8
    out_e, ee, _ = run(cfg, plan, ps, force_eager=True)
    assert_bitwise(eg.logits_log, ee.logits_log)
    assert out_g == out_e
