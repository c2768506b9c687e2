"""Pre-launch resource check: the memory one rank will need, against the memory it will have.

Per rank (the stages it owns), in bytes:
    train   the plan's training terms of each stage it owns (dsaflow.plan.memory: weights and AdamW state,
            gradients, activations of the microbatches in flight under train.recompute, one layer's backward
            transient), in the compute dtype of this device (bf16 autocast on a GPU, fp32 on CPU); the indexer's
            forward scores ([T, T] per head on CPU; on a GPU the Triton indexer's query chunks) and on CPU the naive
            sparse attention's gathered keys [T, k_eff, d] when they exceed the backward transient (they never
            coexist); the batch.
    serve   the plan's serving terms of the stages it owns (dsaflow.plan.serve_memory, the same the plan table and
            `dsaflow plan`'s fit check use): weights in serve.weights' format (bf16 = serve.dtype; fp8 = e4m3 + block
            scales), KV + indexer-key caches (max_batch x (max_context + 1)), the index cache (max_batch x
            prefill_chunk x index_topk int32), the last stage's logits of one prefill pass and a MoE layer's work
            buffers.
Available: the memory of this rank's GPU, or the host's available memory shared by every rank on a CPU run.
The check refuses a plan above 90% of it (dsaflow.plan.serve_memory.USABLE_FRACTION, the share the planner counts
as usable), naming the largest term and what shrinks it. On a GPU the training terms
are held within 15 % of the measured peak by a GPU test (tests/test_memory_estimate.py).
"""

from __future__ import annotations

import os
from typing import Dict, Tuple

from dsaflow.errors import ResourceError
from dsaflow.plan.memory import TRANSIENT, largest_term_fix, train_memory_terms
from dsaflow.plan.serve_fit import fit_alternatives
from dsaflow.plan.serve_memory import USABLE_FRACTION, rank_fits, serve_fix, serve_width
from dsaflow.plan.stage_estimates import dp_shards

GiB = 1 << 30
HEADROOM = USABLE_FRACTION
BATCH = "batch"


def _fmt(b: float) -> str:
    return f"{b / GiB:.1f} GiB" if b >= GiB / 10 else f"{b / (1 << 20):.1f} MiB"


def rank_memory(cfg, plan, rank: int, device_type: str, job: str) -> Dict[str, float]:
    """{term: bytes} for one rank."""
    m, est = cfg.model, plan.estimates
    owned = [s for s in plan.stages if s.rank == rank]
    out: Dict[str, float] = {}
    if job == "generate":
        width = serve_width(str(cfg.serve.dtype), device_type)
        fit = next(f for f in rank_fits(cfg, plan.layers, plan.stages, width, 0.0) if f.rank == rank)
        return dict(fit.terms)
    t = cfg.train
    tokens = est["microbatch_tokens"]
    for st in owned:
        se = est["stages"][st.index]
        roles = [plan.layers[i].role for i in st.layers]
        terms = train_memory_terms(
            cfg,
            roles,
            plan.is_first(st.index),
            plan.is_last(st.index),
            tokens,
            se["microbatches_in_flight"],
            plan.pipeline.microbatches,
            device_type,
            layer_indices=list(st.layers),
            shards=dp_shards(plan.pipeline),
            cp=plan.pipeline.cp,
        )
        for name, b in terms.items():
            out[name] = out.get(name, 0) + b if name != TRANSIENT else max(out.get(name, 0), b)
    seq = t.seq_len
    seqs = max(1, tokens // seq)
    k_eff = min(m.index_topk, seq)
    if device_type == "cpu":  # the reference indexer scores every head, then gathers the selected rows
        forward = seqs * seq * seq * 4 * (m.index_n_heads + 1)
        forward += tokens * max(k_eff, m.index_topk) * (m.kv_lora_rank + m.qk_rope_head_dim) * 4 * 2
    else:  # the Triton indexer works in query chunks of at most SCORE_BUDGET_ELEMS scores
        from dsaflow.ops.indexer_topk.budget import SCORE_BUDGET_ELEMS  # imports torch: not on a CPU machine

        forward = min(seqs * seq * seq, SCORE_BUDGET_ELEMS) * 12
    out[TRANSIENT] = max(out.get(TRANSIENT, 0), forward)
    out[BATCH] = t.batch_size * (seq + 1) * 8 * 5
    from dsaflow.data.corpus import resident_bytes

    out["training corpus held in memory (a folder of text files; one file is memory-mapped)"] = 2 * resident_bytes(
        str(cfg.data.kind), cfg.data.path, cfg.data.suffixes, cfg.data.exclude
    )  # the files, then their joined copy
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
    # every process of the world shares one host when the launch is local (a replica's ranks need the same memory)
    avail, source = available_memory(device_type, plan.pipeline.world_size)
    worst = None
    for r in range(plan.pipeline.ranks):
        need = rank_memory(cfg, plan, r, device_type, job)
        total = sum(need.values())
        if worst is None or total > worst[0]:
            worst = (total, r, need)
    total, r, need = worst
    if total > HEADROOM * avail:
        name, biggest = max(need.items(), key=lambda kv: kv[1])
        if job == "generate":
            usable, width = HEADROOM * avail, serve_width(str(cfg.serve.dtype), device_type)
            fits = rank_fits(cfg, plan.layers, plan.stages, width, usable)
            fit = next(f for f in fits if f.rank == r)
            fix = serve_fix(cfg, fit, fits, name, *fit_alternatives(cfg, usable, width))
        else:
            fix = f"{largest_term_fix(name)} (now train.recompute={cfg.train.recompute})"
        raise ResourceError(
            f"the plan needs about {_fmt(total)} on rank {r}, more than the {_fmt(avail)} it has ({source}); the "
            f"largest consumer is {name}: {_fmt(biggest)}. Fix: {fix}; or "
            f"run where there is more memory (DSAFLOW_SKIP_MEMORY_CHECK=1 skips this estimate)."
        )
