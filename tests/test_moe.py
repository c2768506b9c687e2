"""MoE layers: the router against its per-token reference (group limit and bias included), the routed experts against
the per-expert fp32 loop, forward and every gradient, the Triton grouped GEMMs under the interpreter, and the
balancing state (expert load, bias update, sequence-wise balance loss)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsaflow.config.moe_schema import MoEConfig
from dsaflow.config.schema import ModelConfig
from dsaflow.model import build_model, moe_layers, update_expert_bias
from dsaflow.model.moe import MoE, Router, expert_load_balance, sequence_balance_loss
from dsaflow.ops.moe import explain_grouped_mm, moe_experts, moe_experts_naive, route_naive, sort_by_expert


def _router(dim: int, moe: MoEConfig, seed: int) -> Router:
    g = torch.Generator().manual_seed(seed)
    r = Router(dim, moe)
    with torch.no_grad():
        r.weight.copy_(torch.randn(r.weight.shape, generator=g))
        r.e_score_correction_bias.copy_(torch.randn(moe.n_routed_experts, generator=g) * 0.3)
    return r


@settings(max_examples=60, deadline=None)
@given(
    groups=st.sampled_from([1, 2, 4]),
    per_group=st.sampled_from([2, 3, 4]),
    data=st.data(),
    seed=st.integers(0, 10_000),
)
def test_router_selects_what_the_per_token_reference_selects(groups, per_group, data, seed):
    experts = groups * per_group
    topk_group = data.draw(st.integers(1, groups))
    top_k = data.draw(st.integers(1, topk_group * per_group))
    norm = data.draw(st.booleans())
    moe = MoEConfig(
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        n_group=groups,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=2.5,
    )
    router = _router(16, moe, seed)
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(seed + 1))
    ids, weights, _ = router(x)
    ref_ids, ref_w = route_naive(x, router.weight, router.e_score_correction_bias, top_k, groups, topk_group, norm, 2.5)
    assert [sorted(r) for r in ids.tolist()] == [sorted(r) for r in ref_ids.tolist()]
    # the weights follow their experts, whatever order top-k returns them in
    got = {(t, e): w for t in range(9) for e, w in zip(ids[t].tolist(), weights[t].tolist())}
    want = {(t, e): w for t in range(9) for e, w in zip(ref_ids[t].tolist(), ref_w[t].tolist())}
    assert got.keys() == want.keys()
    assert all(abs(got[k] - want[k]) <= 1e-5 * max(1.0, abs(want[k])) for k in want)


def test_the_bias_selects_but_does_not_weigh():
    moe = MoEConfig(n_routed_experts=8, num_experts_per_tok=2, norm_topk_prob=False)
    router = _router(16, moe, 0)
    x = torch.randn(32, 16)
    with torch.no_grad():
        router.e_score_correction_bias.zero_()
        router.e_score_correction_bias[5] = 10.0  # expert 5 wins every token's choice
    ids, weights, scores = router(x)
    assert (ids == 5).any(dim=1).all()
    # its weight is its unbiased sigmoid score, never score + bias
    slot = (ids == 5).int().argmax(dim=1)
    assert torch.allclose(weights.gather(1, slot[:, None]).squeeze(1), scores[:, 5])


def test_groups_outside_the_kept_ones_are_never_chosen():
    moe = MoEConfig(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=1)
    router = _router(16, moe, 3)
    ids, _, _ = router(torch.randn(64, 16))
    assert ((ids // 2)[:, 0] == (ids // 2)[:, 1]).all()  # both experts of a token come from its one kept group


def _expert_inputs(N=37, D=24, I=16, E=6, k=3, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, dtype=dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    ids[ids == 2] = 3  # expert 2 receives no token (and some tokens run expert 3 twice: the op allows it)
    weights = torch.rand(N, k, generator=g)
    gate_up = torch.randn(E, 2 * I, D, generator=g, dtype=dtype) * 0.2
    down = torch.randn(E, D, I, generator=g, dtype=dtype) * 0.2
    return x, ids, weights, gate_up, down


def test_moe_experts_match_the_per_expert_loop_forward_and_gradients():
    inputs = [t.requires_grad_(t.is_floating_point()) for t in _expert_inputs()]
    out = torch.full((37, 24), float("nan"))
    out.copy_(moe_experts(*inputs))  # every row written: no NaN may survive
    ref = moe_experts_naive(*inputs)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(ref)
    diff = [i for i in inputs if i.requires_grad]
    got = torch.autograd.grad(moe_experts(*inputs), diff, grad)
    want = torch.autograd.grad(ref, diff, grad)
    for name, a, b in zip(["x", "weights", "gate_up", "down"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"gradient of {name}")
    assert got[2][2].abs().max() == 0  # the expert without tokens gets no gradient


def test_triton_grouped_gemms_match_the_loop_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from dsaflow.ops.moe.function import GroupedMM

    x, ids, _, gate_up, _ = _expert_inputs(N=29, D=20, I=12, E=5, k=2)
    order, offsets = sort_by_expert(ids, 5)
    rows = x[order // 2].clone().requires_grad_()
    w = gate_up.clone().requires_grad_()
    out = GroupedMM.apply(rows, w, offsets, "triton")
    expert = ids.reshape(-1)[order]
    ref = torch.stack([rows[m] @ w[expert[m]].t() for m in range(rows.shape[0])])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, [rows, w], grad)
    want = torch.autograd.grad(ref, [rows, w], grad)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


def test_dispatch_says_why_each_kernel_runs_or_not():
    a, w = torch.randn(4, 8), torch.randn(2, 8, 8)
    assert explain_grouped_mm(a, w).kernel == "torch_grouped"


def _moe_model(**moe):
    cfg = dataclasses.replace(ModelConfig(), moe=MoEConfig(**moe))
    return cfg, build_model(cfg)


def test_first_k_dense_and_dense_layers_choose_the_mlps():
    _, m = _moe_model(first_k_dense=2)
    assert sorted(int(n.split(".")[1]) for n in moe_layers(m)) == list(range(2, 8))
    _, m = _moe_model(dense_layers=[0, 5])
    assert sorted(int(n.split(".")[1]) for n in moe_layers(m)) == [1, 2, 3, 4, 6, 7]


def test_a_dense_model_is_unchanged_by_the_moe_code():
    """model.moe unset: same parameters, same names, same outputs as a model built without the field."""
    cfg = ModelConfig()
    model = build_model(cfg)
    assert not moe_layers(model)
    assert all(".mlp.w1." in n or ".mlp." not in n for n in dict(model.named_parameters()) if ".mlp.w" not in n)
    x = torch.randint(0, cfg.vocab_size, (2, 12))
    torch.testing.assert_close(model(x), build_model(cfg)(x), rtol=0, atol=0)


def test_expert_load_counts_real_tokens_and_the_bias_moves_toward_balance():
    cfg, model = _moe_model(n_routed_experts=4, num_experts_per_tok=1, first_k_dense=0, bias_update_rate=0.01)
    layer = next(iter(moe_layers(model).values()))
    x = torch.randint(0, cfg.vocab_size, (2, 10))
    model(x)  # no recording outside a training forward that asks for it
    assert layer.gate.expert_load.sum() == 0
    model(x, record_expert_load=True)
    assert layer.gate.expert_load.sum() == 2 * 10 * 1  # tokens x experts per token
    load = layer.gate.expert_load.clone()
    balance = expert_load_balance(layer)
    torch.testing.assert_close(balance, torch.stack([load.max(), load.min()]) / load.mean())
    update_expert_bias(layer, 0.01)
    expected = torch.sign(load.mean() - load) * 0.01
    torch.testing.assert_close(layer.gate.e_score_correction_bias, expected)
    assert layer.gate.expert_load.sum() == 0


def test_sequence_balance_loss_is_one_when_routing_is_uniform_and_larger_when_skewed():
    B, T, E, k = 2, 8, 4, 1
    scores = torch.full((B, T, E), 0.5)
    uniform = torch.arange(T).remainder(E).view(1, T, 1).expand(B, T, k)
    real = torch.ones(B, T, dtype=torch.bool)
    assert sequence_balance_loss(scores, uniform, real).item() == pytest.approx(1.0)
    skewed_scores = scores.clone()
    skewed_scores[..., 0] = 0.9
    skewed = torch.zeros(B, T, k, dtype=torch.long)
    # every token on expert 0: f_0 = E, P_0 = 0.9 / (0.9 + 3 * 0.5), so the loss is E * P_0
    assert sequence_balance_loss(skewed_scores, skewed, real).item() == pytest.approx(4 * 0.9 / 2.4)


def test_the_aux_loss_reaches_the_router_only_when_weighted():
    for weight in (0.0, 1.0):
        cfg, model = _moe_model(n_routed_experts=4, num_experts_per_tok=1, first_k_dense=0, aux_loss_weight=weight)
        x = torch.randint(0, cfg.vocab_size, (2, 10))
        base = torch.autograd.grad(model(x).sum(), model.layers["0"].mlp.gate.weight)[0]
        recorded = torch.autograd.grad(model(x, record_expert_load=True).sum(), model.layers["0"].mlp.gate.weight)[0]
        assert torch.equal(base, recorded) == (weight == 0.0)


def test_the_router_stays_fp32_when_the_model_is_cast():
    layer = MoE(16, MoEConfig())
    layer.to(torch.bfloat16)
    assert layer.gate.weight.dtype == torch.float32 and layer.gate.e_score_correction_bias.dtype == torch.float32
    assert layer.gate.expert_load.dtype == torch.float32
    assert layer.experts.gate_up_proj.dtype == torch.bfloat16


def test_a_forced_kernel_is_the_only_candidate(monkeypatch):
    a, w = torch.randn(4, 8), torch.randn(2, 8, 8)
    monkeypatch.setenv("DSAFLOW_MOE_GEMM", "triton")
    choice = explain_grouped_mm(a, w)
    assert choice.kernel is None and "DSAFLOW_MOE_GEMM=triton" in str(choice)
    monkeypatch.setenv("DSAFLOW_MOE_GEMM", "cutlass")
    with pytest.raises(ValueError, match="not a grouped GEMM"):
        explain_grouped_mm(a, w)


def test_fused_weighted_swiglu_matches_torch_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from dsaflow.ops.moe.function import _swiglu_weighted_reference
    from dsaflow.ops.moe.triton_swiglu import swiglu_weighted_bwd, swiglu_weighted_fwd

    h = torch.randn(7, 2 * 40, requires_grad=True)  # I = 40: a ragged last block
    w = torch.rand(7, requires_grad=True)
    ref = _swiglu_weighted_reference(h, w)
    d = torch.randn_like(ref)
    want_h, want_w = torch.autograd.grad(ref, (h, w), d)
    torch.testing.assert_close(swiglu_weighted_fwd(h.detach(), w.detach()), ref)
    got_h, got_w = swiglu_weighted_bwd(h.detach(), w.detach(), d)
    torch.testing.assert_close(got_h, want_h)
    torch.testing.assert_close(got_w, want_w)


def test_fused_unsort_sum_matches_torch_under_the_interpreter(monkeypatch):
    """Each token's k rows gathered from expert order and summed, against the gather-and-sum it replaces; D = 40
    leaves a ragged column block, and the output is poisoned first (every element written)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from dsaflow.ops.moe import sort_by_expert, triton_unsort

    g = torch.Generator().manual_seed(3)
    N, k, E, D = 9, 3, 5, 40
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    order, _ = sort_by_expert(ids, E)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    out = torch.randn(N * k, D, generator=g)
    want = out.index_select(0, inverse).view(N, k, D).sum(dim=1)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    got = triton_unsort.unsort_sum_triton(out, inverse, k)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="do not fit k=4"):
        triton_unsort.unsort_sum_triton(out, inverse, 4)


def test_the_whole_layer_matches_the_references_with_router_gradients():
    """MoE layer (router, routed experts, shared expert) against route_naive + moe_experts_naive + a plain SwiGLU:
    the output and the gradients of the input, the router gate, the experts and the shared expert."""
    moe = MoEConfig(n_routed_experts=8, num_experts_per_tok=3, moe_inter_dim=12, n_group=4, topk_group=2)
    layer = MoE(16, moe)
    torch.manual_seed(0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    with torch.no_grad():
        layer.gate.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(2, 9, 16, requires_grad=True)
    out = layer(x)
    g = layer.gate
    flat = x.reshape(-1, 16)
    ids, weights = route_naive(flat, g.weight, g.e_score_correction_bias, 3, 4, 2, True, 1.0)
    # the reference weights, differentiable in x and the gate, for the experts route_naive chose
    scores = torch.sigmoid(flat @ g.weight.t()).gather(1, ids)
    ref_w = scores / scores.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(ref_w.detach(), weights, rtol=1e-5, atol=1e-6)
    e = layer.experts
    ref = moe_experts_naive(flat, ids, ref_w, e.gate_up_proj, e.down_proj) + layer.shared_experts(flat)
    torch.testing.assert_close(out.reshape(-1, 16), ref, rtol=1e-5, atol=1e-5)
    params = [x, g.weight, e.gate_up_proj, e.down_proj, layer.shared_experts.w1.weight]
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out.reshape(-1, 16), params, grad)
    want = torch.autograd.grad(ref, params, grad)
    for name, a, b in zip(["x", "gate", "gate_up", "down", "shared w1"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")
