"""What a serving rank holds on its device, term by term, and how many KV tokens fit beside it. One set of terms serves
the plan's serving table (`mode=serve`), `dsaflow plan`'s fit check and the pre-launch check of `dsaflow generate`
(dsaflow/launch/resources.py).

    weights                    every tensor of the rank's stages in serve.weights' format (dsaflow.config.fp8_policy:
                               fp8 = the projections in e4m3 + one fp32 scale per 128x128 block, the router fp32,
                               the rest in the serve dtype; bf16 = the serve dtype, the router fp32)
    KV and indexer-key caches  serve.max_batch rows of serve.max_context + 1 tokens: per token and layer the MLA latent
                               (kv_lora + rope) and, on F layers, the indexer key, as serve.kv_dtype stores them
                               (bf16: the serve dtype; fp8: e4m3 + fp32 scales, RoPE bf16:
                               dsaflow.config.kv_cache_format)
    work buffers               the stages' index caches and, on the last stage, the fp32 logits of one prefill pass
                               (serve.max_batch x serve.prefill_chunk tokens); a MoE layer's work buffers over that
                               pass (each token's k expert rows: gathered input, gate/up, activation and output)

KV tokens that fit = (USABLE_FRACTION x device memory - weights - work buffers) / KV bytes per token. The FP8
weights are assumed to feed block-scaled FP8 GEMMs in place: no bf16 copy of a weight is counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from dsaflow.config.fp8_policy import FP8, total_stored_bytes
from dsaflow.config.kv_cache_format import FP8 as KV_FP8
from dsaflow.config.kv_cache_format import kv_bytes_per_token as layer_kv_bytes
from dsaflow.config.moe_schema import is_moe_layer
from dsaflow.plan import estimates as E

WEIGHTS = "weights"
KV = "KV and indexer-key caches"
INDEX_CACHE = "index cache"
LOGITS = "logits"
MOE_BUFFERS = "MoE work buffers"
WORK_BUFFERS = (INDEX_CACHE, LOGITS, MOE_BUFFERS)
GiB = 1 << 30

# The share of a device's memory the plan may fill. The rest is the CUDA context (about 0.5 GiB), NCCL's
# communicator buffers, cuBLAS and Triton workspaces and the caching allocator's fragmentation; 0.9 is also vLLM's
# default gpu_memory_utilization. The pre-launch check refuses above the same share, so a plan that fits a device
# here passes that check on it.
USABLE_FRACTION = 0.9

Shape = Tuple[int, ...]


def serve_width(dtype: str, device_type: str = "cuda") -> int:
    """Bytes per element of serve.dtype (auto: bf16 on a GPU, fp32 on CPU)."""
    return E.BF16 if dtype == "bf16" or (dtype == "auto" and device_type == "cuda") else E.FP32


def layer_weight_shapes(m, role: str, moe: bool = False) -> List[Tuple[str, Shape]]:
    """(name suffix after `layers.<i>.`, shape) of every tensor one block stores, named as dsaflow.model names them:
    norms, MLA, the indexer on F layers, the dense MLP or (`moe`) the router, its selection bias, the packed routed
    experts [E, 2I, D] / [E, D, I] and the shared experts."""
    h, d = m.n_heads, m.dim
    out: List[Tuple[str, Shape]] = [
        ("attn_norm.weight", (d,)),
        ("attn.wq_a.weight", (m.q_lora_rank, d)),
        ("attn.q_norm.weight", (m.q_lora_rank,)),
        ("attn.wq_b.weight", (h * (m.qk_nope_head_dim + m.qk_rope_head_dim), m.q_lora_rank)),
        ("attn.wkv_a.weight", (m.kv_lora_rank + m.qk_rope_head_dim, d)),
        ("attn.kv_norm.weight", (m.kv_lora_rank,)),
        ("attn.wkv_b.weight", (h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)),
        ("attn.wo.weight", (d, h * m.v_head_dim)),
        ("ffn_norm.weight", (d,)),
    ]
    if role == "F":
        hi, di = m.index_n_heads, m.index_head_dim
        out += [
            ("attn.indexer.wq_b.weight", (hi * di, m.q_lora_rank)),
            ("attn.indexer.wk.weight", (di, d)),
            ("attn.indexer.k_norm.weight", (di,)),
            ("attn.indexer.k_norm.bias", (di,)),
            ("attn.indexer.weights_proj.weight", (hi, d)),
        ]
    if not moe:
        return out + [
            ("mlp.w1.weight", (m.inter_dim, d)),
            ("mlp.w3.weight", (m.inter_dim, d)),
            ("mlp.w2.weight", (d, m.inter_dim)),
        ]
    e, inter = m.moe, m.moe.moe_inter_dim
    out += [
        ("mlp.gate.weight", (e.n_routed_experts, d)),
        ("mlp.gate.e_score_correction_bias", (e.n_routed_experts,)),
        ("mlp.experts.gate_up_proj", (e.n_routed_experts, 2 * inter, d)),
        ("mlp.experts.down_proj", (e.n_routed_experts, d, inter)),
    ]
    if e.n_shared_experts:
        shared = e.n_shared_experts * inter
        out += [
            ("mlp.shared_experts.w1.weight", (shared, d)),
            ("mlp.shared_experts.w3.weight", (shared, d)),
            ("mlp.shared_experts.w2.weight", (d, shared)),
        ]
    return out


def edge_weight_shapes(m, first: bool, last: bool) -> List[Tuple[str, Shape]]:
    """The embedding on the first stage; the final norm, the (untied) head and the MTP layers' own tensors (their
    embedding copy, eh_proj, norms; their blocks count as layers) on the last."""
    mtp = []
    for i in range(m.num_layers, m.num_layers + m.mtp_layers) if last else ():
        p = f"mtp.{i}."
        mtp += [(p + "embed.weight", (m.vocab_size, m.dim)), (p + "eh_proj.weight", (m.dim, 2 * m.dim))]
        mtp += [(p + n, (m.dim,)) for n in ("enorm.weight", "hnorm.weight", "head_norm.weight")]
    return ([("embed.weight", (m.vocab_size, m.dim))] if first else []) + (
        [("norm.weight", (m.dim,)), ("head.weight", (m.vocab_size, m.dim))] + mtp if last else []
    )


def weight_bytes(
    m, roles: Sequence[str], moe: Sequence[bool], first: bool, last: bool, weights: str, width: int
) -> int:
    """Bytes of the weights of layers with `roles` (`moe`: which have a MoE MLP), plus the embedding (`first`) and
    the head (`last`), stored as serve.weights=`weights` says with the serve dtype `width` bytes wide."""
    shapes = [s for r, x in zip(roles, moe) for s in layer_weight_shapes(m, r, x)] + edge_weight_shapes(m, first, last)
    return total_stored_bytes(shapes, weights, width)


def kv_bytes_per_token(m, roles: Sequence[str], width: int, kv_dtype: str = "bf16") -> int:
    """KV + indexer-key cache bytes per token over layers of `roles`, as serve.kv_dtype=`kv_dtype` stores them (bf16:
    in the serve dtype, `width` bytes wide)."""
    return sum(layer_kv_bytes(m, r, kv_dtype, width) for r in roles)


def serve_memory_terms(
    cfg, roles, layer_indices, first: bool, last: bool, width: int, stages: int = 1
) -> Dict[str, int]:
    """{term: bytes} a serving rank holds for `stages` stages whose layers have `roles` and global `layer_indices`,
    with the embedding (`first`) and the head and the MTP layers (`last`), in a serve dtype `width` bytes wide (see the module
    docstring). Every term is present (0 where it does not apply), so the per-stage rows of a table line up."""
    m, sv = cfg.model, cfg.serve
    roles, layer_indices = E.with_mtp(m, roles, layer_indices, last)
    moe = [is_moe_layer(m, i) for i in layer_indices]
    tokens = sv.max_batch * sv.prefill_chunk
    e = m.moe
    return {
        WEIGHTS: weight_bytes(m, roles, moe, first, last, str(sv.weights), width),
        KV: kv_bytes_per_token(m, roles, width, str(sv.kv_dtype)) * sv.max_batch * (sv.max_context + 1),
        INDEX_CACHE: tokens * m.index_topk * E.INT32 * stages,
        LOGITS: tokens * m.vocab_size * E.FP32 if last else 0,
        MOE_BUFFERS: tokens * e.num_experts_per_tok * (2 * m.dim + 4 * e.moe_inter_dim) * width if any(moe) else 0,
    }


@dataclass
class RankFit:
    """One serving rank against `usable` bytes: its stages, its terms, its KV bytes per token, the KV tokens the
    config asks (serve.max_batch x (serve.max_context + 1)) and its weights were they FP8."""

    rank: int
    stages: List[int]
    terms: Dict[str, int]
    kv_per_token: int
    usable: float
    asked_tokens: int
    fp8_weights: int

    @property
    def work(self) -> int:
        return sum(self.terms[k] for k in WORK_BUFFERS)

    @property
    def tokens_fit(self) -> int:
        """KV tokens that fit beside the weights and work buffers (negative when those alone exceed `usable`)."""
        free = self.usable - self.terms[WEIGHTS] - self.work
        return math.floor(free / self.kv_per_token) if self.kv_per_token else 0

    @property
    def need(self) -> int:
        return sum(self.terms.values())

    @property
    def fits(self) -> bool:
        return self.need <= self.usable


def rank_fits(cfg, layers, stages, width: int, usable: float) -> List[RankFit]:
    """Every serving rank of a plan (`layers`: LayerPlans by global index, `stages`: StagePlans) against `usable`
    bytes each, in a serve dtype `width` bytes wide."""
    m, sv = cfg.model, cfg.serve
    last = len(stages) - 1
    out = []
    for rank in sorted({s.rank for s in stages}):
        owned = [s for s in stages if s.rank == rank]
        ids = [i for s in owned for i in s.layers]
        roles = [layers[i].role for i in ids]
        first_here, last_here = any(s.index == 0 for s in owned), any(s.index == last for s in owned)
        terms = serve_memory_terms(cfg, roles, ids, first_here, last_here, width, len(owned))
        roles, ids = E.with_mtp(m, roles, ids, last_here)  # what serve_memory_terms counted
        moe = [is_moe_layer(m, i) for i in ids]
        fp8 = weight_bytes(m, roles, moe, first_here, last_here, FP8, width)
        kv = kv_bytes_per_token(m, roles, width, str(sv.kv_dtype))
        out.append(RankFit(rank, [s.index for s in owned], terms, kv, usable, sv.max_batch * (sv.max_context + 1), fp8))
    return out


def gib_text(b: float) -> str:
    """Bytes in GiB, or in MiB / KiB when below a tenth of the larger unit (a tiny model's terms)."""
    for unit, name in ((GiB, "GiB"), (1 << 20, "MiB")):
        if abs(b) >= unit / 10:
            return f"{b / unit:.1f} {name}"
    return f"{b / 1024:.1f} KiB"


def _what_fits(room: int, batch: int, context: int) -> str:
    """The rows and context that `room` KV tokens hold, for a fix hint (every value within the schema's ranges)."""
    rows, per_row = room // (context + 1), room // batch - 1
    if rows:
        return f"{rows} rows of serve.max_context={context} fit (serve.max_batch={rows})"
    if per_row >= 1:
        return f"serve.max_batch={batch} rows fit serve.max_context={per_row}"
    if room >= 2:
        return f"one row fits serve.max_context={room - 1} (serve.max_batch=1)"
    return "not even one row of one token fits"


def serve_fix(
    cfg,
    fit: RankFit,
    fits: Sequence[RankFit],
    term: str,
    more_ranks: Optional[str] = None,
    fp8_fits: Optional[bool] = None,
) -> str:
    """What shrinks `term` on the rank of `fit` (`fits`: every rank, for the whole model's weights), for the message
    of a plan or a launch that does not fit. more_ranks: the overrides of the fewest pipeline ranks found to fit
    (dsaflow.plan.serve_fit.fewest_fitting_ranks; "": none does, so more stages are not offered; None: not searched,
    and the weights' lower bound is named instead); fp8_fits: whether serve.weights=fp8 alone makes this plan fit (None: not known)."""
    sv = cfg.serve
    stages, ranks = len({s for f in fits for s in f.stages}), len(fits)
    total = sum(f.terms[WEIGHTS] for f in fits)
    now = f"{stages} stage{'s' if stages > 1 else ''}" + (f" on {ranks} ranks" if ranks != stages else "")
    if more_ranks:
        more_stages = f"more pipeline stages: {more_ranks} is the fewest that fits (now {now})"
    elif more_ranks == "":
        more_stages = None  # searched: not even one layer per stage fits
    else:
        at_least = max(ranks + 1, math.ceil(total / fit.usable))
        how = "more '|' cuts in layout" if cfg.layout else "pipeline.stages=N or pipeline.boundaries"
        more_stages = (
            f"more pipeline stages (now {now}; {how}): the weights are {gib_text(total)} in all, so at least "
            f"{at_least} ranks of {gib_text(fit.usable)} usable each"
            if at_least <= cfg.model.num_layers
            else None  # more ranks than layers: stages cannot help
        )
    fp8 = None
    if str(sv.weights) != FP8:
        enough = {True: f"; that alone fits on these {stages} stages", False: "; not enough alone", None: ""}[fp8_fits]
        fp8 = (
            f"serve.weights=fp8 (this rank's weights: {gib_text(fit.fp8_weights)} instead of "
            f"{gib_text(fit.terms[WEIGHTS])}{enough})"
        )
    if term == WEIGHTS:
        parts = [fp8, more_stages]
    elif term == KV:
        room = max(fit.tokens_fit, 0)
        shorter = _what_fits(room, sv.max_batch, sv.max_context)
        parts = [
            f"a shorter serve.max_context or a smaller serve.max_batch ({room:,} KV tokens fit beside the weights and "
            f"work buffers, serve.max_batch x (serve.max_context + 1) = {fit.asked_tokens:,} are asked: {shorter})",
            _fp8_kv_hint(cfg),
            fp8,
            more_stages,
        ]
    else:
        parts = [
            f"a smaller serve.prefill_chunk or serve.max_batch (one prefill pass holds serve.max_batch x "
            f"serve.prefill_chunk = {sv.max_batch * sv.prefill_chunk:,} tokens)"
        ]
    return "; or ".join(p for p in parts if p)


def _fp8_kv_hint(cfg) -> Optional[str]:
    """The FP8 KV cache as a fix, with its bytes per token of an F layer (None when it is on, or cannot hold this
    model's rows)."""
    from dsaflow.config.kv_cache_format import fp8_kv_problem

    if str(cfg.serve.kv_dtype) == KV_FP8 or fp8_kv_problem(cfg.model) is not None:
        return None
    width = serve_width(str(cfg.serve.dtype))
    now, fp8 = layer_kv_bytes(cfg.model, "F", "bf16", width), layer_kv_bytes(cfg.model, "F", KV_FP8, width)
    return f"serve.kv_dtype=fp8 ({fp8:,} instead of {now:,} cache bytes per token of an F layer)"


def largest_term(terms: Dict[str, float]) -> Tuple[str, float]:
    return max(terms.items(), key=lambda kv: kv[1])


def plan_device_bytes(cfg) -> float:
    """plan.device_memory_gib in bytes."""
    return cfg.plan.device_memory_gib * GiB


def serve_estimates(cfg, layers, stages, per_stage: List[dict]) -> dict:
    """The plan's serving view on a device of plan.device_memory_gib: adds to each stage's estimates its weights'
    format and bytes, KV bytes per token, work buffers and its rank's KV tokens that fit; returns the summary
    (`estimates.serve` of plan.json). The plan's device is a GPU: serve.dtype=auto is bf16."""
    width = serve_width(str(cfg.serve.dtype))
    usable = USABLE_FRACTION * plan_device_bytes(cfg)
    fits = rank_fits(cfg, layers, stages, width, usable)
    of_rank = {f.rank: f for f in fits}
    for se in per_stage:
        terms, fit = se["serve_memory_bytes"], of_rank[se["rank"]]
        ids = stages[se["index"]].layers
        se.update(
            serve_weights=str(cfg.serve.weights),
            serve_weight_bytes=terms[WEIGHTS],
            serve_kv_bytes_per_token=kv_bytes_per_token(
                cfg.model, [layers[i].role for i in ids], width, str(cfg.serve.kv_dtype)
            ),
            serve_work_buffer_bytes=sum(terms[k] for k in WORK_BUFFERS),
            serve_kv_tokens_fit=fit.tokens_fit,  # the rank's: every stage it holds shares one device
            serve_fits=fit.fits,
        )
    return {
        "device_memory_bytes": plan_device_bytes(cfg),
        "usable_fraction": USABLE_FRACTION,
        "usable_bytes": usable,
        "weights": str(cfg.serve.weights),
        "kv_dtype": str(cfg.serve.kv_dtype),
        "dtype_bytes": width,
        "max_batch": cfg.serve.max_batch,
        "max_context": cfg.serve.max_context,
        "kv_tokens_asked": cfg.serve.max_batch * (cfg.serve.max_context + 1),
        "ranks": [
            {
                "rank": f.rank,
                "stages": f.stages,
                "memory_bytes": f.terms,
                "kv_bytes_per_token": f.kv_per_token,
                "kv_tokens_fit": f.tokens_fit,
                "need_bytes": f.need,
                "fits": f.fits,
            }
            for f in fits
        ],
    }
