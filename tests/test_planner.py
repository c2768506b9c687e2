"""Planner rules, one test (or a few) per rule of docs/planning.md, on configs built without Hydra."""

import itertools
import json

import pytest

from dsaflow.errors import PlanError
from dsaflow.plan import Plan, build_plan
from dsaflow.plan.partition import _balanced_starts
from tests.planner_helpers import block, make_cfg


def roles(plan):
    return "".join(("!" if l.promoted else l.role) for l in plan.layers)


# --- rule 1 + 2: roles, stages, sources, promotions --------------------------------------------------------------


def test_issue_example_promotes_layer_4():
    plan = build_plan(make_cfg(layout="FSSS|SSFS"))
    assert [s.layers for s in plan.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    l4, l5, l7 = plan.layers[4], plan.layers[5], plan.layers[7]
    assert (l4.declared, l4.role, l4.promoted, l4.source) == ("S", "F", True, 4)
    assert "first layer of stage 1" in l4.reason and "layer 0" in l4.reason
    assert l5.source == 4 and l7.source == 6
    assert [l.source for l in plan.layers[:4]] == [0, 0, 0, 0]
    assert sum(l.promoted for l in plan.layers) == 1


def test_every_layer_is_f_without_role_knobs():
    plan = build_plan(make_cfg())
    assert roles(plan) == "F" * 8
    assert all(l.source == l.index and l.reason is None for l in plan.layers)


def test_freq_and_pattern_roles():
    assert roles(build_plan(make_cfg(**{"index.freq": 4}))) == "FSSSFSSS"
    assert roles(build_plan(make_cfg(**{"index.freq": 4, "index.offset": 1}))) == "FFSSSFSS"
    assert roles(build_plan(make_cfg(**{"index.pattern": "FSS"}))) == "FSSFSSFS"


def test_first_stage_starting_with_s_is_promoted_with_no_f_before_it():
    plan = build_plan(make_cfg(layout="SSFS SSSS"))
    assert plan.layers[0].promoted and "no F layer precedes it" in plan.layers[0].reason
    assert [l.source for l in plan.layers] == [0, 0, 2, 2, 2, 2, 2, 2]


def test_promotion_happens_only_at_stage_starts():
    plan = build_plan(make_cfg(layout="FS|SS|FS|SF", **{"pipeline.microbatches": 4}))
    assert roles(plan) == "FS!SFS!F"
    assert [l.source for l in plan.layers] == [0, 0, 2, 2, 4, 4, 6, 7]


@pytest.mark.parametrize(
    "knobs, needle",
    [
        ({"layout": "FSSSFSSS", "index.freq": 4}, "layout and index.freq"),
        ({"index.pattern": "FS", "index.freq": 2}, "index.pattern and index.freq"),
        ({"index.offset": 2}, "index.offset=2 is set but index.freq is not"),
        ({"layout": "FSSS|FSSS", "pipeline.boundaries": [0, 4]}, "has '|' boundaries and pipeline.boundaries"),
        ({"layout": "FSSS|FSSS", "pipeline.stages": 4}, "has 2 stages but pipeline.stages=4"),
        ({"pipeline.boundaries": [0, 4], "pipeline.stages": 3}, "makes 2 stages but pipeline.stages=3"),
    ],
)
def test_conflicting_knobs_are_errors(knobs, needle):
    with pytest.raises(PlanError, match="Fix:") as e:
        build_plan(make_cfg(**knobs))
    assert needle in str(e.value)


def test_layout_and_matching_stage_count_agree():
    plan = build_plan(make_cfg(layout="FSSS|FSSS", **{"pipeline.stages": 2}))
    assert plan.num_stages == 2


@pytest.mark.parametrize(
    "knobs, needle",
    [
        ({"layout": "FSSS"}, "describes 4 layers but model.num_layers=8"),
        ({"pipeline.boundaries": [0, 4, 4]}, "strictly increasing"),
        ({"pipeline.boundaries": [5, 3]}, "strictly increasing"),
        ({"pipeline.boundaries": [0, 8]}, "boundary 8 is out of range"),
        ({"pipeline.boundaries": [-1, 3]}, "strictly increasing"),
        ({"pipeline.boundaries": []}, "is empty"),
        ({"pipeline.stages": 9, "pipeline.microbatches": 9}, "pipeline.stages=9 is more than model.num_layers=8"),
        ({"pipeline.stages": 0}, "pipeline.stages=0"),
        ({"model.index_topk": 0}, "model.index_topk=0"),
        ({"model.index_topk": -4}, "model.index_topk=-4"),
        ({"model.qk_rope_head_dim": 7}, "must be even"),
        ({"mode": "infer"}, "mode='infer'"),
        ({"pipeline.balance": "flops"}, "pipeline.balance='flops'"),
    ],
)
def test_field_and_boundary_errors(knobs, needle):
    with pytest.raises(PlanError) as e:
        build_plan(make_cfg(**knobs))
    assert needle in str(e.value)
    assert "Fix:" in str(e.value)


def test_boundaries_with_or_without_leading_zero():
    a = build_plan(make_cfg(**{"pipeline.boundaries": [3, 5], "pipeline.microbatches": 4}))
    b = build_plan(make_cfg(**{"pipeline.boundaries": [0, 3, 5], "pipeline.microbatches": 4}))
    assert [s.layers for s in a.stages] == [s.layers for s in b.stages] == [(0, 1, 2), (3, 4), (5, 6, 7)]


# --- balancing ----------------------------------------------------------------------------------------------------


def brute_force_best(costs, k, extra):
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), k - 1):
        starts = (0, *cuts)
        ends = (*cuts, n)
        worst = max(sum(costs[a:b]) + extra[a] for a, b in zip(starts, ends))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_cost_balance_is_optimal_against_brute_force(seed):
    import random

    rng = random.Random(seed)
    n, k = rng.randint(2, 10), rng.randint(1, 4)
    k = min(k, n)
    costs = [rng.randint(1, 20) for _ in range(n)]
    extra = [rng.choice([0, 0, 5]) for _ in range(n)]
    starts = _balanced_starts(costs, k, extra)
    ends = (*starts[1:], n)
    got = max(sum(costs[a:b]) + extra[a] for a, b in zip(starts, ends))
    assert len(starts) == k and starts[0] == 0 and all(b > a for a, b in zip(starts, starts[1:]))
    assert got == brute_force_best(costs, k, extra)


def test_cost_balance_puts_fewer_layers_on_the_head_stage():
    # The LM head (vocab x dim) dominates a tiny model, so the last stage gets fewer layers than an even split.
    cfg = make_cfg(**{"pipeline.stages": 2, "pipeline.microbatches": 2, "model.vocab_size": 4096})
    plan = build_plan(cfg)
    assert len(plan.stages[1].layers) < len(plan.stages[0].layers)
    even = build_plan(
        make_cfg(
            **{"pipeline.stages": 3, "pipeline.microbatches": 3, "pipeline.balance": "layers", "train.batch_size": 12}
        )
    )
    assert [len(s.layers) for s in even.stages] == [3, 3, 2]


def test_cost_balance_prefers_cuts_before_f_layers():
    # every4 on 16 layers in 4 stages: cutting at 4, 8, 12 costs no promotion and is as balanced as anything else.
    cfg = make_cfg(
        **{
            "model.num_layers": 16,
            "model.vocab_size": 16,
            "index.freq": 4,
            "pipeline.stages": 4,
            "pipeline.microbatches": 4,
        }
    )
    plan = build_plan(cfg)
    assert not any(l.promoted for l in plan.layers)


# --- schedules and ranks ------------------------------------------------------------------------------------------


def test_looped_placement_for_interleaved():
    cfg = make_cfg(
        **{
            "pipeline.stages": 8,
            "pipeline.ranks": 4,
            "pipeline.schedule": "Interleaved1F1B",
            "pipeline.microbatches": 8,
        }
    )
    plan = build_plan(cfg)
    assert [s.rank for s in plan.stages] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [s.index for s in plan.stages_of_rank(1)] == [1, 5]
    assert plan.pipeline.stages_per_rank == 2 and plan.pipeline.ranks == 4


def test_v_placement_for_zbv():
    cfg = make_cfg(
        **{"pipeline.stages": 8, "pipeline.ranks": 4, "pipeline.schedule": "ZBVZeroBubble", "pipeline.microbatches": 8}
    )
    plan = build_plan(cfg)
    assert [s.rank for s in plan.stages] == [0, 1, 2, 3, 3, 2, 1, 0]


@pytest.mark.parametrize(
    "knobs, needle",
    [
        (
            {"pipeline.stages": 6, "pipeline.ranks": 4, "pipeline.schedule": "Interleaved1F1B"},
            "does not divide the 6 stages",
        ),
        (
            {
                "pipeline.stages": 8,
                "pipeline.ranks": 4,
                "pipeline.schedule": "Interleaved1F1B",
                "pipeline.microbatches": 6,
            },
            "not a multiple of pipeline.ranks=4",
        ),
        (
            {"pipeline.stages": 4, "pipeline.ranks": 4, "pipeline.schedule": "Interleaved1F1B"},
            "at least 2 stages per rank",
        ),
        ({"pipeline.stages": 4, "pipeline.ranks": 2, "pipeline.schedule": "1F1B"}, "runs one stage per rank"),
        (
            {"pipeline.stages": 6, "pipeline.ranks": 2, "pipeline.schedule": "ZBVZeroBubble"},
            "exactly 2 stages per rank",
        ),
        ({"pipeline.stages": 2, "pipeline.schedule": "Zigzag"}, "pipeline.schedule='Zigzag' is not a valid choice"),
        ({"pipeline.stages": 4, "pipeline.microbatches": 2}, "below the 4 stages"),
        (
            {"pipeline.stages": 2, "pipeline.microbatches": 3, "train.batch_size": 8},
            "train.batch_size=8 does not split",
        ),
        ({"pipeline.stages": 2, "pipeline.microbatches": 0}, "pipeline.microbatches=0"),
    ],
)
def test_schedule_rank_errors(knobs, needle):
    with pytest.raises(PlanError) as e:
        build_plan(make_cfg(**knobs))
    assert needle in str(e.value) and "Fix:" in str(e.value)


def test_nproc_must_match_the_ranks():
    with pytest.raises(PlanError, match="--nproc 4 but the plan has 2") as e:
        build_plan(make_cfg(**{"pipeline.stages": 2}), nproc=4)
    assert "Fix:" in str(e.value)
    assert build_plan(make_cfg(**{"pipeline.stages": 2}), nproc=2).pipeline.ranks == 2


def test_serving_skips_training_microbatch_rules_but_keeps_placement():
    plan = build_plan(make_cfg(layout="F|S|F|S|F|S|F|S", mode="serve", **{"pipeline.microbatches": 3}))
    assert plan.num_stages == 8 and [s.rank for s in plan.stages] == list(range(8))
    with pytest.raises(PlanError, match="does not divide"):
        build_plan(
            make_cfg(
                mode="serve", **{"pipeline.stages": 6, "pipeline.ranks": 4, "pipeline.schedule": "Interleaved1F1B"}
            )
        )


def test_gpipe_accepts_fewer_microbatches_than_stages():
    plan = build_plan(make_cfg(**{"pipeline.stages": 4, "pipeline.microbatches": 2, "pipeline.schedule": "GPipe"}))
    assert plan.pipeline.microbatches == 2


@pytest.mark.parametrize(
    "knobs, expected",
    [
        ({}, 1),  # one stage: the whole batch per step, no gradient accumulation
        ({"pipeline.stages": 2}, 2),
        ({"layout": "FS|SS|FS|SF"}, 4),
        ({"pipeline.stages": 4, "pipeline.ranks": 2, "pipeline.schedule": "Interleaved1F1B"}, 4),
        ({"pipeline.microbatches": 8}, 8),  # an explicit count stays
    ],
)
def test_unset_microbatches_mean_one_per_stage(knobs, expected):
    assert build_plan(make_cfg(**knobs)).pipeline.microbatches == expected


# --- graph blocks -------------------------------------------------------------------------------------------------


def gcfg(blocks, enabled=True, mode="train", **kw):
    return make_cfg(**{"graphs.enabled": enabled, "graphs.blocks": blocks, "mode": mode, **kw})


def test_graph_blocks_resolve_to_their_stages():
    cfg = gcfg(
        [block("dec", "decode"), block("pre", "prefill", shape_classes=(16, 32))],
        mode="serve",
        **{"pipeline.boundaries": [0, 4]},
    )
    plan = build_plan(cfg)
    by = {b.name: b for b in plan.graph_blocks}
    assert by["dec"].stages == (0, 1) and by["dec"].layers == ()
    assert by["pre"].stages == (0, 1) and by["pre"].shape_classes == (16, 32)
    assert [b.name for b in plan.blocks_of_stage(1)] == ["dec", "pre"]


@pytest.mark.parametrize("mode", ["train", "serve"])
@pytest.mark.parametrize("blk", [block("lm", "head"), block("mid", "layers", [5, 7])])
def test_blocks_no_mode_captures_are_refused_before_launch(mode, blk):
    """A head or layer-span block exists in the plan but no mode captures it alone: refused, never ignored."""
    with pytest.raises(PlanError, match="never captured") as e:
        build_plan(gcfg([blk], mode=mode, **{"pipeline.boundaries": [0, 4]}))
    assert "Fix:" in str(e.value)


@pytest.mark.parametrize(
    "blocks, kw, needle",
    [
        ([block("x", "layers", [6, 9])], {}, "layer 9 does not exist"),
        ([block("x", "layers", [2, 5])], {"pipeline.boundaries": [0, 4]}, "spans stage 0 and stage 1"),
        ([block("x", "decode", shape_classes=(4, 2))], {"mode": "serve"}, "sorted strictly increasing"),
        ([block("x", "decode", shape_classes=(1, 1))], {"mode": "serve"}, "sorted strictly increasing"),
        ([block("x", "decode", shape_classes=(0, 2))], {"mode": "serve"}, "must be positive"),
        ([block("x", "decode", shape_classes=(1, 512))], {"mode": "serve"}, "exceeds graphs.max_shape=256"),
        ([block("x", "decode")], {}, "exists only when serving"),
        ([block("x", "warp")], {}, "kind='warp' is not a valid choice"),
        ([block("x", "head"), block("x", "head")], {}, "duplicate name"),
        ([block("x", "layers")], {}, "needs [first, last]"),
        ([block("x", "layers", [3, 1])], {}, "first > last"),
        ([block("x", "head", [1, 2])], {}, "only meaningful for kind=layers"),
    ],
)
def test_graph_block_errors(blocks, kw, needle):
    mode = kw.pop("mode", "train")
    with pytest.raises(PlanError) as e:
        build_plan(gcfg(blocks, mode=mode, **kw))
    assert needle in str(e.value) and "Fix:" in str(e.value)


def test_graph_blocks_while_disabled_is_an_error():
    with pytest.raises(PlanError, match="graphs.enabled=false"):
        build_plan(gcfg([block("lm", "head")], enabled=False))


# --- serialisation ------------------------------------------------------------------------------------------------


def test_plan_json_contract_and_round_trip():
    cfg = gcfg([block("dec", "decode")], mode="serve", layout="FSSS|SSFS")
    plan = build_plan(cfg)
    d = json.loads(plan.to_json())
    assert d["num_layers"] == 8
    assert d["stages"][1] == {"index": 1, "rank": 1, "layers": [4, 5, 6, 7]}
    assert d["layers"][4] == {
        "index": 4,
        "stage": 1,
        "declared": "S",
        "role": "F",
        "promoted": True,
        "source": 4,
        "reason": plan.layers[4].reason,
    }
    assert d["graph_blocks"][0]["stages"] == [0, 1]
    assert set(d["estimates"]) >= {"stages", "boundaries", "total", "balance"}
    assert Plan.from_json(plan.to_json()) == plan
