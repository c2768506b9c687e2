"""Pre-launch resource check: the memory one rank will need, against the memory it will have.

Per rank (the stages it owns), in bytes:
    train   weights + gradients + AdamW state (fp32: 16 bytes per parameter)
            activations kept for backward (the plan's per-stage estimate x microbatches in flight; x2 on CPU, fp32)
            index tensors: F-layer top-k indices (+ the indexer-loss target of the same shape), padded to the
            model's index_topk width (the model allocates that width even when fewer keys exist; the effective
            top-k is min(index_topk, context))
            transient tensors of one layer: indexer scores ([T, T] per head on CPU; on a GPU the Triton indexer's
            query chunks), on CPU the naive sparse attention's gathered keys [T, k_eff, d], and with
            train.recompute=attention one recomputed query chunk's attention intermediates and their gradients
    serve   weights in serve.dtype, KV + indexer-key caches (max_batch x max_context), the index cache
            (max_batch x prefill_chunk x index_topk int32) and the logits of one step.
Available: the free memory of this rank's GPU, or the host's available memory shared by every rank on a CPU run.
The check refuses a plan above 90% of it, naming the largest consumer; the estimates are deliberately simple (see
docs), so they catch a typo's hundreds of GB, not the last few percent.
"""
from __future__ import annotations

import os
from typing import Dict, Tuple

from dsaflow.errors import ResourceError
from dsaflow.model.mla import RECOMPUTE_CHUNK_TOKENS
from dsaflow.ops.indexer_topk.budget import SCORE_BUDGET_ELEMS
from dsaflow.plan import estimates as E

GiB = 1 << 30
HEADROOM = 0.9


def _fmt(b: float) -> str:
    return f"{b / GiB:.1f} GiB" if b >= GiB / 10 else f"{b / (1 << 20):.1f} MiB"


def rank_memory(cfg, plan, rank: int, device_type: str, job: str) -> Dict[str, float]:
    """{consumer: bytes} for one rank."""
    m, est = cfg.model, plan.estimates
    stages = [s for s in est["stages"] if s["rank"] == rank]
    owned = [s for s in plan.stages if s.rank == rank]
    n_f = sum(plan.layers[i].role == "F" for st in owned for i in st.layers)
    params = sum(s["params"] for s in stages)
    out: Dict[str, float] = {}
    if job == "generate":
        sv = cfg.serve
        width = 2 if (str(sv.dtype) == "bf16" or (str(sv.dtype) == "auto" and device_type == "cuda")) else 4
        out["weights"] = params * width
        kv = sum(E.kv_bytes_per_token(m, plan.layers[i].role) for st in owned for i in st.layers)
        out["KV and indexer-key caches"] = kv / E.BF16 * width * sv.max_batch * (sv.max_context + 1)
        out["index cache"] = sv.max_batch * sv.prefill_chunk * m.index_topk * E.INT32 * len(owned)
        out["logits"] = sv.max_batch * sv.prefill_chunk * m.vocab_size * 4
        return out
    t = cfg.train
    scale = 2 if device_type == "cpu" else 1  # the plan's estimate assumes bf16; CPU trains in fp32
    out["weights, gradients and AdamW state"] = 16 * params
    act = sum(s["activation_bytes_peak"] for s in stages) * scale
    tokens = est["microbatch_tokens"]
    seq = t.seq_len
    seqs = max(1, tokens // seq)
    in_flight = max([s["microbatches_in_flight"] for s in stages] or [1])
    index = n_f * tokens * m.index_topk * (E.INT32 + 4) * in_flight
    out["activations"] = max(0.0, act - n_f * tokens * m.index_topk * E.INT32 * in_flight * scale)
    out[f"index tensors (model.index_topk={m.index_topk} per query)"] = index
    k_eff = min(m.index_topk, seq)
    if device_type == "cpu":  # the reference indexer scores every head, then gathers the selected rows
        scores = seqs * seq * seq * 4 * (m.index_n_heads + 1)
        scores += tokens * max(k_eff, m.index_topk) * (m.kv_lora_rank + m.qk_rope_head_dim) * 4 * 2
    else:  # the Triton indexer works in query chunks of at most SCORE_BUDGET_ELEMS scores
        scores = min(seqs * seq * seq, SCORE_BUDGET_ELEMS) * 12
    if t.recompute == "attention":  # one query chunk's recomputed attention intermediates and their gradients
        chunk = min(tokens, RECOMPUTE_CHUNK_TOKENS)
        scores += 2 * E.attention_recompute_elems_per_token(m) * chunk * E.BF16 * scale
    out["transient score and gather tensors of one layer"] = scores
    out["batch"] = t.batch_size * (seq + 1) * 8 * 5
    from dsaflow.data.corpus import resident_bytes

    out["training corpus held in memory (a folder of text files; one file is memory-mapped)"] = \
        2 * resident_bytes(str(cfg.data.kind), cfg.data.path)  # the files, then their joined copy
    return out


def available_memory(device_type: str, ranks: int) -> Tuple[float, str]:
    """(bytes one rank may use, where that number comes from)."""
    if device_type == "cuda":
        import torch

        # total, not free: mem_get_info would create a CUDA context that the parent then holds for the whole run
        props = torch.cuda.get_device_properties(0)
        return float(props.total_memory), f"memory of GPU 0 ({props.name})"
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return float("inf"), "unknown"
    return avail / max(1, ranks), f"host memory available ({_fmt(avail)}) shared by {ranks} rank(s)"


def check_resources(cfg, plan, device_type: str, job: str = "train", local: bool = True) -> None:
    """Raise ResourceError when a rank's estimate exceeds what it will have (local=False: only the per-rank total
    against nothing; the sizes' hard bounds live in the schema)."""
    if not local or os.environ.get("DSAFLOW_SKIP_MEMORY_CHECK") == "1":  # the estimate is rough: an escape hatch
        return
    avail, source = available_memory(device_type, plan.pipeline.ranks)
    worst = None
    for r in range(plan.pipeline.ranks):
        need = rank_memory(cfg, plan, r, device_type, job)
        total = sum(need.values())
        if worst is None or total > worst[0]:
            worst = (total, r, need)
    total, r, need = worst
    if total > HEADROOM * avail:
        name, biggest = max(need.items(), key=lambda kv: kv[1])
        raise ResourceError(
            f"the plan needs about {_fmt(total)} on rank {r}, more than the {_fmt(avail)} it has ({source}); the "
            f"largest consumer is {name}: {_fmt(biggest)}. Fix: shrink what drives it (train.batch_size, "
            f"train.seq_len, model.index_topk, model.vocab_size, serve.max_batch, serve.max_context), use more "
            f"pipeline stages, or run where there is more memory (DSAFLOW_SKIP_MEMORY_CHECK=1 skips this estimate)."
        )
