"""`dsaflow plan`: the table, the JSON, and every user mistake as exit 2 with one paragraph and no traceback."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsaflow.cli import main
from dsaflow.plan import Plan

DSAFLOW = [sys.executable, "-m", "dsaflow.cli"]
REPO = Path(__file__).resolve().parents[1]


def run(capsys, *args):
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_issue_example_table(capsys):
    code, out, err = run(capsys, "model=tiny", "layout=FSSS|SSFS")
    assert code == 0 and err == ""
    assert "4:F! 5:S<4 6:F 7:S<6" in out
    assert "0:F 1:S<0 2:S<0 3:S<0" in out
    assert "layer 4 (stage 1): declared S but first layer of stage 1" in out


def test_issue_example_json(capsys):
    code, out, err = run(capsys, "model=tiny", "layout=FSSS|SSFS", "format=json")
    assert code == 0
    d = json.loads(out)  # stdout is only the plan JSON
    layers = d["layers"]
    assert layers[4]["promoted"] and layers[4]["role"] == "F" and layers[4]["declared"] == "S"
    assert layers[5]["source"] == 4 and layers[7]["source"] == 6
    assert [s["layers"] for s in d["stages"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert json.loads(Plan.from_dict(d).to_json()) == d


# Training a pp8 stage of a 671B / 744B MoE model needs about a TiB (weights, AdamW state, gradients), so on the
# default device (an H200) `dsaflow plan` prints the table and exits 2; these tests read the layout on a device
# large enough to hold it.
LARGE_DEVICE = "plan.device_memory_gib=4096"


def test_dsv32_every4_pp8_table(capsys):
    code, out, err = run(capsys, "model=dsv32", "index=every4", "pipeline=pp8")
    assert code == 2 and "/microbatch" in out and "largest term is weights and AdamW state" in err
    code, out, _ = run(capsys, "model=dsv32", "index=every4", "pipeline=pp8", LARGE_DEVICE)
    assert code == 0
    plan = Plan.from_json(_json(capsys, "model=dsv32", "index=every4", "pipeline=pp8", LARGE_DEVICE))
    assert plan.num_stages == 8
    for l in plan.layers:
        if l.promoted:
            assert f"layer {l.index} (stage {l.stage}): declared S" in out
    assert "/token @128K" in out and "indexer saved" in out
    assert "/microbatch" in out and "recompute" in out and "payload" in out
    assert len(plan.estimates["boundaries"]) == 7


def _json(capsys, *args):
    code, out, _ = run(capsys, *args, "format=json")
    assert code == 0
    return out


BAD = [
    (["layout=FSXSFSSS"], "unknown role letter 'X'"),
    (["layout=(FSSS*2"], "unbalanced '('"),
    (["layout=FSSS"], "describes 4 layers but model.num_layers=8"),
    (["pipeline.boundaries=[0,4,2]"], "strictly increasing"),
    (["pipeline.boundaries=[0,9]"], "boundary 9 is out of range"),
    (["layout=FSSS||FSSS"], "is empty"),
    (["pipeline.stages=9", "pipeline.microbatches=9"], "pipeline.stages=9 is more than model.num_layers=8"),
    (["model.index_topk=0"], "model.index_topk=0"),
    (["graphs.enabled=true", "graphs.blocks=[{name:x,kind:layers,layers:[6,9]}]"], "layer 9 does not exist"),
    (
        ["graphs.enabled=true", "graphs.blocks=[{name:x,kind:layers,layers:[2,5]}]", "pipeline=pp2"],
        "spans stage 0 and stage 1",
    ),
    (["mode=serve", "graphs=decode", "graphs.blocks.0.shape_classes=[4,2,8]"], "sorted strictly increasing"),
    (["graphs.blocks=[{name:lm,kind:head}]"], "graphs.enabled=false"),
    (["pipeline=pp4_interleaved", "pipeline.stages=6"], "does not divide the 6 stages"),
    (["graphs=decode"], "exists only when serving"),
    (["layout=FSSSFSSS", "index=every4"], "conflicting role knobs"),
    (["model.dimm=3"], "unknown key model.dimm"),
    (["model.dim=wide"], "model.dim='wide'"),
    (["model=huge"], "no option 'huge' in the config group 'model'"),
    (["format=xml"], "format='xml'"),
]


@pytest.mark.parametrize("args, needle", BAD, ids=[b[1][:40] for b in BAD])
def test_mistakes_exit_2_with_one_paragraph(capsys, args, needle):
    code, out, err = run(capsys, *args)
    assert code == 2
    assert out == ""
    assert needle in err
    assert err.startswith("dsaflow: error: ") and "Fix:" in err
    assert "Traceback" not in err


def _subprocess(*args):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([*DSAFLOW, *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)


def test_console_entry_point_exit_codes_and_streams():
    bad = _subprocess("plan", "model=tiny", "layout=FS(SS")
    assert bad.returncode == 2 and "unbalanced '('" in bad.stderr and "Traceback" not in bad.stderr + bad.stdout
    good = _subprocess("plan", "model=tiny", "index=every2", "pipeline=pp2", "format=json")
    assert good.returncode == 0
    assert json.loads(good.stdout)["num_layers"] == 8  # nothing but JSON on stdout
    helped = _subprocess("--help")
    assert helped.returncode == 0 and "plan" in helped.stdout and "train" in helped.stdout
    plan_help = _subprocess("plan", "--help")
    assert plan_help.returncode == 0 and "OVERRIDE" in plan_help.stdout and "format=json" in plan_help.stdout


def test_train_and_generate_plan_first_and_stop_on_mistakes(capsys, monkeypatch):
    import dsaflow.launch.launch as launch_mod

    calls = []
    monkeypatch.setattr(launch_mod, "launch", lambda cfg, plan, job: calls.append((cfg, plan, job)) or 0)
    assert main(["train", "layout=FSXSFSSS"]) == 2
    assert calls == [] and "unknown role letter" in capsys.readouterr().err
    assert main(["train", "model=tiny", "index=every2"]) == 0
    cfg, plan, job = calls[-1]
    assert job == "train" and cfg.mode == "train" and plan.layers[1].source == 0
    assert main(["generate", "graphs=decode"]) == 0  # generate implies mode=serve, so decode graphs are valid
    cfg, plan, job = calls[-1]
    assert job == "generate" and cfg.mode == "serve" and plan.graph_blocks[0].kind == "decode"


GLM52_S_BOUNDARIES = "pipeline.boundaries=[10,20,30,40,50,60,70]"  # 20, 40 and 60 are S layers of GLM-5.2


def test_glm52_pp8_without_promotion_starts_every_stage_on_f(capsys):
    plan = Plan.from_json(_json(capsys, "model=glm52", "pipeline=pp8", "index.promote=false", LARGE_DEVICE))
    assert plan.num_stages == 8 and plan.index_boundaries == ()
    assert sum(l.role == "F" for l in plan.layers) == 21 and not any(l.promoted for l in plan.layers)
    assert all(plan.layers[s.layers[0]].role == "F" for s in plan.stages)
    aligned = plan.estimates["f_aligned_split"]
    assert aligned["balance"] > aligned["balance_anywhere"] >= 1.0
    code, out, _ = run(capsys, "model=glm52", "pipeline=pp8", "index.promote=false", LARGE_DEVICE)
    assert code == 0 and "F-aligned split (index.promote=false)" in out


def test_glm52_pp8_s_boundaries_are_refused_with_alternatives_then_sent(capsys):
    code, out, err = run(capsys, "model=glm52", "pipeline=pp8", "index.promote=false", GLM52_S_BOUNDARIES)
    assert code == 2 and out == "" and "Traceback" not in err
    assert "stage 2 at layer 20" in err and "layer 20 (stage 2) -> 18 (balance" in err and "or 22 (balance" in err
    assert "pipeline.boundaries=[10, 18, 26, 34, 46, 58, 70]" in err and "cross_stage_indices=true" in err
    args = (
        "model=glm52",
        "pipeline=pp8",
        "index.promote=false",
        GLM52_S_BOUNDARIES,
        "pipeline.cross_stage_indices=true",
        LARGE_DEVICE,
    )
    plan = Plan.from_json(_json(capsys, *args))
    assert plan.index_boundaries == (1, 3, 5)
    assert [plan.layers[i].source for i in (20, 21, 40, 60)] == [18, 18, 38, 58]
    code, out, _ = run(capsys, *args)
    assert code == 0 and "cross-stage indices: after stages [1, 3, 5]" in out and "sent" in out


def test_layout_examples_in_the_help_and_docs_plan_as_written(capsys):
    """Every `dsaflow plan ... layout=...` in docs/planning.md, and the layout line of `dsaflow plan --help`, plans on
    the default model with the overrides written beside it."""
    import re
    import shlex

    from dsaflow.cli import command_help

    doc = (REPO / "docs" / "planning.md").read_text().replace("\\\n", " ")
    lines = re.findall(r"dsaflow plan ([^`\n]*layout=[^`\n]*)", doc)
    lines += [ln.strip() for ln in command_help("plan").splitlines() if ln.strip().startswith("layout=")]
    assert len(lines) >= 3
    for line in lines:
        args = [a for a in shlex.split(line.split("  ")[0].split(" #")[0]) if "=" in a]
        code, _, err = run(capsys, *args)
        assert code == 0, f"{line}: {err}"
