"""Closed-form size, FLOP and byte estimates for one DSA layer, its caches and its activations.

The parameter counts are exact for the model in `dsaflow.model` (all Linear layers without bias; a test checks the
built model against `layer_params`). FLOPs count a multiply-add as 2 and cover matmuls only (no norms, softmax,
RoPE or top-k selection). Bytes assume bf16 (2 bytes) for activations and caches and int32 for indices.
"""
from __future__ import annotations

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


def mlp_params(m) -> int:
    """Dense SwiGLU: w1, w3 [dim -> inter], w2 [inter -> dim]."""
    return 3 * m.dim * m.inter_dim


def layer_params(m, role: str) -> int:
    """Parameters of one DSA block: attn_norm + MLA + ffn_norm + MLP, plus the indexer on F layers only."""
    if role not in ("F", "S"):
        raise ValueError(f"role must be 'F' or 'S', got {role!r}")
    base = m.dim + mla_params(m) + m.dim + mlp_params(m)
    return base + (indexer_params(m) if role == "F" else 0)


def embed_params(m) -> int:
    """First stage: Embedding(vocab, dim)."""
    return m.vocab_size * m.dim


def head_params(m) -> int:
    """Last stage: final RMSNorm(dim) + Linear(dim, vocab) (embeddings are not tied)."""
    return m.dim + m.dim * m.vocab_size


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


def layer_matmul_flops_per_token(m, role: str) -> int:
    """Projection FLOPs of one block per token (2 per weight; norms are not matmuls)."""
    norms = 2 * m.dim + m.q_lora_rank + m.kv_lora_rank
    weights = layer_params(m, "S") - norms
    flops = 2 * weights
    if role == "F":
        flops += indexer_proj_flops_per_token(m)
    return flops


def layer_forward_flops_per_token(m, role: str, context: int) -> int:
    """Forward FLOPs per token at a given attention context: projections + sparse attention (+ indexer scores on
    F layers). This is the per-layer cost the `balance=cost` stage split uses."""
    flops = layer_matmul_flops_per_token(m, role) + sparse_attn_flops_per_query(m, context)
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


def attention_recompute_elems_per_token(m) -> int:
    """What `train.recompute=attention` does not keep per token of a layer (bf16 elements): the absorbed query
    H*(kv_lora+rope), the attention output H*kv_lora and its up-projection H*v_head. The backward of one layer
    rebuilds them and their gradients: about twice this, transient."""
    h = m.n_heads
    return h * (m.kv_lora_rank + m.qk_rope_head_dim) + h * m.kv_lora_rank + h * m.v_head_dim


def activation_bytes_per_token(m, role: str, recompute_attention: bool = False) -> int:
    """Rough activations one block keeps for backward per token (bf16 unless noted):
    block input + 2 norm outputs + residual (4*dim), q path (2*q_lora + H*(nope+rope)), kv latent and its norm
    (kv_lora+rope + kv_lora), absorbed query H*(kv_lora+rope), attention output H*kv_lora and after up-projection
    H*v_head (the last three not with recompute_attention), MLP (3*inter: w1, w3, silu*gate); F layers add
    indexer q (Hi*Di), k (Di), weights (Hi) and the top-k indices (topk int32) the stage's S layers read."""
    h = m.n_heads
    elems = (
        4 * m.dim
        + 2 * m.q_lora_rank
        + h * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        + (m.kv_lora_rank + m.qk_rope_head_dim)
        + m.kv_lora_rank
        + (0 if recompute_attention else attention_recompute_elems_per_token(m))
        + 3 * m.inter_dim
    )
    extra = 0
    if role == "F":
        elems += m.index_n_heads * m.index_head_dim + m.index_head_dim + m.index_n_heads
        extra = m.index_topk * INT32
    return elems * BF16 + extra


def head_activation_bytes_per_token(m) -> int:
    """Last stage: final norm output (bf16) + fp32 logits for the loss."""
    return m.dim * BF16 + m.vocab_size * FP32


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


def train_flops_per_token(m, roles_and_served: "list[tuple[str, int]]", seq_len: int, params_no_embed: int) -> float:
    """Training FLOPs per token of a DSA model: 6 per non-embedding parameter (forward + backward matmuls) plus
    the sparse attention of every layer and the indexer (scores and its loss) of every F layer.
    roles_and_served: (role, number of layers an F layer serves incl. itself; ignored for S) per layer."""
    total = 6.0 * params_no_embed
    for role, served in roles_and_served:
        total += sparse_attn_train_flops_per_token(m, seq_len)
        if role == "F":
            total += indexer_train_flops_per_token(m, seq_len, served)
    return total
