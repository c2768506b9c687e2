"""Property tests over random layouts and boundaries: the planner's invariants hold for every input."""

from hypothesis import given, settings
from hypothesis import strategies as st

from dsaflow.plan import Plan, build_plan
from dsaflow.plan import estimates as E
from dsaflow.plan.layout import format_layout
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
    cfg = make_cfg(
        **{
            "model.num_layers": n,
            "index.pattern": roles,
            "pipeline.stages": k,
            "pipeline.balance": balance,
            "pipeline.schedule": "GPipe",
            "pipeline.microbatches": 1,
            "train.batch_size": 1,
        }
    )
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


# --- index.promote=false and pipeline.cross_stage_indices -------------------------------------------------------


def plan_or_error(**knobs):
    from dsaflow.errors import PlanError

    try:
        return build_plan(make_cfg(**knobs)), None
    except PlanError as e:
        return None, str(e)


def knobs_for(roles, starts, via, **extra):
    knobs = {
        "model.num_layers": len(roles),
        "pipeline.schedule": "GPipe",
        "pipeline.microbatches": 1,
        "train.batch_size": 1,
        **extra,
    }
    if via == "layout":
        knobs["layout"] = format_layout(tuple(roles), tuple(starts))
    elif via == "pattern+boundaries":
        knobs["index.pattern"] = roles
        knobs["pipeline.boundaries"] = starts
    else:  # via == ("stages", k, balance)
        knobs["index.pattern"] = roles
        knobs["pipeline.stages"], knobs["pipeline.balance"] = via[1], via[2]
    return knobs


def split_cases():
    return st.one_of(
        st.sampled_from(["layout", "pattern+boundaries"]),
        st.tuples(st.just("stages"), st.integers(2, 8), st.sampled_from(["cost", "layers"])),
    )


@settings(max_examples=300, deadline=None)
@given(layout_cases(), split_cases())
def test_no_promotion_without_crossing_keeps_every_stage_on_f(case, via):
    roles, starts = case
    if not isinstance(via, str):
        via = (via[0], min(via[1], len(roles)), via[2])
    plan, err = plan_or_error(**knobs_for(roles, starts, via, **{"index.promote": False}))
    if roles[0] == "S":  # nothing precedes layer 0 and it may not run as F
        assert err is not None and "layer 0" in err and "index.promote=false" in err
        return
    explicit = isinstance(via, str)
    s_starts = [b for b in starts[1:] if roles[b] == "S"]
    n_f_after_0 = sum(r == "F" for r in roles[1:])
    if explicit and s_starts:
        # refused, naming the field, a boundary that starts on S, and the way out
        assert err is not None and "index.promote=false" in err and "cross_stage_indices=true" in err
        assert f"layer {s_starts[0]} " in err
        return
    if not explicit and via[1] - 1 > n_f_after_0:
        assert err is not None and "F layers" in err
        return
    assert err is None, err
    assert not any(l.promoted for l in plan.layers) and plan.index_boundaries == ()
    assert all(l.role == l.declared for l in plan.layers)
    for stage in plan.stages:
        assert plan.layers[stage.layers[0]].role == "F"
    for l in plan.layers:  # no S layer reads from another stage
        assert plan.layers[l.source].stage == l.stage
    if explicit:
        assert [s.layers[0] for s in plan.stages] == starts
    else:
        assert plan.num_stages == via[1]
        if via[1] > 1:
            aligned = plan.estimates["f_aligned_split"]
            assert aligned["balance"] >= aligned["balance_anywhere"] - 1e-9


@settings(max_examples=300, deadline=None)
@given(layout_cases(), split_cases(), st.booleans())
def test_cross_stage_sources_are_the_nearest_f_of_the_model(case, via, promote):
    roles, starts = case
    if not isinstance(via, str):
        via = (via[0], min(via[1], len(roles)), via[2])
    plan, err = plan_or_error(
        **knobs_for(roles, starts, via, **{"index.promote": promote, "pipeline.cross_stage_indices": True})
    )
    if roles[0] == "S" and not promote:
        assert err is not None and "layer 0" in err
        return
    assert err is None, err
    if isinstance(via, str):
        assert [s.layers[0] for s in plan.stages] == starts
    for l in plan.layers:
        if l.index == 0:
            assert l.role == "F" and l.promoted == (roles[0] == "S")
            continue
        assert not l.promoted and l.role == l.declared
        if l.role == "S":
            nearest = max(j for j in range(l.index) if plan.layers[j].role == "F")
            assert l.source == nearest
    # a boundary carries indices exactly when some layer after it reads a source before it
    for stage, nxt in zip(plan.stages, plan.stages[1:]):
        crosses = any(
            plan.layers[plan.layers[i].source].stage <= stage.index for s in plan.stages[nxt.index :] for i in s.layers
        )
        assert (stage.index in plan.index_boundaries) == crosses
        b = plan.estimates["boundaries"][stage.index]
        assert b["carries_indices"] == crosses
        assert b["index_payload_bytes_per_microbatch"] == E.index_payload_bytes(
            make_cfg().model, plan.estimates["microbatch_tokens"], plan.estimates["microbatch_seq_len"]
        )
    assert Plan.from_json(plan.to_json()) == plan
