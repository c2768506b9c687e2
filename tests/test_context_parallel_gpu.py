"""Context parallelism on one GPU with the Triton kernels at 32K tokens: each cp rank's zigzag shard of the queries,
scored and attended against the gathered keys of the whole sequence, gives the matching rows of the whole-sequence
indexer top-k, sparse attention output and query gradient; the key gradients of every rank, summed (what the
reduce-scatter does), give the whole sequence's; and the gathered rows the sparse attention saves are gathered
again in the backward (dsaflow.model.context_parallel), not kept.

    python -m pytest tests/test_context_parallel_gpu.py -v      # one GPU, well under a minute
"""

from __future__ import annotations

import pytest
import torch

from dsaflow.model.context_parallel import ContextParallel, keys_regathered, zigzag_positions, zigzag_shard
from dsaflow.ops import indexer_topk, sparse_mla
from dsaflow.ops.sparse_mla import deterministic

pytestmark = pytest.mark.gpu
T, H, D_QK, D_V, H_I, D_I, TOPK = 32768, 32, 576, 512, 64, 128, 2048
SCALE = D_QK**-0.5


def _inputs(seed: int = 0):
    """bf16 inputs of one 32K-token sequence at V3.2 attention widths (32 heads to keep the test short)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device="cuda", generator=g)).to(torch.bfloat16)

    return {
        "q": rand(1, T, H, D_QK),
        "kv": rand(1, T, D_QK),
        "q_i": rand(1, T, H_I, D_I),
        "k_i": rand(1, T, D_I),
        "w": rand(1, T, H_I, scale=0.1),
        "g": rand(1, T, H, D_V),
    }


def _attend(q, kv, q_i, k_i, w, positions, g):
    """indices, out, dq, dkv of sparse attention over the indexer's top-k keys, backpropagating g."""
    q, kv = q.detach().requires_grad_(), kv.detach().requires_grad_()
    indices = indexer_topk(q_i, k_i, w, positions, TOPK)
    out, _ = sparse_mla(q, kv, indices, SCALE, D_V)
    out.backward(g)
    return indices, out.detach(), q.grad, kv.grad


@pytest.mark.parametrize("cp", [2, 4])
def test_each_ranks_shard_equals_the_rows_of_the_whole_sequence(cp):
    x = _inputs()
    whole = _attend(x["q"], x["kv"], x["q_i"], x["k_i"], x["w"], torch.arange(T, device="cuda").view(1, T), x["g"])
    ref_idx, ref_out, ref_dq, ref_dkv = whole
    dkv_sum = torch.zeros(ref_dkv.shape, dtype=torch.float32, device="cuda")
    for r in range(cp):
        shard = {k: zigzag_shard(x[k], cp, r) for k in ("q", "q_i", "w", "g")}
        positions = zigzag_positions(T, cp, r, "cuda").view(1, -1)
        idx, out, dq, dkv = _attend(shard["q"], x["kv"], shard["q_i"], x["k_i"], shard["w"], positions, shard["g"])
        # a query's top-k, attention and query gradient read only its own row and the keys: the same kernels on
        # a subset of the queries compute the same sums (the attention within one bf16 rounding of its output)
        assert torch.equal(idx, zigzag_shard(ref_idx, cp, r)), r
        torch.testing.assert_close(out, zigzag_shard(ref_out, cp, r), rtol=2**-8, atol=1e-6)
        torch.testing.assert_close(dq, zigzag_shard(ref_dq, cp, r), rtol=2**-7, atol=1e-5)
        dkv_sum += dkv.float()
    # every key's gradient is a sum over the queries that chose it, accumulated in fp32 and rounded to bf16 once per
    # call: the ranks' bf16 parts summed differ from the whole by a few bf16 ulps of the parts
    err = (dkv_sum - ref_dkv.float()).norm() / ref_dkv.float().norm()
    assert err < cp * 2**-8, err


class _OneRank:
    """The collectives of a cp group of one rank (the gather is still a new tensor: `unzigzag` concatenates)."""

    def __init__(self):
        self.gathers = 0

    def all_gather(self, local):
        self.gathers += 1
        return [local]

    def reduce_scatter(self, parts):
        return parts[0]


def test_the_saved_gathered_keys_are_gathered_again_in_backward():
    """The Triton sparse attention saves its kv for the backward: under `keys_regathered` that saved tensor is the
    rank's own rows and the backward gathers again; the gradients equal those of the plain call (deterministic
    backward: the same bits)."""
    x = _inputs(1)
    n = 4096
    q, kv, g = x["q"][:, :n], x["kv"][:, :n], x["g"][:, :n]
    indices = indexer_topk(x["q_i"][:, :n], x["k_i"][:, :n], x["w"][:, :n], torch.arange(n, device="cuda")[None], 512)
    comm = _OneRank()
    cp = ContextParallel(0, 1, comm)
    plain = [t.detach().requires_grad_() for t in (q, kv)]
    leaves = [t.detach().requires_grad_() for t in (q, kv)]
    with deterministic():
        sparse_mla(plain[0], plain[1], indices, SCALE, D_V)[0].backward(g)
        with keys_regathered(cp, True) as keys:
            out, _ = sparse_mla(leaves[0], keys.gather(leaves[1]), indices, SCALE, D_V)
        forward = comm.gathers
        out.backward(g)
    assert forward == 1 and comm.gathers == 2  # the backward gathered the saved keys again
    assert torch.equal(leaves[0].grad, plain[0].grad) and torch.equal(leaves[1].grad, plain[1].grad)
