"""A checkpoint without indexer weights on its S layers implies index.promote=false; an F layer without one is an
error."""

import pytest
import torch

from dsaflow.checkpoint.indexer_weights import indexer_layers, plan_for_checkpoint
from dsaflow.checkpoint.safetensors_io import save_file
from dsaflow.cli import main
from dsaflow.errors import PlanError
from dsaflow.plan import build_plan
from tests.planner_helpers import make_cfg

ROLES = "FSSSFSSS"  # what an index.pattern=FSSS run of the tiny model saves: indexers on layers 0 and 4 only


def fake_checkpoint(folder, roles=ROLES):
    """model-rank0.safetensors with one MLA weight per layer and an indexer weight on each F layer."""
    folder.mkdir(parents=True)
    tensors = {f"layers.{i}.attn.wkv_a.weight": torch.zeros(2, 2) for i in range(len(roles))}
    tensors.update({f"layers.{i}.attn.indexer.wk.weight": torch.zeros(2, 2) for i, r in enumerate(roles) if r == "F"})
    save_file(tensors, folder / "model-rank0.safetensors", {"format": "test"})
    return folder


def serve_cfg(ckpt, **knobs):
    return make_cfg(**{"mode": "serve", "serve.checkpoint": str(ckpt), "index.pattern": "FSSS", **knobs})


def test_reads_the_layers_that_carry_an_indexer(tmp_path):
    assert indexer_layers(fake_checkpoint(tmp_path / "c")) == {0, 4}


def test_a_promotion_without_weights_implies_no_promotion(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "c")
    said = []
    cfg = serve_cfg(ckpt, **{"pipeline.boundaries": [2]})
    assert any(l.promoted for l in build_plan(cfg).layers)  # what the config alone would do
    with pytest.raises(PlanError, match=r"stage 1 at layer 2 starts on an S layer") as e:
        plan_for_checkpoint(cfg, "generate", build_plan, said.append)
    assert "index.promote=false" in e.value.args[0] and len(said) == 1 and "index.promote=false" in said[0]
    cfg = serve_cfg(ckpt, **{"pipeline.boundaries": [2], "pipeline.cross_stage_indices": True})
    plan = plan_for_checkpoint(cfg, "generate", build_plan, said.append)  # the indices cross: nothing to promote
    assert plan.index_boundaries == (0,) and not any(l.promoted for l in plan.layers) and plan.layers[2].source == 0
    # automatic splits move to F boundaries; a split that promotes nothing keeps the config as it was, silently
    cfg = serve_cfg(ckpt, **{"pipeline.stages": 2, "pipeline.balance": "layers", "index.pattern": "FSSSSFSS"})
    fake_checkpoint(tmp_path / "d", "FSSSSFSS")
    cfg.serve.checkpoint = str(tmp_path / "d")
    assert [s.layers[0] for s in build_plan(cfg).stages] == [0, 4]  # layer 4 is S: promoted
    plan = plan_for_checkpoint(cfg, "generate", build_plan, said.append)
    assert [s.layers[0] for s in plan.stages] == [0, 5] and cfg.index.promote is False and len(said) == 2
    cfg = serve_cfg(ckpt, **{"pipeline.boundaries": [4]})
    plan_for_checkpoint(cfg, "generate", build_plan, said.append)
    assert cfg.index.promote is True and len(said) == 2


def test_f_without_indexer_weights_is_an_error(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "c")
    cfg = serve_cfg(ckpt, **{"index.pattern": None, "layout": "FFSSFSSS"})
    with pytest.raises(PlanError, match=r"no indexer weights on layers \[1\], which the config declares F"):
        plan_for_checkpoint(cfg, "generate", build_plan)


def test_plan_command_in_serve_mode_exits_2(tmp_path, capsys):
    ckpt = fake_checkpoint(tmp_path / "c")
    code = main(["plan", "mode=serve", f"serve.checkpoint={ckpt}", "index.pattern=FSSS", "pipeline.boundaries=[2]"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "index.promote=false" in err and "Traceback" not in err


def test_a_checkpoint_without_weight_files_is_left_to_the_loader(tmp_path):
    folder = tmp_path / "c"
    folder.mkdir()
    assert indexer_layers(folder) is None
    cfg = serve_cfg(folder, **{"pipeline.boundaries": [2]})
    assert plan_for_checkpoint(cfg, "generate", build_plan).layers[2].promoted
