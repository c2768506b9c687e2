"""Closed-form size, FLOP and byte estimates for one DSA layer, its caches and its activations.

The parameter counts are exact for the model in `dsaflow.model` (all Linear layers without bias; a test checks the
built model against `layer_params`). FLOPs count a multiply-add as 2 and cover matmuls only (no norms, softmax,
RoPE or top-k selection). Bytes assume bf16 (2 bytes) for activations and caches and int32 for indices.
"""

from __future__ import annotations

from dsaflow.config.moe_schema import is_moe_layer

BF16 = 2
INT32 = 4
FP32 = 4


def indexer_params(m) -> int:
    """Lightning-indexer weights of an F layer: wq_b [q_lora -> Hi*Di], wk [dim -> Di], k_norm LayerNorm(Di)
    (weight + bias), weights_proj [dim -> Hi]."""
    hi, di = m.index_n_heads, m.index_head_dim
    return m.q_lora_rank * hi * di + m.dim * di + 2 * di + m.dim * hi


def mla_params(m) -> int:
    """MLA weights: wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo."""
    h = m.n_heads
    return (
        m.dim * m.q_lora_rank
        + m.q_lora_rank
        + m.q_lora_rank * h * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        + m.dim * (m.kv_lora_rank + m.qk_rope_head_dim)
        + m.kv_lora_rank
        + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim)
        + h * m.v_head_dim * m.dim
    )


def mlp_params(m, moe: bool = False, active: bool = False) -> int:
    """Dense SwiGLU: w1, w3 [dim -> inter], w2 [inter -> dim]. A MoE MLP (`moe`): the fp32 router [E, dim], E routed
    SwiGLU experts of width moe_inter_dim (only num_experts_per_tok of them with `active`: the weights one token
    runs) and the shared experts, one SwiGLU of width n_shared * moe_inter_dim. (The router's selection bias is a
    buffer, not a parameter.)"""
    if not moe:
        return 3 * m.dim * m.inter_dim
    e = m.moe
    experts = e.num_experts_per_tok if active else e.n_routed_experts
    return e.n_routed_experts * m.dim + 3 * m.dim * e.moe_inter_dim * (experts + e.n_shared_experts)


def layer_params(m, role: str, moe: bool = False, active: bool = False) -> int:
    """Parameters of one DSA block: attn_norm + MLA + ffn_norm + MLP (a MoE MLP with `moe`; with `active` only the
    experts one token runs), plus the indexer on F layers only."""
    if role not in ("F", "S"):
        raise ValueError(f"role must be 'F' or 'S', got {role!r}")
    base = m.dim + mla_params(m) + m.dim + mlp_params(m, moe, active)
    return base + (indexer_params(m) if role == "F" else 0)


def embed_params(m) -> int:
    """First stage: Embedding(vocab, dim)."""
    return m.vocab_size * m.dim


def head_params(m) -> int:
    """Last stage: final RMSNorm(dim) + Linear(dim, vocab) (embeddings are not tied)."""
    return m.dim + m.dim * m.vocab_size


def with_mtp(m, roles, indices, last: bool):
    """(roles, global indices) of a stage's layers, with the model's MTP layers appended on the last stage: each is
    an F layer (its own indexer) of the model's kind, counted like any layer (dsaflow/model/mtp.py)."""
    if not last or not m.mtp_layers:
        return list(roles), None if indices is None else list(indices)
    mtp = list(range(m.num_layers, m.num_layers + m.mtp_layers))
    return list(roles) + ["F"] * len(mtp), None if indices is None else list(indices) + mtp


def mtp_extra_params(m) -> int:
    """What the MTP layers hold beyond their blocks, on the last stage: each its copy of the embedding (vocab x dim,
    the first stage's lives elsewhere), eh_proj (2 dim -> dim) and three RMSNorms (enorm, hnorm, head_norm)."""
    return m.mtp_layers * (m.vocab_size * m.dim + 2 * m.dim * m.dim + 3 * m.dim)


def indexer_proj_flops_per_token(m) -> int:
    """Indexer projections per token: q (from the shared q_lora latent), k and the per-head weights."""
    hi, di = m.index_n_heads, m.index_head_dim
    return 2 * (m.q_lora_rank * hi * di + m.dim * di + m.dim * hi)


def indexer_flops_per_query(m, context: int) -> int:
    """Indexer FLOPs for one query token over `context` keys: scores 2*L*Hi*Di plus its projections."""
    return 2 * context * m.index_n_heads * m.index_head_dim + indexer_proj_flops_per_token(m)


def indexer_flops_prefill(m, tokens: int) -> int:
    """Indexer FLOPs for a causal prefill of `tokens` tokens (query t sees t keys): Hi*Di*T*(T+1) + projections."""
    return m.index_n_heads * m.index_head_dim * tokens * (tokens + 1) + tokens * indexer_proj_flops_per_token(m)


def sparse_attn_flops_per_query(m, context: int) -> int:
    """Absorbed-MLA sparse attention per query: 2*H*k*(d_qk + d_v), d_qk = kv_lora + rope, d_v = kv_lora,
    k = min(topk, context)."""
    k = min(m.index_topk, context)
    return 2 * m.n_heads * k * (m.kv_lora_rank + m.qk_rope_head_dim + m.kv_lora_rank)


def layer_matmul_flops_per_token(m, role: str, moe: bool = False) -> int:
    """Projection FLOPs of one block per token (2 per weight a token runs: a MoE layer's router, chosen experts and
    shared experts; norms are not matmuls)."""
    norms = 2 * m.dim + m.q_lora_rank + m.kv_lora_rank
    weights = layer_params(m, "S", moe, active=True) - norms
    flops = 2 * weights
    if role == "F":
        flops += indexer_proj_flops_per_token(m)
    return flops


def layer_forward_flops_per_token(m, role: str, context: int, moe: bool = False) -> int:
    """Forward FLOPs per token at a given attention context: projections (a MoE layer's active ones) + sparse
    attention (+ indexer scores on F layers). This is the per-layer cost the `balance=cost` stage split uses."""
    flops = layer_matmul_flops_per_token(m, role, moe) + sparse_attn_flops_per_query(m, context)
    if role == "F":
        flops += 2 * context * m.index_n_heads * m.index_head_dim
    return flops


def head_forward_flops_per_token(m) -> int:
    return 2 * m.dim * m.vocab_size


def kv_bytes_per_token(m, role: str) -> int:
    """KV-cache bytes per token of one layer: the MLA latent row (kv_lora + rope) in bf16, plus the indexer key
    (index_head_dim) on F layers only; S layers read their source's indices and keep no indexer K."""
    latent = (m.kv_lora_rank + m.qk_rope_head_dim) * BF16
    return latent + (m.index_head_dim * BF16 if role == "F" else 0)


# ---- training memory: what one layer keeps between its forward and its backward, and its backward transient ----
# Counted from the tensors autograd saves in dsaflow.model under bf16 autocast (`width` = 2; fp32 on CPU: 4, and no
# autocast copies). The residual stream is fp32 either way; int32 indices and the fp32 indexer-loss target are exact.

# The sparse-attention backward's G buffer [chunk, 2H, K] is capped at 1 GiB (dsaflow.ops.sparse_mla backward
# configuration, g_max_bytes).
SPARSE_MLA_BWD_BUFFER = 1 << 30
RECOMPUTE_MODES = ("none", "attention", "block")


def attention_recompute_elems_per_token(m) -> int:
    """What `train.recompute=attention` does not keep per token of a layer (elements of the compute dtype): the
    absorbed query H*(kv_lora+rope) and the attention output H*kv_lora. (The output's up-projection H*v_head stays:
    the output projection saves it as its input.)"""
    h = m.n_heads
    return h * (m.kv_lora_rank + m.qk_rope_head_dim) + h * m.kv_lora_rank


def index_bytes_per_token(m) -> int:
    """What an F layer keeps for its stage until its backward, whatever the recompute mode: the top-k indices
    (int32, index_topk wide: the indexer always returns that width, -1 past the visible keys; S layers read the same
    tensor) and the indexer-loss target (fp32, the same width)."""
    return m.index_topk * (INT32 + FP32)


def mlp_activation_elems_per_token(m, moe: bool = False) -> int:
    """Elements of the compute dtype an MLP keeps for its backward per token. Dense: 4*inter (w1 and w3 outputs,
    silu, the product). MoE: per chosen expert its gathered input row and its output row (2*dim: the grouped GEMM's
    input, the weighting's input), the gate/up output (2*I), silu and the product (2*I); plus the shared experts'
    4 * n_shared * I."""
    if not moe:
        return 4 * m.inter_dim
    e = m.moe
    return e.num_experts_per_tok * (2 * m.dim + 4 * e.moe_inter_dim) + 4 * e.n_shared_experts * e.moe_inter_dim


def router_bytes_per_token(m, moe: bool = False) -> int:
    """A MoE layer's fp32 router: the input cast to fp32 (dim) and the sigmoid scores with their biased copy (2*E)."""
    return (m.dim + 2 * m.moe.n_routed_experts) * FP32 if moe else 0


def activation_bytes_per_token(
    m, role: str, recompute: str = "none", width: int = BF16, autocast: bool = True, moe: bool = False
) -> int:
    """Bytes one block keeps for its backward per token. `none`:
      fp32 residual stream: the block input and the MLP-norm input, 2*dim (4 bytes each);
      the normed inputs as the linears save them: 4*dim under autocast (each of wq_a, wkv_a, w1, w3 casts its own
      copy), 2*dim without;
      q path 2*q_lora + H*(nope+rope), kv path 2*(kv_lora+rope) (the wkv_a output and the latent rows);
      absorbed query H*(kv_lora+rope), attention output H*kv_lora (+ lse, H fp32), its up-projection H*v_head;
      MLP `mlp_activation_elems_per_token` (dense: 4*inter) and, on a MoE layer, `router_bytes_per_token`;
      F layers: the normed input again for wk and weights_proj under autocast (2*dim), indexer q Hi*Di, k Di (+ the
      fp32 LayerNorm input, Di) and weights Hi, and `index_bytes_per_token`.
    `attention` drops the absorbed query and the attention output (`attention_recompute_elems_per_token`).
    `block` keeps the block input (fp32 dim) and, on F layers, `index_bytes_per_token`: the rest is rebuilt in
    backward (`layer_backward_transient_bytes`)."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    f_only = index_bytes_per_token(m) if role == "F" else 0
    if recompute == "block":
        return m.dim * FP32 + f_only
    h = m.n_heads
    elems = (
        (4 if autocast else 2) * m.dim
        + 2 * m.q_lora_rank
        + h * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        + 2 * (m.kv_lora_rank + m.qk_rope_head_dim)
        + h * m.v_head_dim
        + mlp_activation_elems_per_token(m, moe)
    )
    extra = 2 * m.dim * FP32 + f_only + router_bytes_per_token(m, moe)
    if recompute == "none":
        elems += attention_recompute_elems_per_token(m)
        extra += h * FP32  # lse
    if role == "F":
        elems += (2 * m.dim if autocast else 0) + m.index_n_heads * m.index_head_dim + m.index_head_dim
        elems += m.index_n_heads
        extra += m.index_head_dim * FP32
    return elems * width + extra


def attention_backward_bytes_per_token(m, width: int = BF16) -> int:
    """Gradients alive at once in one layer's sparse-attention backward, per query: of the up-projected output
    H*v_head, of the attention output H*kv_lora and of the absorbed query H*(kv_lora+rope), plus the key-value rows'
    gradient (fp32 accumulation and its cast)."""
    h, d_qk = m.n_heads, m.kv_lora_rank + m.qk_rope_head_dim
    return width * h * (m.v_head_dim + m.kv_lora_rank + d_qk) + d_qk * (FP32 + width)


def moe_backward_bytes_per_token(m, width: int = BF16) -> int:
    """Gradients alive at once in a MoE MLP's backward, per token: of each chosen expert's output row, product,
    gate/up output and gathered input row (k * (2*dim + 3*I))."""
    e = m.moe
    return e.num_experts_per_tok * (2 * m.dim + 3 * e.moe_inter_dim) * width


def layer_backward_transient_bytes(
    m,
    role: str,
    tokens: int,
    recompute: str,
    chunk_tokens: int,
    width: int = BF16,
    autocast: bool = True,
    moe: bool = False,
) -> int:
    """The most one layer's backward allocates on top of the kept activations, for `tokens` queries:
    none       the attention gradients over every query, and the attention backward's G buffer;
    attention  one query chunk rebuilt (absorbed query, attention output, lse) and its gradients, and G;
    block      the whole layer rebuilt (its `none` activations, or its `attention` ones when the queries exceed a
               chunk: the attention is then recomputed in chunks inside the block), then, with its MLP part freed,
               the attention's backward as above.
    A MoE layer's MLP backward (`moe_backward_bytes_per_token`) comes before its attention's: the larger counts."""
    mlp_bwd = tokens * moe_backward_bytes_per_token(m, width) if moe else 0

    def g_buffer(n):
        return min(SPARSE_MLA_BWD_BUFFER, n * 2 * m.n_heads * m.index_topk * width)

    def chunk_transient(n):
        rebuilt = attention_recompute_elems_per_token(m) * width + m.n_heads * FP32
        return n * (rebuilt + attention_backward_bytes_per_token(m, width)) + g_buffer(n)

    if recompute == "none":
        return max(mlp_bwd, tokens * attention_backward_bytes_per_token(m, width) + g_buffer(tokens))
    chunk = min(tokens, chunk_tokens)
    if recompute == "attention":
        return max(mlp_bwd, chunk_transient(chunk))
    if tokens <= chunk_tokens:
        rebuilt = activation_bytes_per_token(m, role, "none", width, autocast, moe)
        after = tokens * attention_backward_bytes_per_token(m, width) + g_buffer(tokens)
    else:
        rebuilt = activation_bytes_per_token(m, role, "attention", width, autocast, moe)
        after = chunk_transient(chunk)
    kept = activation_bytes_per_token(m, role, "block", width, autocast, moe)
    # The backward frees the MLP's rebuilt tensors before it reaches the attention: the peak is the whole rebuilt
    # layer (with the MLP's own backward), or its attention part plus the attention's backward.
    mlp = m.dim * FP32 + (2 if autocast else 1) * m.dim * width + mlp_activation_elems_per_token(m, moe) * width
    mlp += router_bytes_per_token(m, moe)
    return max(tokens * (rebuilt - kept) + mlp_bwd, tokens * (rebuilt - kept - mlp) + after)


def head_activation_bytes_per_token(m) -> int:
    """Last stage: what the loss head in chunks (dsaflow.model.loss_head) keeps for its backward per token, the
    final hidden state (fp32 dim) and one fp32 log-sum-exp. No logits: they exist one chunk at a time
    (`head_transient_bytes`). With D = model.mtp_layers the head runs once per depth on 1 + D hidden states, which
    the stage's output also holds stacked ([b, 1 + D, T, dim] fp32; each depth's slice is copied into the head's
    rows): (1 + D) x (the above + one more fp32 dim)."""
    one_depth = m.dim * FP32 + FP32
    if not m.mtp_layers:
        return one_depth
    return (1 + m.mtp_layers) * (one_depth + m.dim * FP32)


def head_transient_bytes(m, tokens: int, chunk_tokens: int, width: int = BF16) -> int:
    """The most the loss head in chunks allocates at once for c = min(tokens, chunk_tokens) rows
    (train.loss_chunk_tokens): its forward holds a chunk's fp32 logits and logsumexp's fp32 exponentials
    (2 * c * vocab * 4); its backward the recomputed fp32 logits turned into dlogits and their cast to the compute
    dtype (c * vocab * (4 + width)), plus the head's fp32 gradient sum, one chunk's product in the compute dtype and
    its fp32 cast (vocab * dim * (4 + width + 4)), plus the head weight's compute-dtype copy (vocab * dim * width)."""
    c, v, d = min(tokens, chunk_tokens), m.vocab_size, m.dim
    forward = 2 * c * v * FP32 + v * d * width
    backward = c * v * (FP32 + width) + v * d * (FP32 + width + FP32) + v * d * width
    return max(forward, backward)


def cp_key_elems_per_token(m, role: str) -> int:
    """What context parallelism gathers per token of a layer: the latent row (kv_lora + rope) and, on F layers, the
    indexer key (index_head_dim). S layers reuse their source's indices and gather no indexer key."""
    return m.kv_lora_rank + m.qk_rope_head_dim + (m.index_head_dim if role == "F" else 0)


def cp_gathered_key_bytes(m, role: str, seq_tokens: int, width: int = BF16) -> int:
    """One layer's transient under context parallelism, for `seq_tokens` tokens of whole sequences (the gathered
    key rows are every rank's): in its backward the keys gathered again (width), their gradient over every key (fp32
    accumulation and its cast, FP32 + width) and the reduce-scatter's per-rank parts (width); the forward's gather
    (width) is smaller."""
    return seq_tokens * cp_key_elems_per_token(m, role) * (3 * width + FP32)


def cp_comm_bytes_per_layer(m, role: str, seq_tokens: int, cp: int, recompute: str, width: int = BF16) -> int:
    """Bytes one rank receives for one layer per microbatch under context parallelism of `cp` ranks: the forward's
    all-gather of the other ranks' key rows, the backward's gather again (saved keys under recompute=none, the
    block's recomputation under block) and the reduce-scatter of their gradient: 3 x (cp - 1) / cp of the
    sequences' key rows."""
    if cp == 1:
        return 0
    rows = seq_tokens * (cp - 1) // cp * cp_key_elems_per_token(m, role) * width
    return 3 * rows


def stage_output_bytes_per_token(m) -> int:
    """Non-last stages: the fp32 hidden state the pipeline keeps for the stage's backward."""
    return m.dim * FP32


def rope_table_bytes_per_token(m) -> int:
    """cos and sin (fp32, half the rotary width each) for MLA and the indexer, shared by a stage's layers."""
    return (m.qk_rope_head_dim + m.index_rope_head_dim) * FP32


def index_payload_bytes(m, tokens: int, context: int) -> int:
    """Bytes to send a stage's top-k indices across a boundary: tokens x k x int32 (one index group: the DSA
    indexer picks one key set shared by all heads)."""
    return tokens * min(m.index_topk, context) * INT32


def mean_causal_topk(m, seq_len: int) -> float:
    """Mean over the positions t = 0..T-1 of a causal sequence of the keys each query attends to, min(topk, t + 1)."""
    k, T = m.index_topk, seq_len
    if T <= k:
        return (T + 1) / 2
    return (k * (k + 1) / 2 + (T - k) * k) / T


def sparse_attn_train_flops_per_token(m, seq_len: int) -> float:
    """Sparse attention forward 2*H*k*(d_qk + d_v) plus backward 2*H*k*(3*d_qk + 2*d_v) (S, dP, dq, dkv from dS and
    P) per token, k averaged over a causal sequence."""
    d_qk, d_v = m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank
    return 2 * m.n_heads * mean_causal_topk(m, seq_len) * (4 * d_qk + 3 * d_v)


def indexer_train_flops_per_token(m, seq_len: int, served_layers: int) -> float:
    """One F layer per token: indexer scores over the causal context (forward only: top-k carries no gradient),
    Hi*Di*(T+1) on average, plus the indexer loss on its k keys: the attention target of each served layer
    (2*H*k*d_qk) and the index scores on the key set forward + backward (3 * 2*Hi*Di*k)."""
    k = mean_causal_topk(m, seq_len)
    hi_di = m.index_n_heads * m.index_head_dim
    target = 2 * m.n_heads * k * (m.kv_lora_rank + m.qk_rope_head_dim) * served_layers
    return hi_di * (seq_len + 1) + target + 3 * 2 * hi_di * k


def train_flops_per_token(m, roles_and_served: list[tuple[str, int]], seq_len: int, params_no_embed: int) -> float:
    """Training FLOPs per token of a DSA model: 6 per non-embedding parameter a token runs (forward + backward
    matmuls; a MoE layer's routed experts count only num_experts_per_tok of them) plus the sparse attention of every
    layer and the indexer (scores and its loss) of every F layer.
    roles_and_served: (role, number of layers an F layer serves incl. itself; ignored for S) per layer, in layer
    order (so position i is layer i)."""
    idle = mlp_params(m, moe=True) - mlp_params(m, moe=True, active=True) if m.moe is not None else 0
    total = 6.0 * (params_no_embed - idle * sum(is_moe_layer(m, i) for i in range(len(roles_and_served))))
    for role, served in roles_and_served:
        total += sparse_attn_train_flops_per_token(m, seq_len)
        if role == "F":
            total += indexer_train_flops_per_token(m, seq_len, served)
    return total
