"""Property tests over random layouts and boundaries: the planner's invariants hold for every input."""
from hypothesis import given, settings
from hypothesis import strategies as st

from dsaflow.plan.layout import format_layout
from dsaflow.plan import Plan, build_plan
from dsaflow.plan import estimates as E
from tests.planner_helpers import make_cfg


@st.composite
def layout_cases(draw):
    n = draw(st.integers(1, 48))
    roles = draw(st.lists(st.sampled_from("FS"), min_size=n, max_size=n))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=min(7, n - 1)))) if n > 1 else []
    return "".join(roles), [0, *cuts]


def plan_for(roles, starts, via):
    n = len(roles)
    knobs = {"model.num_layers": n, "pipeline.schedule": "GPipe", "pipeline.microbatches": 2, "train.batch_size": 2}
    if via == "layout":
        knobs["layout"] = format_layout(tuple(roles), tuple(starts))
    else:
        knobs["index.pattern"] = roles
        knobs["pipeline.boundaries"] = starts
    return build_plan(make_cfg(**knobs))


def check_invariants(plan, roles, starts):
    n = len(roles)
    assert plan.num_layers == n
    assert [s.layers[0] for s in plan.stages] == starts
    assert [i for s in plan.stages for i in s.layers] == list(range(n))  # contiguous, ordered, complete
    first_of_stage = set(starts)
    for l in plan.layers:
        assert l.declared == roles[l.index]
        assert l.stage == plan.stages[l.stage].index and l.index in plan.stages[l.stage].layers
        # promotions exactly where a stage starts with S
        assert l.promoted == (l.declared == "S" and l.index in first_of_stage)
        assert (l.reason is not None) == l.promoted
        if l.role == "F":
            assert l.source == l.index
            assert l.declared == "F" or l.promoted
        else:
            # every S layer has a same-stage F source before it, and it is the nearest one
            src = plan.layers[l.source]
            assert src.index < l.index and src.stage == l.stage and src.role == "F"
            assert all(plan.layers[j].role == "S" for j in range(src.index + 1, l.index))


@settings(max_examples=300, deadline=None)
@given(layout_cases(), st.sampled_from(["layout", "pattern+boundaries"]))
def test_invariants_hold_for_random_layouts(case, via):
    roles, starts = case
    plan = plan_for(roles, starts, via)
    check_invariants(plan, roles, starts)
    assert Plan.from_json(plan.to_json()) == plan


@settings(max_examples=100, deadline=None)
@given(layout_cases(), st.integers(1, 8), st.sampled_from(["cost", "layers"]))
def test_balanced_splits_keep_invariants_and_estimates_add_up(case, k, balance):
    roles, _ = case
    n = len(roles)
    k = min(k, n)
    cfg = make_cfg(**{"model.num_layers": n, "index.pattern": roles, "pipeline.stages": k, "pipeline.balance": balance,
                      "pipeline.schedule": "GPipe", "pipeline.microbatches": 1, "train.batch_size": 1})
    plan = build_plan(cfg)
    assert plan.num_stages == k
    check_invariants(plan, roles, [s.layers[0] for s in plan.stages])
    m = cfg.model
    expected = E.embed_params(m) + E.head_params(m) + sum(E.layer_params(m, l.role) for l in plan.layers)
    assert plan.estimates["total"]["params"] == expected
    kv = sum(s["kv_cache_bytes_per_seq"] for s in plan.estimates["stages"])
    n_f = sum(l.role == "F" for l in plan.layers)
    assert kv == m.max_seq_len * (n * E.kv_bytes_per_token(m, "S") + n_f * m.index_head_dim * E.BF16)
    assert Plan.from_json(plan.to_json()) == plan
