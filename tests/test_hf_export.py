"""Weights out: dsaflow models written as Hugging Face checkpoints load in transformers with equal logits, and a
model trained by `dsaflow train` goes out and back in with the same greedy tokens.

The models use 16 indexer heads (tiny_moe has 4): with 4, a key whose relu logits are all 0 on every head scores
exactly 0 for about 1 key in 16, and such ties at the top-k boundary are broken differently (torch.topk's order in
transformers, the lower key index here), which changes the attended set, not the mapping under test."""

import json
import os
import subprocess
import sys

import pytest
import torch

from dsaflow.checkpoint.hf_export import write_hf_checkpoint
from dsaflow.cli import main
from dsaflow.config.compose import compose
from dsaflow.errors import ConfigError
from dsaflow.model import build_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MOE = ["model=tiny_moe", "model.index_n_heads=16"]


def transformers_logits(folder, ids):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return type(ref).__name__, ref(ids).logits


@pytest.mark.parametrize(
    "roles, family", [("FFFFFFFF", "DeepseekV32ForCausalLM"), ("FSFSSFFS", "GlmMoeDsaForCausalLM")]
)
def test_export_loads_in_transformers_with_equal_logits(tmp_path, roles, family):
    cfg = compose(TINY_MOE).model
    model = build_model(cfg, roles=roles, seed=4).eval()
    notes = []
    write_hf_checkpoint(model.state_dict(), cfg, tmp_path / "out", report=notes.append)
    assert any("indexer key LayerNorm eps 1e-05" in n for n in notes)  # transformers builds it with 1e-6
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    if family.startswith("Glm"):
        assert "".join("F" if t == "full" else "S" for t in raw["indexer_types"]) == roles
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))  # 40 > index_topk = 16
    name, want = transformers_logits(tmp_path / "out", ids)
    with torch.no_grad():
        got = model(ids)
    assert name == family
    assert (got - want).abs().max() / want.abs().max() < 1e-4


def test_a_dense_mlp_model_is_refused(tmp_path):
    cfg = compose(["model=tiny"]).model
    with pytest.raises(ConfigError, match="dense MLPs only"):
        write_hf_checkpoint(build_model(cfg).state_dict(), cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def train(run_dir, *overrides):
    cmd = [sys.executable, "-c", "from dsaflow.cli import main; main()", "train", *overrides]
    cmd += ["train.steps=2", "train.batch_size=2", "train.seq_len=64", "train.eval_every=0", "train.eval_batches=1"]
    cmd += ["track=none", f"run_dir={run_dir}"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.slow
def test_trained_tiny_moe_round_trip(tmp_path, capsys):
    from dsaflow.plan import build_plan
    from dsaflow.serve.generate import build_engine

    run = tmp_path / "run"
    train(run, *TINY_MOE, "index=every2")
    out = tmp_path / "hf"
    assert main(["export", f"export.checkpoint={run}", f"export.out_dir={out}"]) == 0
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    name, want = transformers_logits(out, ids)
    assert name == "GlmMoeDsaForCausalLM"  # index=every2: S layers without indexers -> GLM's shared layers

    serve = ["mode=serve", "serve.max_context=64", "serve.prefill_chunk=16", "track=none"]
    trained = compose([*TINY_MOE, "index=every2", f"serve.checkpoint={run}", *serve])
    from dsaflow.checkpoint.hf_config import apply_hf_model

    again = compose(["model=hf", f"model.hf_path={out}", *serve], model_source=apply_hf_model)
    prompts = [ids[0, :n].tolist() for n in (5, 17, 30)]
    tokens = []
    for cfg in (trained, again):
        engine = build_engine(cfg, build_plan(cfg), 0, "cpu", all_stages=True)
        engine.capture()
        tokens.append(engine.generate(prompts, [8, 8, 8]))
        if cfg is trained:
            with torch.no_grad():
                got = engine.stages[0](ids)
            assert (got - want).abs().max() / want.abs().max() < 1e-4
    assert tokens[0] == tokens[1]


@pytest.mark.slow
def test_export_of_a_dense_run_exits_2(tmp_path, capsys):
    run = tmp_path / "run"
    train(run, "model=tiny", "model.num_layers=2")
    assert main(["export", f"export.checkpoint={run}", f"export.out_dir={tmp_path / 'hf'}"]) == 2
    err = capsys.readouterr().err
    assert "dense MLPs only" in err and "Traceback" not in err
    assert not (tmp_path / "hf").exists()
    assert main(["export", f"export.checkpoint={run}", f"export.out_dir={run / 'hf'}"]) == 2  # never into a run
    assert "export.out_dir" in capsys.readouterr().err and not (run / "hf").exists()
