"""Which kernel runs `dense_indexer_kl`: one table of (kernel, capability rule), walked in order.

| kernel      | runs when                                                                                      |
|-------------|------------------------------------------------------------------------------------------------|
| `chunked`   | CPU tensors, `torch.use_deterministic_algorithms(True)` (train.deterministic: the kernels' key  |
|             | gradients use atomics), or no query or key (`naive.dense_indexer_kl_chunked`, O(chunk * S))     |
| `triton`    | [L, B, T, H, D] / [L, B, S, H, D] attention rows, matching bf16/fp16/fp32 pairs, D_I <= 256     |

A CUDA call no kernel takes raises ValueError with the shapes and the reasons. `explain_dense_indexer_kl(...)`
returns the `Choice`.
"""

from __future__ import annotations

import torch

from ..kernel_table import Choice, walk

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_DI = 256  # the index key tile [BLOCK_DI, BLOCK_S] and the dk accumulator [BLOCK_S, BLOCK_DI] stay on chip


def kernel_supports(q, k, q_i, k_i, w) -> str | None:
    """None if the kernels take these inputs, else the reason they do not."""
    if q.dim() != 5 or k.dim() != 5 or q.shape[:2] != k.shape[:2] or q.shape[3:] != k.shape[3:]:
        return f"q {tuple(q.shape)} / k {tuple(k.shape)} (expected [L, B, T, H, D] and [L, B, S, H, D])"
    if q.dtype not in _DTYPES or k.dtype != q.dtype or q_i.dtype not in _DTYPES or k_i.dtype != q_i.dtype:
        return f"dtypes q={q.dtype} k={k.dtype} q_i={q_i.dtype} k_i={k_i.dtype} (pairs must match, bf16/fp16/fp32)"
    if q_i.shape[-1] > MAX_DI:
        return f"index head dim {q_i.shape[-1]} > {MAX_DI}"
    if k.shape[2] == 0 or q.shape[2] == 0 or k_i.shape[1] != k.shape[2]:
        return f"empty or mismatched key sets (attention S={k.shape[2]}, indexer S={k_i.shape[1]})"
    return None


def _chunked_rule(q, k, q_i, k_i, w):
    if not q_i.is_cuda or torch.are_deterministic_algorithms_enabled():
        return None
    if q.dim() == 5 and k.dim() == 5 and (q.shape[2] == 0 or k.shape[2] == 0):
        return None  # nothing to launch
    return "device cuda runs the kernels (deterministic algorithms run the chunked reference)"


KERNELS = (("chunked", _chunked_rule), ("triton", kernel_supports))


def explain_dense_indexer_kl(q, k, q_i, k_i, w) -> Choice:
    """Which kernel `dense_indexer_kl(q, k, sm_scale, q_i, k_i, w, positions)` runs and why earlier ones did not."""
    return walk(KERNELS, q, k, q_i, k_i, w)
