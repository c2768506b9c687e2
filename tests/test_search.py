"""The IndexCache layer search: role switching, the prefix-cached evaluator, the greedy choice, resume,
`dsaflow search`, search.png."""

import json
import math

import pytest
import torch
from model_helpers import planned_sharp, tokens

from dsaflow.model.roles import set_roles, stage_roles
from dsaflow.pipeline.stages import build_stages
from dsaflow.search import PatternEvaluator, SearchLog, greedy_search
from dsaflow.search.run import uniform_roles

T, TOPK = 32, 4


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls: a second thread only adds contention (50x slower on a loaded 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _batches(n=2, B=2, seed=0):
    out = []
    for i in range(n):
        x = tokens(B, T + 1, seed=seed + i)
        lm = x[:, 1:].clone()
        y = torch.stack([lm, torch.full_like(lm, -100), torch.full_like(lm, -1)], dim=1)
        out.append((x[:, :-1].contiguous(), y))
    return out


def _model(layout="FFFFFFFF", *over):
    cfg, plan = planned_sharp(layout, f"model.index_topk={TOPK}", *over)
    return cfg, plan, build_stages(cfg, plan, seed=3)


def test_set_roles_matches_a_stage_built_with_those_roles():
    """An all-F stage switched to FSSFSSSS computes exactly what a stage built from that plan computes."""
    cfg, plan, (allf,) = _model()
    cfg2, plan2 = planned_sharp("FSSFSSSS", f"model.index_topk={TOPK}")
    (built,) = build_stages(cfg2, plan2, seed=3)
    built.load_state_dict(allf.state_dict(), strict=False)  # S layers of `built` have no indexer keys
    set_roles(allf, dict(enumerate("FSSFSSSS")))
    assert stage_roles(allf) == dict(enumerate("FSSFSSSS"))
    assert [b.source for b in allf.layers.values()] == [0, 0, 0, 3, 3, 3, 3, 3]
    x = tokens(2, T)
    with torch.no_grad():
        torch.testing.assert_close(allf(x), built(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="must stay F"):
        set_roles(allf, {0: "S"})
    with pytest.raises(ValueError, match="no indexer weights"):
        set_roles(built, {1: "F"})


def test_prefix_cached_scores_equal_full_forwards():
    """score(roles) reruns only from the first changed layer, and equals a fresh full evaluation, on 2 stages."""
    cfg, plan = planned_sharp("FFFF|FFFF", f"model.index_topk={TOPK}")
    stages = build_stages(cfg, plan, seed=3)
    ev = PatternEvaluator(stages, _batches(), torch.device("cpu"))
    ev.rebase(tuple("FFFFFFFF"))
    g = torch.Generator().manual_seed(7)
    for _ in range(4):
        roles = ["F" if (i in (0, 4) or torch.rand(1, generator=g).item() < 0.5) else "S" for i in range(8)]
        roles[6] = "S"  # at least one change, at layer <= 6
        before = ev.layer_calls
        got = ev.score(tuple(roles))
        first = next(i for i in range(8) if roles[i] == "S")
        assert ev.layer_calls - before == 2 * (8 - first)  # 2 batches, layers first..7 only
        assert stage_roles(stages[0]) == dict(enumerate("FFFF"))  # score() leaves the base pattern in place
        fresh = PatternEvaluator(stages, _batches(), torch.device("cpu")).rebase(tuple(roles))
        assert got.loss == pytest.approx(fresh.loss, rel=1e-6)
    before = ev.layer_calls
    moved = ev.rebase(tuple(roles))  # the new base reuses the cached layers before its first change
    assert ev.layer_calls - before == 2 * (8 - first)
    assert moved.loss == pytest.approx(fresh.loss, rel=1e-6)
    back = ev.score(tuple("FFFFFFFF"))
    assert back.loss == pytest.approx(
        PatternEvaluator(stages, _batches(), torch.device("cpu")).rebase(tuple("FFFFFFFF")).loss, rel=1e-6
    )


def _unlike_model(unlike: int, layout="FFFFFFFF"):
    """Every indexer outputs zero scores (identical top-k everywhere) except layer `unlike`'s, and the LM targets are
    the all-F model's own confident predictions: turning any layer but `unlike` to S changes nothing at all (as long
    as no S layer would read `unlike`'s indices: it is the last layer of its stage)."""
    cfg, plan, stages = _model(layout)
    with torch.no_grad():
        for stage in stages:
            for i, layer in stage.layers.items():
                if int(i) != unlike:
                    layer.attn.indexer.weights_proj.weight.zero_()
        stages[-1].head.weight.mul_(20.0)
    ev = PatternEvaluator(stages, [(tokens(2, T, seed=s), torch.zeros(2, 3, T)) for s in (11, 12)], torch.device("cpu"))
    batches = []
    with torch.no_grad():
        for x, _ in ev.batches:
            pred = ev._run(x, 0, None, None).argmax(-1)
            batches.append((x, torch.stack([pred, torch.full_like(pred, -100), torch.full_like(pred, -1)], 1)))
    return stages, batches


@pytest.mark.parametrize("unlike, layout", [(7, "FFFFFFFF"), (3, "FFFF|FFFF")])
def test_a_layer_with_an_unlike_indexer_stays_F(tmp_path, unlike, layout):
    """The searched pattern keeps the unlike layer (and, pipeline-aware, every stage's first layer) F."""
    stages, batches = _unlike_model(unlike, layout)
    starts = [0] if "|" not in layout else [0, 4]
    ev = PatternEvaluator(stages, batches, torch.device("cpu"))
    log = SearchLog(tmp_path / "s.jsonl", {"t": unlike})
    target = len(starts) + 1
    steps = greedy_search(ev, starts, target, log, report=lambda m: None)
    want = "".join("F" if i in starts + [unlike] else "S" for i in range(8))
    assert steps[-1].roles == want, [s.roles for s in steps]
    assert [s.num_f for s in steps] == list(range(8, target - 1, -1))
    # the layers turned S along the way cost nothing (identical indices); only `unlike` would
    cand = {(k, c): s.loss for (k, c), s in log.candidates.items()}
    assert all(cand[(1, c)] == pytest.approx(steps[0].loss, abs=1e-6) for c in range(8) if c not in starts + [unlike])
    assert cand[(1, unlike)] > steps[0].loss + 1e-4


def test_search_resumes_after_an_interruption(tmp_path):
    stages, batches = _unlike_model(7)
    full = greedy_search(
        PatternEvaluator(stages, batches, torch.device("cpu")),
        [0],
        2,
        SearchLog(tmp_path / "a.jsonl", {}),
        report=lambda m: None,
    )
    seen = []

    def interrupt(msg):
        seen.append(msg)
        if len(seen) == 9:  # mid-way through step 2
            raise KeyboardInterrupt

    ev = PatternEvaluator(stages, batches, torch.device("cpu"))
    with pytest.raises(KeyboardInterrupt):
        greedy_search(ev, [0], 2, SearchLog(tmp_path / "b.jsonl", {}), report=interrupt)
    done = len(SearchLog(tmp_path / "b.jsonl", {}).candidates)
    ev2 = PatternEvaluator(stages, batches, torch.device("cpu"))
    again = greedy_search(ev2, [0], 2, SearchLog(tmp_path / "b.jsonl", {}), report=lambda m: None)
    assert [s.roles for s in again] == [s.roles for s in full]
    total = len(SearchLog(tmp_path / "b.jsonl", {}).candidates)
    assert total == 7 + 6 + 5 + 4 + 3 + 2 and done >= 7  # nothing was evaluated twice
    with pytest.raises(ValueError, match="other settings"):
        SearchLog(tmp_path / "b.jsonl", {"other": 1})


def test_uniform_roles_keep_stage_firsts():
    assert "".join(uniform_roles(4, 8, (0,))) == "FSSSFSSS"
    assert "".join(uniform_roles(4, 8, (0, 3))) == "FSSFFSSS"


def _fake_run(tmp_path, overrides):
    """A run dir as `dsaflow train` leaves it (config.yaml, plan.json, a checkpoint (DCP + weights-only safetensors +
    manifest) of freshly initialised weights), written in-process: the search only needs the files."""
    from dsaflow.checkpoint.training_state import save_checkpoint
    from dsaflow.config.compose import compose
    from dsaflow.plan import build_plan
    from dsaflow.rundir.folder import write_run_dir

    cfg = compose(overrides + [f"run_dir={tmp_path / 'run'}"])
    plan = build_plan(cfg)
    rd = write_run_dir(cfg, plan, "")
    save_checkpoint(rd / "checkpoints" / "step-000001", build_stages(cfg.model, plan, seed=cfg.train.seed), None, 0, 1)
    return rd


def test_dsaflow_search_end_to_end_and_resume(tmp_path, capsys):
    from dsaflow import cli

    small = [
        "model.num_layers=4",
        "model.dim=32",
        "model.inter_dim=64",
        "model.index_topk=4",
        "train.seq_len=32",
        "train.batch_size=4",
        "data=retrieval_hard",
    ]
    rd = _fake_run(tmp_path, small)
    args = [
        "search",
        f"search.checkpoint={rd}",
        "search.calib_batches=1",
        "search.eval_batches=1",
        "search.ratio=0.5",
        "pipeline.boundaries=[0,2]",
    ]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    s = rd / "search"
    layout = (s / "layout.txt").read_text().strip()
    assert f'layout="{layout}"' in out and "|" in layout  # two stages: 2 of 4 layers F = both stage firsts
    assert layout == "FS|FS"
    rows = (s / "search.csv").read_text().splitlines()
    assert rows[0].startswith("step,removed_layer,num_f") and len(rows) == 1 + 3
    assert (s / "search.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (s / "eval.md").read_text()
    assert "all-F" in table and "uniform 1/2" in table and "searched 1/2" in table
    assert cli.main(args) == 0  # rerun: everything is in the log
    assert "resumed after step 2/2" in capsys.readouterr().out
    assert cli.main(["search", "search.checkpoint=" + str(tmp_path / "nothing")]) == 2
    assert "search.checkpoint=" in capsys.readouterr().err


def test_search_refuses_a_checkpoint_with_S_layers(tmp_path, capsys):
    from dsaflow import cli

    rd = _fake_run(tmp_path, ["model.num_layers=4", "model.dim=32", "model.inter_dim=64", "index=every2"])
    assert cli.main(["search", f"search.checkpoint={rd}"]) == 2
    assert "index=all_full" in capsys.readouterr().err


def test_search_png_has_axes_values_and_a_title(tmp_path):
    from dsaflow.search.png import search_figure, write_search_png

    fig = search_figure([4, 3, 2], [1.25, 1.5, 2.125], [None, 5, 2], "search of run X")
    ax = fig.axes[0]
    assert ax.get_title() == "search of run X"
    assert "F layers kept" in ax.get_xlabel() and ax.get_ylabel() == "calibration loss"
    labels = [t.get_text() for t in ax.texts]
    assert labels == ["1.2500", "1.5000\n-L5", "2.1250\n-L2"]
    assert list(ax.lines[0].get_ydata()) == [1.25, 1.5, 2.125]
    assert write_search_png(tmp_path / "s.png", [4, 3], [1.0, 2.0], [None, 1], "t") is None
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_search_png_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    import sys

    from dsaflow.search.png import write_search_png

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib... raises ImportError
    note = write_search_png(tmp_path / "s.png", [2, 1], [1.0, 2.0], [None, 1], "t")
    assert "pip install 'dsaflow[plots]'" in note and "search.csv" in note
    assert not (tmp_path / "s.png").exists()


def test_cross_stage_scores_equal_one_stage_and_prefix_cache():
    """With cross-stage indices a stage may open on S: scores equal a single stage with the same roles, and the
    prefix-cached score equals a fresh evaluation whichever stage the first change lies in."""
    cfg, plan = planned_sharp("FFFF|FFFF", f"model.index_topk={TOPK}")
    stages = build_stages(cfg, plan, seed=3)
    one_cfg, one_plan = planned_sharp("FFFFFFFF", f"model.index_topk={TOPK}")
    (one,) = build_stages(one_cfg, one_plan, seed=3)
    ev = PatternEvaluator(stages, _batches(), torch.device("cpu"), cross_stage=True)
    ev.rebase(tuple("FFFFFFFF"))
    for roles in ("FSSSSSSS", "FFFFSSFS", "FFSFSFFS", "FFFFFSSS"):
        got = ev.score(tuple(roles))
        single = PatternEvaluator([one], _batches(), torch.device("cpu")).rebase(tuple(roles))
        assert got.loss == pytest.approx(single.loss, rel=1e-6), roles
        fresh = PatternEvaluator(stages, _batches(), torch.device("cpu"), cross_stage=True).rebase(tuple(roles))
        assert got.loss == pytest.approx(fresh.loss, rel=1e-6), roles
    assert stages[1].incoming_source is None  # the base (all F) is back in place
    with pytest.raises(ValueError, match="must stay F"):
        PatternEvaluator(stages, _batches(), torch.device("cpu")).rebase(tuple("FFFFSFFF"))


def test_dsaflow_search_with_cross_stage_indices_keeps_only_layer_0(tmp_path, capsys):
    from dsaflow import cli

    small = [
        "model.num_layers=4",
        "model.dim=32",
        "model.inter_dim=64",
        "model.index_topk=4",
        "train.seq_len=32",
        "train.batch_size=4",
        "data=retrieval_hard",
    ]
    rd = _fake_run(tmp_path, small)
    args = [
        "search",
        f"search.checkpoint={rd}",
        "search.calib_batches=1",
        "search.eval_batches=1",
        "search.target_f=1",
        "search.eval_ratios=[0.25]",
        "pipeline.boundaries=[0,2]",
        "pipeline.cross_stage_indices=true",
        f"search.out_dir={tmp_path / 'cross'}",
    ]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "cross" / "layout.txt").read_text().strip() == "FS|SS"
    assert 'layout="FS|SS" pipeline.cross_stage_indices=true' in out and "uniform 1/4 | 1 |" in out


def test_search_table_on_text_reports_bits_per_byte(tmp_path):
    from dsaflow import cli

    (tmp_path / "corpus").mkdir()
    for i in range(4):
        (tmp_path / "corpus" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 20)
    text = ["data=text", f"data.path={tmp_path / 'corpus'}", "data.suffixes=[.py]", "data.split=files"]
    text += ["data.val_fraction=0.25", "model.num_layers=4", "model.dim=32", "model.inter_dim=64"]
    rd = _fake_run(tmp_path, text + ["train.seq_len=32", "train.batch_size=4"])
    assert cli.main(["search", f"search.checkpoint={rd}", "search.calib_batches=1", "search.eval_batches=1"]) == 0
    rows = json.loads((rd / "search" / "eval.json").read_text())["rows"]
    assert [r["pattern"] for r in rows][:2] == ["all-F", "uniform 1/2"]
    assert all(r["bpb"] == pytest.approx(r["loss"] / math.log(2), rel=1e-12) for r in rows)
    assert "| bits per byte |" in (rd / "search" / "eval.md").read_text().splitlines()[0]
