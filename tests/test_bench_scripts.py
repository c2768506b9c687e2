"""The benchmark scripts' front door: none edits sys.path, every `scripts/bench_*.py` (and every subcommand of the
families) answers --help with its own usage and options, and a missing GPU or a wrong subcommand is one line and
exit 2."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from script_helpers import load_script

from dsaflow.ops.indexer_topk.naive import indexer_topk_naive

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
BENCH_SCRIPTS = sorted(p.stem for p in SCRIPTS.glob("bench_*.py") if p.stem != "bench_lib")
FAMILIES = {
    "bench_train": {
        "pipeline": "--schedules",
        "layer": "--impls",
        "stage": "--skip-after-oom",
        "step": "--microbatches",
    },
    "bench_serve": {
        "engine": "--pipelines",
        "rank": "--rank",
        "decode": "--merge",
        "p2p": "--compute-ms",
        "stage": "--decode-context",
        "http": "--concurrency",
    },
    "bench_topk": {"select": "--keys", "indexer": "--no-sweeps", "decode": "--out", "finish": "--out"},
}
# an option only that script has: its --help is its own, not a neighbour's
OWN_OPTION = {
    "bench_ops": "--only",
    "bench_indexer_loss": "--layouts",
    "bench_dense_warmup": "--op-layers",
    "bench_indexcache": "--sdpa-repeats",
    "bench_moe": "--decode-rows",
    "bench_fp8": "--grouped-tokens",
    "bench_kv_fp8": "--context",
    "bench_speculative": "--mtp-weight",
}


def test_no_script_edits_sys_path():
    """Scripts import bench_lib and their neighbours as `python scripts/x.py` finds them, and dsaflow as installed."""
    offenders = []
    for path in sorted(SCRIPTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
                offenders.append(f"{path.relative_to(SCRIPTS)}:{node.lineno}")
    assert not offenders, offenders


def test_every_bench_script_is_a_family_or_has_its_own_option():
    assert set(BENCH_SCRIPTS) == set(FAMILIES) | set(OWN_OPTION)


@pytest.mark.parametrize("name", sorted(OWN_OPTION))
def test_bench_script_help_shows_its_own_usage_and_options(name, capsys):
    with pytest.raises(SystemExit) as e:
        load_script(name).main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"usage: {name}.py") and OWN_OPTION[name] in out, out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_help_lists_its_subcommands(family, capsys):
    assert load_script(family).main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {family}.py {{{','.join(FAMILIES[family])}}}")
    for sub in FAMILIES[family]:
        assert f"\n  {sub} " in out, out


@pytest.mark.parametrize("family,sub", [(f, s) for f, subs in FAMILIES.items() for s in subs])
def test_subcommand_help_shows_its_own_usage_and_options(family, sub, capsys):
    with pytest.raises(SystemExit) as e:
        load_script(family).main([sub, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"usage: {family}.py {sub}") and FAMILIES[family][sub] in out, out


def test_serve_rank_help_is_its_own():
    """`bench_serve.py rank` takes --pipeline and --rank, not the engine's --pipelines."""
    r = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_serve.py"), "rank", "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0 and r.stdout.startswith("usage: bench_serve.py rank"), r.stdout + r.stderr
    assert "--rank" in r.stdout and "--pipeline " in r.stdout and "--pipelines" not in r.stdout


def test_an_unknown_subcommand_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        load_script("bench_serve").main(["serve", "--device", "cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "'serve' is not a subcommand" in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: --device cuda would run")
@pytest.mark.parametrize("argv", [["engine"], ["rank"], ["decode"]])
def test_device_cuda_without_a_gpu_is_one_line_and_exit_2(argv, tmp_path):
    r = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_serve.py"), *argv, "--device", "cuda", "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--device cuda" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "o").exists()


def test_the_topk_baseline_selects_what_the_reference_op_selects():
    """bench_topk's baseline (the op's logits kernel, in the Triton interpreter here, + torch.topk) against the naive
    op: the same keys in the op's order, -1 where fewer than top-k keys are visible."""
    select = load_script("benches.topk_select")
    g = torch.Generator().manual_seed(0)
    q, k, w = (
        torch.randn(2, 5, 2, 16, generator=g),
        torch.randn(2, 40, 16, generator=g),
        torch.randn(2, 5, 2, generator=g),
    )
    pos = torch.tensor([[3, 10, 20, 30, 39], [0, 1, 2, 5, 6]])
    got = select.torch_topk_indexer(q, k, w, pos, 8)
    ref = indexer_topk_naive(q, k, w, pos, 8)
    assert torch.equal(got, ref) and (got[1] == -1).sum() == 7 + 6 + 5 + 2 + 1
    assert select.same_selection(got, ref, select.indexer_logits(q, k, w, pos))
    inf = float("-inf")
    assert torch.equal(
        select.torch_topk_select(torch.tensor([[[0.5, inf, 2.0]]]), 4), torch.tensor([[[0, 2, -1, -1]]]).int()
    )


def test_same_selection_accepts_other_tied_keys_and_rejects_other_scores():
    select = load_script("benches.topk_select")
    scores = torch.tensor([[[1.0, 1.0, 0.0, 1.0]]])
    pick = lambda *keys: torch.tensor([[list(keys)]], dtype=torch.int32)  # noqa: E731
    assert select.same_selection(pick(0, 1), pick(1, 3), scores)
    assert not select.same_selection(pick(0, 1), pick(0, 2), scores)
    assert not select.same_selection(pick(0, 1), pick(0, -1), scores)
