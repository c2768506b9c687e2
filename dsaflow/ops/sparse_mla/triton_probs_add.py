"""The kernel that adds the indexer-loss target from the head sums of P: shared by dsaflow's backward (whose pass 1
sums P per slot, `triton_backward` and `hopper_backward`) and the separate probs pass (`triton_probs`)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _probs_into_kernel(
    ps_ptr, nk_ptr, out_ptr, T, K, q0, n_hb, weight, s_psh, s_psq, s_ob, s_ot,
    BLOCK_K: tl.constexpr,
):
    """One program per query q0 + pid of the chunk: out[b, t, k] += weight * P_sum[k] / total for the slots below
    its key extent, with P_sum the head-sum of its attention probabilities (the head blocks' partial sums in ps
    [n_hb, chunk, K]) and total the sum of P_sum over those slots, as `attention_target` normalises them. A query
    without a valid key (total 0) adds nothing. One writer per element: deterministic, no atomics."""
    pid = tl.program_id(0).to(tl.int64)
    pid_q = q0 + pid
    n_k = tl.load(nk_ptr + pid_q)
    ps_row = ps_ptr + pid * s_psq
    sums = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, n_k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        for hb in range(0, n_hb):
            sums += tl.load(ps_row + hb * s_psh + offs_k, mask=offs_k < n_k, other=0.0)
    total = tl.sum(sums, 0)
    if total > 0.0:
        scale = weight / total
        out_row = out_ptr + (pid_q // T) * s_ob + (pid_q % T) * s_ot
        for k0 in range(0, n_k, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < n_k
            acc = tl.zeros([BLOCK_K], tl.float32)
            for hb in range(0, n_hb):
                acc += tl.load(ps_row + hb * s_psh + offs_k, mask=k_ok, other=0.0)
            prev = tl.load(out_row + offs_k, mask=k_ok, other=0.0)
            tl.store(out_row + offs_k, prev + acc * scale, mask=k_ok)
