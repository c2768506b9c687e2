"""The DSA model on CPU: architecture, state-dict contract, F/S roles, sparse vs dense, partition-independent init."""

import dataclasses

import pytest
import torch
from model_helpers import planned, tokens

from dsaflow.config.schema import ModelConfig
from dsaflow.model import DSABlock, IndexSlot, LayerSpec, StageModule, build_model, full_state_dict
from dsaflow.model.context import TrainContext, causal_indices
from dsaflow.model.rope import apply_rope, rope_angles
from dsaflow.pipeline.stages import build_stages, stage_module
from dsaflow.plan.estimates import layer_params


def run_stages(stages, x, **kw):
    for s in stages:
        x = s(x, **kw)
    return x


@pytest.mark.parametrize("layout", ["FSSS|FSSS", "FSSSSS|SS"])  # the second promotes layer 6 to F
def test_param_count_equals_planner_estimate_and_s_layers_have_no_indexer(layout):
    model, plan = planned(layout)
    stages = build_stages(model, plan)
    for stage, est in zip(stages, plan.estimates["stages"]):
        assert sum(p.numel() for p in stage.parameters()) == est["params"]
        for key, layer in stage.layers.items():
            role = plan.layer(int(key)).role
            assert layer.role == role and sum(p.numel() for p in layer.parameters()) == layer_params(model, role)
            has_indexer = any(".indexer." in n for n, _ in layer.named_parameters(prefix=f"layers.{key}"))
            assert has_indexer == (role == "F") and (layer.attn.indexer is None) == (role == "S")
    f_layers = sorted({int(n.split(".")[1]) for s in stages for n, _ in s.named_parameters() if ".indexer." in n})
    assert f_layers == [l.index for l in plan.layers if l.role == "F"] == ([0, 4] if layout == "FSSS|FSSS" else [0, 6])


MLA_KEYS = [
    "attn_norm.weight",
    "attn.wq_a.weight",
    "attn.q_norm.weight",
    "attn.wq_b.weight",
    "attn.wkv_a.weight",
    "attn.kv_norm.weight",
    "attn.wkv_b.weight",
    "attn.wo.weight",
    "ffn_norm.weight",
    "mlp.w1.weight",
    "mlp.w3.weight",
    "mlp.w2.weight",
]
INDEXER_KEYS = [
    "attn.indexer.wq_b.weight",
    "attn.indexer.wk.weight",
    "attn.indexer.k_norm.weight",
    "attn.indexer.k_norm.bias",
    "attn.indexer.weights_proj.weight",
]


def test_state_dict_keys_are_the_documented_contract():
    model, plan = planned("FSSS|FSSS")
    s0, s1 = build_stages(model, plan)
    expect0 = {"embed.weight"} | {f"layers.{i}.{k}" for i in range(4) for k in MLA_KEYS}
    expect0 |= {f"layers.0.{k}" for k in INDEXER_KEYS}
    expect1 = {"norm.weight", "head.weight"} | {f"layers.{i}.{k}" for i in range(4, 8) for k in MLA_KEYS}
    expect1 |= {f"layers.4.{k}" for k in INDEXER_KEYS}
    assert set(s0.state_dict()) == expect0 and set(s1.state_dict()) == expect1
    assert s0.state_dict()["layers.0.attn.wkv_b.weight"].shape == (model.n_heads * 32, model.kv_lora_rank)
    assert s0.embed is not None and s0.head is None and s1.embed is None and s1.norm is not None


@torch.no_grad()
def test_stages_built_separately_get_the_single_stage_weights_and_logits():
    model, plan1 = planned("FSSSFSSS")
    _, plan2 = planned("FSSS|FSSS")
    (one,) = build_stages(model, plan1, seed=3)
    two = build_stages(model, plan2, seed=3)
    sd1, sd2 = one.state_dict(), full_state_dict(two)
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    other = build_stages(model, plan2, seed=4)[0].state_dict()
    assert not torch.equal(other["layers.0.attn.wq_a.weight"], sd1["layers.0.attn.wq_a.weight"])
    x = tokens(2, 12)
    torch.testing.assert_close(run_stages(two, x), one(x), rtol=0, atol=0)


@torch.no_grad()
def test_absorbed_mla_equals_textbook_mla_attention():
    """MQA-mode (absorbed) MLA over all causal keys == per-head K = [W_UK c | k_pe], V = W_UV c attention, float64."""
    model, plan = planned("FSSS", "model.num_layers=4", "model.init_std=0.3")
    block = DSABlock(model, plan.layer(1))  # an S layer; dense mode needs no indices
    torch.manual_seed(0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    B, T, H, N, R, C, V = (
        2,
        7,
        model.n_heads,
        model.qk_nope_head_dim,
        model.qk_rope_head_dim,
        model.kv_lora_rank,
        model.v_head_dim,
    )
    x = torch.randn(B, T, model.dim)
    pos = torch.arange(T).expand(B, T)
    ctx = TrainContext(
        pos, rope_angles(pos, R, model.rope_theta), rope_angles(pos, 8, model.rope_theta), "dense", IndexSlot()
    )
    got = block.attn(x, ctx)

    a = block.attn.double()
    xd = x.double()
    cos, sin = (t.double() for t in ctx.rope_mla)
    q = a.wq_b(a.q_norm(a.wq_a(xd))).view(B, T, H, N + R)
    c_kv, k_pe = a.wkv_a(xd).split([C, R], -1)
    kv = a.wkv_b(a.kv_norm(c_kv)).view(B, T, H, N + V)
    k = torch.cat([kv[..., :N], apply_rope(k_pe, cos, sin).unsqueeze(2).expand(B, T, H, R)], -1)
    qf = torch.cat([q[..., :N], apply_rope(q[..., N:], cos, sin)], -1)
    s = torch.einsum("bthd,bshd->bhts", qf, k) * (N + R) ** -0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("bhts,bshv->bthv", s.softmax(-1), kv[..., N:]).reshape(B, T, H * V)
    torch.testing.assert_close(got.double(), a.wo(o), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_sparse_equals_dense_when_topk_covers_the_sequence_and_differs_otherwise():
    T = 12
    model, plan = planned("FSSS|FSSS", "model.init_std=0.3", f"model.index_topk={T}")
    stages = build_stages(model, plan)
    x = tokens(2, T, seed=1)
    dense = run_stages(stages, x, attn="dense")
    torch.testing.assert_close(run_stages(stages, x, attn="sparse"), dense, rtol=1e-4, atol=1e-4)
    model4, plan4 = planned("FSSS|FSSS", "model.init_std=0.3", "model.index_topk=4")
    stages4 = build_stages(model4, plan4)
    assert (run_stages(stages4, x, attn="sparse") - dense).abs().max() > 1e-2  # selection really matters


@torch.no_grad()
def test_s_layer_given_source_indices_equals_f_layer_recomputing_them():
    model, plan = planned("FSSS", "model.num_layers=4", "model.init_std=0.3", "model.index_topk=5")
    f_block = DSABlock(model, plan.layer(0))
    s_block = DSABlock(model, plan.layer(1))
    s_block.source = s_block.attn.source = 0  # S layer 1 reads layer 0's indices, as planned
    missing, unexpected = s_block.load_state_dict(f_block.state_dict(), strict=False)
    assert missing == [] and all(".indexer." in k for k in unexpected) and unexpected
    x = torch.randn(2, 11, model.dim)
    pos = torch.arange(11).expand(2, 11)

    def ctx(slot):
        return TrainContext(
            pos, rope_angles(pos, 8, model.rope_theta), rope_angles(pos, 8, model.rope_theta), "sparse", slot
        )

    slot = IndexSlot()
    out_f = f_block(x, ctx(slot))
    assert slot.writer == 0 and slot.indices.shape == (2, 11, 5)
    torch.testing.assert_close(s_block(x, ctx(slot)), out_f, rtol=0, atol=0)
    other = IndexSlot()
    other.write(0, causal_indices(pos, 11)[..., -5:].flip(-1).contiguous())  # a different (valid) key set
    assert (s_block(x, ctx(other)) - out_f).abs().max() > 1e-3


@torch.no_grad()
def test_padding_queries_leave_real_tokens_unchanged():
    model, plan = planned("FSSS|FSSS", "model.init_std=0.3", "model.index_topk=4")
    stages = build_stages(model, plan)
    x = tokens(1, 9, seed=2)
    ref = run_stages(stages, x)
    padded = torch.cat([x, tokens(1, 3, seed=5)], dim=1)
    pos = torch.cat([torch.arange(9), torch.full((3,), -1)]).unsqueeze(0)
    out = run_stages(stages, padded, positions=pos)
    torch.testing.assert_close(out[:, :9], ref, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(out).all()


def test_user_mistakes_raise_clear_errors():
    model, plan = planned("FSSS|FSSS")
    layers = list(plan.layers)
    layers[5] = dataclasses.replace(layers[5], source=0)  # a hand-edited plan.json: source on another stage
    with pytest.raises(ValueError, match="S layer 5 on stage 1 has source=0"):
        stage_module(model, dataclasses.replace(plan, layers=tuple(layers)), 1)
    with pytest.raises(ValueError, match="attn='topk'"):
        build_stages(model, plan)[0](tokens(1, 4), attn="topk")
    tied, plan = planned("FSSS|FSSS", "model.tie_embeddings=true")
    with pytest.raises(ValueError, match="tie_embeddings"):
        stage_module(tied, plan, 0)
    tied1, plan1 = planned("FSSSFSSS", "model.tie_embeddings=true")
    (single,) = build_stages(tied1, plan1)
    assert single.head.weight is single.embed.weight


def test_a_block_and_a_whole_model_build_from_a_model_config_alone():
    """No plan, no Hydra: a block from ModelConfig() (layer 0, F), an S block from a LayerSpec, the whole model."""
    cfg = ModelConfig()
    block = DSABlock(cfg)
    assert block.role == "F" and block.attn.indexer is not None
    s_block = DSABlock(cfg, LayerSpec(index=3, role="S", source=1))
    assert s_block.source == 1 and s_block.attn.indexer is None
    with pytest.raises(ValueError, match="earlier F layer"):
        DSABlock(cfg, LayerSpec(index=2, role="S", source=2))
    model = build_model(cfg, roles="FSSS" * (cfg.num_layers // 4), seed=0)
    assert isinstance(model, StageModule) and model.is_first and model.is_last
    assert [l.source for l in model.layers.values()] == [0, 0, 0, 0, 4, 4, 4, 4][: cfg.num_layers]
    out = model(tokens(1, 12))
    assert out.shape == (1, 12, cfg.vocab_size) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="starting with F"):
        build_model(cfg, roles="S" * cfg.num_layers)
