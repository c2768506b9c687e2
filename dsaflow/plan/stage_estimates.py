"""Per-stage and per-boundary estimates for the plan (the `estimates` object of plan.json).

Contexts: savings at `estimate_context` (default 128K: the long-context case DSA exists for), KV cache at
`model.max_seq_len` per sequence, activations at one microbatch of train.seq_len tokens
(train.batch_size / (parallel.dp x pipeline.microbatches) sequences; in serve mode one prefill chunk of
serve.prefill_chunk tokens) under train.recompute; in train mode each stage's peak training memory by term
(dsaflow.plan.memory); in serve mode what each stage holds and the KV tokens that fit on plan.device_memory_gib
(dsaflow.plan.serve_memory).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from dsaflow.config.moe_schema import is_moe_layer
from dsaflow.plan import estimates as E
from dsaflow.plan.memory import train_memory_terms
from dsaflow.plan.plan import LayerPlan, PipelinePlan, StagePlan
from dsaflow.plan.schedule import microbatches_in_flight
from dsaflow.plan.serve_memory import serve_estimates, serve_memory_terms, serve_width


def cost_context(cfg) -> int:
    """Attention context for the cost-balanced split: average causal context of the sequences actually run."""
    length = cfg.train.seq_len if cfg.mode == "train" else cfg.serve.max_context
    return max(1, length // 2)


def layer_costs(cfg, roles: Sequence[str]) -> List[float]:
    """Forward FLOPs per token per layer (declared roles), with the LM head folded into the last layer's cost
    because it always lands on the last stage. Embedding lookups cost no FLOPs."""
    m, ctx = cfg.model, cost_context(cfg)
    costs = [float(E.layer_forward_flops_per_token(m, r, ctx, is_moe_layer(m, i))) for i, r in enumerate(roles)]
    costs[-1] += E.head_forward_flops_per_token(m)
    for i in range(m.num_layers, m.num_layers + m.mtp_layers):  # the MTP layers also always land there
        costs[-1] += float(E.layer_forward_flops_per_token(m, "F", ctx, is_moe_layer(m, i)))
        costs[-1] += E.head_forward_flops_per_token(m) + 2 * 2 * m.dim * m.dim
    return costs


def promotion_costs(cfg, roles: Sequence[str]) -> List[float]:
    """Extra cost of layer i if it opens a stage: an S layer there is promoted and runs the indexer."""
    m, ctx = cfg.model, cost_context(cfg)
    extra = float(E.layer_forward_flops_per_token(m, "F", ctx) - E.layer_forward_flops_per_token(m, "S", ctx))
    return [extra if r == "S" else 0.0 for r in roles]


def microbatch_tokens(cfg, pipeline: PipelinePlan) -> int:
    if cfg.mode == "serve":
        return cfg.serve.prefill_chunk
    # per rank: with parallel.cp each rank holds seq_len / cp tokens of every sequence
    return cfg.train.seq_len // pipeline.cp * max(1, cfg.train.batch_size // (pipeline.dp * pipeline.microbatches))


def dp_shards(pipeline: PipelinePlan) -> int:
    """The ranks each stage's parameters and optimiser state are sharded over: dp x cp with parallel.dp_shard,
    else 1."""
    return pipeline.replicas if pipeline.dp_shard else 1


def _memory_by_mode(cfg, roles, indices, is_first: bool, is_last: bool, tokens: int, in_flight: int, pipeline):
    """(training memory terms, serving memory terms) of a stage of the main layers `roles` / `indices` (the terms
    add the MTP layers on the last stage); the mode's other one is {}."""
    memory, serve_memory = {}, {}
    if cfg.mode == "train":
        memory = train_memory_terms(
            cfg,
            roles,
            is_first,
            is_last,
            tokens,
            in_flight,
            pipeline.microbatches,
            layer_indices=indices,
            shards=dp_shards(pipeline),
            cp=pipeline.cp,
        )
    if cfg.mode == "serve":
        serve_memory = serve_memory_terms(cfg, roles, indices, is_first, is_last, serve_width(str(cfg.serve.dtype)))
    return memory, serve_memory


def _stage_estimate(
    cfg, ls: Sequence[LayerPlan], st: StagePlan, is_last: bool, pipeline: PipelinePlan, tokens: int
) -> Dict[str, Any]:
    """One stage's entry of `stages`: its layers `ls`, parameters, FLOPs, KV cache, activations and memory."""
    m, L_save = cfg.model, cfg.estimate_context
    is_first = st.index == 0
    # the MTP layers (last stage) count as F layers of the stage, plus their own tensors and heads
    main_roles, main_indices = [l.role for l in ls], [l.index for l in ls]  # the memory terms add the MTP layers
    roles, indices = E.with_mtp(m, main_roles, main_indices, is_last)
    n_mtp = len(roles) - len(ls)
    n_f = roles.count("F")
    n_s = len(roles) - n_f
    moe = [is_moe_layer(m, i) for i in indices]
    params = sum(E.layer_params(m, r, x) for r, x in zip(roles, moe))
    active = sum(E.layer_params(m, r, x, active=True) for r, x in zip(roles, moe))
    cost = sum(E.layer_forward_flops_per_token(m, r, cost_context(cfg), x) for r, x in zip(roles, moe))
    recompute = str(cfg.train.recompute) if cfg.mode == "train" else "none"
    act = sum(E.activation_bytes_per_token(m, r, recompute, moe=x) for r, x in zip(roles, moe))
    act += E.rope_table_bytes_per_token(m)
    act += E.head_activation_bytes_per_token(m) if is_last else E.stage_output_bytes_per_token(m)
    act *= tokens
    ends = (E.embed_params(m) if is_first else 0) + (E.head_params(m) + E.mtp_extra_params(m) if is_last else 0)
    params, active = params + ends, active + ends
    cost += (1 + n_mtp) * E.head_forward_flops_per_token(m) + n_mtp * 4 * m.dim * m.dim if is_last else 0
    in_flight = microbatches_in_flight(st.index, st.rank, pipeline)
    memory, serve_memory = _memory_by_mode(
        cfg, main_roles, main_indices, is_first, is_last, tokens, in_flight, pipeline
    )
    kv_per_token = sum(E.kv_bytes_per_token(m, r) for r in roles)
    return {
        "index": st.index,
        "rank": st.rank,
        "num_layers": len(ls),
        # MTP layers on this stage (the last), counted in the fields below: F layers, params (their blocks, embedding
        # copies, eh_proj and norms), FLOPs, activations, KV cache and memory
        "mtp_layers": n_mtp,
        "mtp_params": sum(E.layer_params(m, "F", is_moe_layer(m, i)) for i in indices[len(ls) :])
        + (E.mtp_extra_params(m) if is_last else 0),
        "f_layers": n_f,
        "s_layers": n_s,
        "promoted": sum(l.promoted for l in ls),
        "params": params,
        # the parameters one token runs (a MoE layer's chosen experts only), embedding and head included
        "active_params": active,
        "moe_layers": sum(moe),
        "indexer_params_saved": n_s * E.indexer_params(m),
        "indexer_flops_saved_per_token": n_s * E.indexer_flops_per_query(m, L_save),
        "indexer_flops_saved_prefill": n_s * E.indexer_flops_prefill(m, L_save),
        "indexer_flops_per_token": n_f * E.indexer_flops_per_query(m, L_save),
        "kv_cache_bytes_per_token": kv_per_token,
        "kv_cache_bytes_per_seq": kv_per_token * m.max_seq_len,
        # what a serving engine allocates: serve.max_batch sequences of serve.max_context tokens
        "kv_cache_bytes_serve": kv_per_token * cfg.serve.max_batch * cfg.serve.max_context,
        "activation_bytes_per_microbatch": act,
        "microbatches_in_flight": in_flight,
        "activation_bytes_peak": act * in_flight,
        # training on a GPU under bf16 autocast, by term (dsaflow.plan.memory); {} when serving
        "train_memory_bytes": memory,
        # serving on a GPU in serve.weights' format, by term (dsaflow.plan.serve_memory); {} when training
        "serve_memory_bytes": serve_memory,
        "train_peak_bytes": sum(memory.values()),
        # parallel.cp: what one rank receives per microbatch for each layer's keys (gather, gather again, reduce-scatter)
        "cp_comm_bytes_per_layer": [
            E.cp_comm_bytes_per_layer(m, r, tokens * pipeline.cp, pipeline.cp, recompute) for r in roles
        ],
        "forward_flops_per_token": cost,
    }


def _boundary_estimate(cfg, st: StagePlan, first: LayerPlan, tokens: int, seq: int) -> Dict[str, Any]:
    """The boundary after stage `st`, whose next stage opens with layer `first`: what sending the previous stage's
    indices (which would let a promoted layer stay S) costs against recomputing them; these are the two sides."""
    m, L_save = cfg.model, cfg.estimate_context
    return {
        "after_stage": st.index,
        "first_layer": first.index,
        "declared": first.declared,
        "promoted": first.promoted,
        "index_payload_bytes_per_microbatch": E.index_payload_bytes(m, tokens, seq),
        "recompute_indexer_flops_per_microbatch": max(1, tokens // seq) * E.indexer_flops_prefill(m, seq),
        "index_payload_bytes_per_decode_token": E.index_payload_bytes(m, 1, L_save),
        "recompute_indexer_flops_per_decode_token": E.indexer_flops_per_query(m, L_save),
        "recompute_indexer_params": E.indexer_params(m),
    }


def _totals(cfg, layers: Sequence[LayerPlan], per_stage: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The whole model's sums over its stages and layers."""
    m, L_save = cfg.model, cfg.estimate_context
    n_f_all = sum(l.role == "F" for l in layers)
    n_s_all = len(layers) - n_f_all
    return {
        "params": sum(s["params"] for s in per_stage),
        "active_params": sum(s["active_params"] for s in per_stage),
        "f_layers": n_f_all,
        "s_layers": n_s_all,
        "promoted": sum(l.promoted for l in layers),
        "indexer_flops_saved_per_token": n_s_all * E.indexer_flops_per_query(m, L_save),
        "indexer_flops_all_full_per_token": len(layers) * E.indexer_flops_per_query(m, L_save),
        "sparse_attn_flops_per_token": len(layers) * E.sparse_attn_flops_per_query(m, L_save),
        "kv_cache_bytes_per_seq": sum(s["kv_cache_bytes_per_seq"] for s in per_stage),
    }


def build_estimates(
    cfg, layers: Sequence[LayerPlan], stages: Sequence[StagePlan], pipeline: PipelinePlan
) -> Dict[str, Any]:
    """The plan's `estimates` object: per stage, per boundary, the totals, the cost balance and (serve mode) the KV
    tokens that fit."""
    seq = cfg.train.seq_len if cfg.mode == "train" else cfg.serve.prefill_chunk
    tokens = microbatch_tokens(cfg, pipeline)
    last = len(stages) - 1
    per_stage = [
        _stage_estimate(cfg, [layers[i] for i in st.layers], st, st.index == last, pipeline, tokens) for st in stages
    ]
    boundaries = [
        _boundary_estimate(cfg, st, layers[nxt.layers[0]], tokens, seq) for st, nxt in zip(stages, stages[1:])
    ]
    # serving: each rank's KV tokens that fit on plan.device_memory_gib (and the stages' serve_* fields)
    serve = serve_estimates(cfg, layers, stages, per_stage) if cfg.mode == "serve" else None
    costs = [s["forward_flops_per_token"] for s in per_stage]
    return {
        "savings_context": cfg.estimate_context,
        "kv_context": cfg.model.max_seq_len,
        "microbatch_tokens": tokens,
        "microbatch_seq_len": seq,
        "cost_context": cost_context(cfg),
        "stages": per_stage,
        "boundaries": boundaries,
        "total": _totals(cfg, layers, per_stage),
        "balance": (max(costs) / (sum(costs) / len(costs))) if costs else 1.0,
        "serve": serve,
        "assumptions": (
            "bf16 activations and caches, int32 indices; FLOPs = 2 per multiply-add, matmuls only; indexer FLOPs = "
            "2*L*Hi*Di scores + q/k/weights projections; activations and training memory per dsaflow.plan.memory "
            "(docs/training.md); one index group (indices shared by all heads)."
        ),
    }
