"""A training stage's peak memory, term by term: what the plan table prints and the pre-launch check refuses on.

    weights and AdamW state   fp32 weights and two fp32 moments (12 bytes per parameter), plus the bf16 copies
                              autocast makes of every matmul weight (2 bytes) and autograd keeps until the backward;
                              sharded over dp (parallel.dp_shard, FSDP2): the fp32 shard and its moments, 12 / dp
                              bytes, plus the whole stage's gathered fp32 weights (4 bytes), which stay gathered for
                              every microbatch of the pipeline step
    gradients                 fp32 (4 bytes per parameter): all of them once a backward has run while other
                              microbatches are still in flight (1F1B's steady state), else those of the layer being
                              backpropagated and the head; sharded over dp they are still whole during the step
                              (reduce-scattered once, after the last microbatch's backward)
    activations               one microbatch's (`estimates.activation_bytes_per_token` under the recompute mode, per
                              layer, + RoPE tables + the stage output, or on the last stage what the loss head in
                              chunks keeps: its input and one log-sum-exp per token, no logits), times the
                              microbatches the schedule holds at once on this stage
                              (`schedule.microbatches_in_flight`)
    backward transient        the largest one layer's backward allocates on top
                              (`estimates.layer_backward_transient_bytes`); on the last stage the loss head's chunk
                              of logits (`estimates.head_transient_bytes`, train.loss_chunk_tokens) when larger: it
                              never coexists with a layer's backward

Serving memory is dsaflow.plan.serve_memory's.

Device: on a GPU with `train.dtype` auto or bf16 the compute dtype is bf16 under autocast; otherwise fp32 (CPU
training, `train.dtype=fp32`), where activations are 4 bytes and there are no autocast copies.
"""

from __future__ import annotations

from collections.abc import Sequence

from dsaflow.config.moe_schema import is_moe_layer
from dsaflow.plan import estimates as E

WEIGHTS = "weights and AdamW state"
GRADS = "gradients"
ACTIVATIONS = "activations"
TRANSIENT = "one layer's backward transient"  # on the last stage also the loss head's chunk, if larger


def compute_dtype(cfg, device_type: str) -> tuple[int, bool]:
    """(bytes per activation element, autocast on) for a training run on `device_type`."""
    dtype = str(cfg.train.dtype)
    autocast = dtype == "bf16" or (dtype == "auto" and device_type == "cuda")
    return (E.BF16 if autocast else E.FP32), autocast


def train_memory_terms(
    cfg,
    roles: Sequence[str],
    first: bool,
    last: bool,
    tokens: int,
    in_flight: int,
    microbatches: int,
    device_type: str = "cuda",
    layer_indices: Sequence[int] | None = None,
    shards: int = 1,
    cp: int = 1,
) -> dict[str, int]:
    """{term: bytes} for one training stage holding layers of `roles`, `microbatches` (the plan's) of `tokens`
    tokens each, `in_flight` of them at once (see the module docstring). layer_indices: the layers' global indices,
    which say which are MoE layers (required for a model with `model.moe`); every expert's weights, gradients and
    AdamW state count. shards: the dp (x cp) ranks the stage's parameters and AdamW state are sharded over (1 =
    none). cp: context-parallel ranks (`tokens` are this rank's share of cp x tokens): a layer's transient adds the
    keys gathered from every rank (`estimates.cp_gathered_key_bytes`)."""
    m, t = cfg.model, cfg.train
    width, autocast = compute_dtype(cfg, device_type)
    recompute = str(t.recompute)
    if layer_indices is None and m.moe is not None:
        raise ValueError("train_memory_terms: a model with model.moe needs layer_indices (which layers are MoE)")
    roles, layer_indices = E.with_mtp(m, roles, layer_indices, last)  # the MTP layers ride on the last stage
    moe = [is_moe_layer(m, i) for i in layer_indices] if layer_indices is not None else [False] * len(roles)
    layer_params = [E.layer_params(m, r, x) for r, x in zip(roles, moe)]
    edge = (E.embed_params(m) if first else 0) + (E.head_params(m) + E.mtp_extra_params(m) if last else 0)
    params = sum(layer_params) + edge
    copies = (params - (E.embed_params(m) if first else 0)) * E.BF16 if autocast else 0
    every_grad = microbatches > in_flight
    grads = 4 * (params if every_grad else max(layer_params, default=0) + (E.head_params(m) if last else 0))
    per_token = sum(E.activation_bytes_per_token(m, r, recompute, width, autocast, x) for r, x in zip(roles, moe))
    per_token += E.rope_table_bytes_per_token(m)
    per_token += E.head_activation_bytes_per_token(m) if last else E.stage_output_bytes_per_token(m)
    gathered = {r: E.cp_gathered_key_bytes(m, r, tokens * cp, width) if cp > 1 else 0 for r in roles}
    transient = max(
        (
            E.layer_backward_transient_bytes(m, r, tokens, recompute, t.recompute_chunk_tokens, width, autocast, x)
            + gathered[r]
            for r, x in set(zip(roles, moe))
        ),
        default=0,
    )
    if last:
        transient = max(transient, E.head_transient_bytes(m, tokens, t.loss_chunk_tokens, width))
    # sharded: the rank's fp32 shard and moments, plus the gathered weights the whole step computes with
    weights = 12 * params if shards == 1 else -(-12 * params // shards) + 4 * params
    return {
        WEIGHTS: weights + copies,
        GRADS: grads,
        ACTIVATIONS: per_token * tokens * in_flight,
        TRANSIENT: transient,
    }


def largest_term_fix(name: str) -> str:
    """What shrinks each term, for the pre-launch check's message."""
    if name in (ACTIVATIONS, TRANSIENT):
        return (
            "recompute more (train.recompute=attention keeps each layer's attention inputs, "
            "train.recompute=block only each layer's input), fewer tokens per microbatch (train.batch_size / "
            "pipeline.microbatches sequences of train.seq_len), more pipeline stages (pipeline.stages) so "
            "each holds fewer layers, or context parallelism (parallel.cp) so each rank holds a share of every "
            "sequence"
        )
    return "more pipeline stages (pipeline.stages), so each rank holds fewer layers"
