"""Estimates against independent counts: a torch module built from the spec, FLOP sums done the long way."""

import pytest
import torch.nn as nn

from dsaflow.config.schema import ModelConfig
from dsaflow.plan import build_plan
from dsaflow.plan import estimates as E
from tests.planner_helpers import make_cfg


class SpecBlock(nn.Module):
    """The DSA block exactly as the estimate documents it, written out independently (no bias anywhere)."""

    def __init__(self, m: ModelConfig, role: str):
        super().__init__()
        L = lambda i, o: nn.Linear(i, o, bias=False)  # noqa: E731
        h = m.n_heads
        self.attn_norm = nn.RMSNorm(m.dim)
        self.wq_a, self.q_norm = L(m.dim, m.q_lora_rank), nn.RMSNorm(m.q_lora_rank)
        self.wq_b = L(m.q_lora_rank, h * (m.qk_nope_head_dim + m.qk_rope_head_dim))
        self.wkv_a, self.kv_norm = L(m.dim, m.kv_lora_rank + m.qk_rope_head_dim), nn.RMSNorm(m.kv_lora_rank)
        self.wkv_b = L(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim))
        self.wo = L(h * m.v_head_dim, m.dim)
        self.ffn_norm = nn.RMSNorm(m.dim)
        self.w1, self.w3, self.w2 = L(m.dim, m.inter_dim), L(m.dim, m.inter_dim), L(m.inter_dim, m.dim)
        if role == "F":
            self.idx_wq_b = L(m.q_lora_rank, m.index_n_heads * m.index_head_dim)
            self.idx_wk = L(m.dim, m.index_head_dim)
            self.idx_k_norm = nn.LayerNorm(m.index_head_dim)
            self.idx_weights = L(m.dim, m.index_n_heads)


def count(module):
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("name", ["tiny", "dsv32_shapes"])
@pytest.mark.parametrize("role", ["F", "S"])
def test_layer_params_match_an_independent_module(name, role):
    m = ModelConfig()
    if name == "dsv32_shapes":  # same ratios as DeepSeek-V3.2, scaled down 16x so the module stays small
        m = ModelConfig(
            dim=448,
            n_heads=8,
            q_lora_rank=96,
            kv_lora_rank=32,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
            index_n_heads=4,
            index_head_dim=8,
            inter_dim=1152,
            vocab_size=300,
        )
    assert E.layer_params(m, role) == count(SpecBlock(m, role))
    assert E.layer_params(m, "F") - E.layer_params(m, "S") == E.indexer_params(m)
    assert E.embed_params(m) == count(nn.Embedding(m.vocab_size, m.dim))
    assert E.head_params(m) == count(nn.RMSNorm(m.dim)) + count(nn.Linear(m.dim, m.vocab_size, bias=False))


def test_bad_role_is_rejected():
    with pytest.raises(ValueError):
        E.layer_params(ModelConfig(), "X")


def test_indexer_prefill_flops_equal_the_sum_over_queries():
    m = ModelConfig()
    T = 37
    assert E.indexer_flops_prefill(m, T) == sum(E.indexer_flops_per_query(m, t) for t in range(1, T + 1))


def test_dsv32_numbers_at_128k():
    m = ModelConfig(
        dim=7168,
        n_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=2048,
    )
    L = 128 * 1024
    scores = 2 * L * 64 * 128
    proj = 2 * (1536 * 64 * 128 + 7168 * 128 + 7168 * 64)
    assert E.indexer_flops_per_query(m, L) == scores + proj
    assert E.sparse_attn_flops_per_query(m, L) == 2 * 128 * 2048 * (576 + 512)
    assert E.sparse_attn_flops_per_query(m, 100) == 2 * 128 * 100 * (576 + 512)  # k = min(topk, context)
    assert E.kv_bytes_per_token(m, "S") == 576 * 2 and E.kv_bytes_per_token(m, "F") == 576 * 2 + 128 * 2
    assert E.index_payload_bytes(m, 4096, L) == 4096 * 2048 * 4


def test_stage_estimates_follow_roles_and_stages():
    plan = build_plan(
        make_cfg(
            layout="FSSS|SSFS",
            **{"estimate_context": 1024, "train.batch_size": 8, "pipeline.microbatches": 4, "train.seq_len": 64},
        )
    )
    m, est = make_cfg().model, plan.estimates
    s0, s1 = est["stages"]
    assert (s0["f_layers"], s0["s_layers"], s0["promoted"]) == (1, 3, 0)
    assert (s1["f_layers"], s1["s_layers"], s1["promoted"]) == (2, 2, 1)
    assert s0["params"] == E.embed_params(m) + E.layer_params(m, "F") + 3 * E.layer_params(m, "S")
    assert s1["params"] == E.head_params(m) + 2 * E.layer_params(m, "F") + 2 * E.layer_params(m, "S")
    assert s0["indexer_flops_saved_per_token"] == 3 * E.indexer_flops_per_query(m, 1024)
    assert s0["kv_cache_bytes_per_seq"] == m.max_seq_len * (4 * E.kv_bytes_per_token(m, "S") + m.index_head_dim * 2)
    assert est["microbatch_tokens"] == 64 * 2
    cfg = make_cfg()
    assert s1["kv_cache_bytes_serve"] == s1["kv_cache_bytes_per_token"] * cfg.serve.max_batch * cfg.serve.max_context
    (b,) = est["boundaries"]
    assert b["first_layer"] == 4 and b["promoted"]
    assert b["index_payload_bytes_per_microbatch"] == 128 * m.index_topk * 4
    assert b["recompute_indexer_flops_per_microbatch"] == 2 * E.indexer_flops_prefill(m, 64)
    # 1F1B: rank 0 holds 2 microbatches in flight, the last rank 1
    assert (s0["microbatches_in_flight"], s1["microbatches_in_flight"]) == (2, 1)
    assert s0["activation_bytes_peak"] == 2 * s0["activation_bytes_per_microbatch"]


def test_s_layers_save_indexer_flops_and_cache():
    full = build_plan(make_cfg()).estimates["total"]
    shared = build_plan(make_cfg(**{"index.freq": 4})).estimates["total"]
    m = make_cfg().model
    assert full["indexer_flops_saved_per_token"] == 0
    assert shared["indexer_flops_saved_per_token"] == 6 * E.indexer_flops_per_query(m, 131072)
    assert full["params"] - shared["params"] == 6 * E.indexer_params(m)
    assert full["kv_cache_bytes_per_seq"] - shared["kv_cache_bytes_per_seq"] == 6 * m.index_head_dim * 2 * m.max_seq_len
