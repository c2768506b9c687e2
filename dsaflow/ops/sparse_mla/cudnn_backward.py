"""cuDNN-Frontend's DeepSeek sparse-attention backward (CuTe DSL) behind dsaflow's sparse MLA layout.

Optional: installed by the `peers` extra (`pip install 'dsaflow[peers]'`, nvidia-cudnn-frontend 1.32). Whether it
runs a call is decided by the table in `dispatch.py` (its backward rows); this module only imports and adapts it.

Its contract (cudnn.deepseek_sparse_attention.sparse_attention_backward_wrapper, 1.32):
- flat, unbatched, contiguous tensors: q [N_q, H, D], kv [N_kv, D] (one latent head, K = V = its first d_v
  columns), out/dout [N_q, H, d_v], lse [N_q, H] fp32 natural log over the keys only, attn_sink [H] fp32 (-inf: no
  sink), topk_idxs [N_q, K] int32 global row numbers (entries outside [0, N_kv) are ignored), topk_length [N_q]
  int32 optional valid prefix; D in {512, 576}, d_v = 512; bf16/fp16; returns dq, dkv (q/kv dtype), d_sink.
- sm_90: fp32 atomics into a dkv accumulator (not deterministic); the kernels are compiled on the first call of a
  shape family (dtype, H, top-k) and reused after. sm_100/sm_103: also a deterministic mode (H 16/32/64/96/128).
- The wrapper allocates its outputs and fp32 workspace with torch on the current stream and zeroes the workspace
  with cudaMemsetAsync: no host sync. CUDA-graph capture is safe once one eager call of the same shape family has
  compiled the kernels (the graphs' warm-up runs do that).
"""

from __future__ import annotations

import functools

import torch

PEERS_HINT = "pip install 'dsaflow[peers]' (nvidia-cudnn-frontend 1.32)"
D_QK_SUPPORTED = (512, 576)
D_V = 512  # cuDNN fixes d_v: 512 for both head dims
SM90_MIN_HEADS = 2  # its sm_90 kernel is MQA only (more query heads than the one kv head); head tiles of 64 are masked
SM100_HEADS = (16, 32, 64, 96, 128)  # its sm_100 backends (deterministic ones included) are built for these
SM100_CAPABILITIES = ((10, 0), (10, 3))
INT32_ELEMENTS = 2**31  # beyond this q / kv element offsets its sm_90 kernels are not validated here

_empty = torch.empty  # a hook: the GPU tests NaN-poison the outputs through it


@functools.lru_cache(maxsize=1)
def cudnn_import_error() -> str | None:
    """None when cuDNN-Frontend's sparse-attention backward imports, else why not (once per process; the import
    pulls in the CUTLASS DSL, seconds, so it happens at the first backward that asks, never at dsaflow's import)."""
    try:
        from cudnn.deepseek_sparse_attention import sparse_attention_backward_wrapper  # noqa: F401
    except ImportError as e:
        return f"cuDNN-Frontend is not installed ({type(e).__name__}: {e}); {PEERS_HINT}"
    except Exception as e:  # an installed but broken peer (a missing CUDA library, a wrong CUTLASS DSL)
        return f"cuDNN-Frontend failed to import ({type(e).__name__}: {str(e)[:200]})"
    return None


def cudnn_version() -> str | None:
    """The installed nvidia-cudnn-frontend version, None without it."""
    from importlib import metadata

    try:
        return metadata.version("nvidia-cudnn-frontend")
    except metadata.PackageNotFoundError:  # importable from a path without its dist-info
        import sys

        return getattr(sys.modules.get("cudnn"), "__version__", None)


def sparse_mla_bwd_cudnn(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    d_out: torch.Tensor,
    sm_scale: float,
    d_v: int,
    n_keys: torch.Tensor | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, H, D_qk], kv [B, S, D_qk], indices [B, T, K] int32 (-1 or >= S: no key), out/d_out [B, T, H, d_v],
    lse [B, T, H] fp32 (natural log), n_keys [B, T] int32 (1 + each query's last valid slot, or None) -> dq
    [B, T, H, D_qk] q.dtype, dkv [B, S, D_qk] kv.dtype. No lse gradient (the dispatch rule sends those calls to
    dsaflow's backward) and no indexer-loss target (the dispatcher adds it after, with `triton_probs.py`). Shapes the
    rule accepts only (cuDNN asserts on the others)."""
    from cudnn.deepseek_sparse_attention import sparse_attention_backward_wrapper

    B, T, H, D = q.shape
    S, K = kv.shape[1], indices.shape[2]
    if B > 1:
        # Batches become one flat sequence: row b*S + s. An index outside [0, S) must stay outside the flat range
        # too (S + 7 in batch 0 would otherwise name a row of batch 1).
        valid = (indices >= 0) & (indices < S)
        base = torch.arange(B, device=indices.device, dtype=torch.int32).view(B, 1, 1) * S
        indices = torch.where(valid, indices + base, torch.full_like(indices, -1))
    sink = torch.full((H,), float("-inf"), device=q.device, dtype=torch.float32)  # -inf: no attention sink
    dq = _empty(B * T, H, D, device=q.device, dtype=q.dtype)
    dkv = _empty(B * S, D, device=kv.device, dtype=kv.dtype)
    res = sparse_attention_backward_wrapper(
        q.reshape(B * T, H, D).contiguous(),
        kv.reshape(B * S, D).contiguous(),
        out.reshape(B * T, H, d_v).contiguous(),
        d_out.reshape(B * T, H, d_v).contiguous(),
        lse.reshape(B * T, H).contiguous(),
        sink,
        indices.reshape(B * T, K).contiguous(),
        softmax_scale=float(sm_scale),
        topk_length=None if n_keys is None else n_keys.reshape(B * T).contiguous(),
        dq=dq,
        dkv=dkv,
        deterministic=deterministic,
    )
    return res["dq"].view(B, T, H, D), res["dkv"].view(B, S, D)
