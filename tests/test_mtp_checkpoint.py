"""Multi-token-prediction layers in and out of Hugging Face checkpoints: every MTP tensor of both families loads into
the last stage's MTP layer, an export writes each back under its name, import -> export -> import is bit-identical
(bf16 and FP8 checkpoints), and a tensor config.json does not declare is refused."""

import json
import shutil

import pytest
import torch

from dsaflow.checkpoint.hf_config import apply_hf_model, hf_model, read_config_json
from dsaflow.checkpoint.hf_export import write_hf_checkpoint
from dsaflow.checkpoint.hf_weights import load_hf_weights
from dsaflow.config.compose import compose
from dsaflow.errors import CheckpointError
from dsaflow.model import build_model
from tests.script_helpers import load_script

HF = load_script("hf_tiny_checkpoint")


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def with_mtp(request, tmp_path_factory):
    """(family, bf16 folder with an MTP layer, its FP8 copy)."""
    bf16 = HF.add_mtp_layer(HF.save_checkpoint(request.param, tmp_path_factory.mktemp("bf16")))
    return request.param, bf16, HF.write_fp8_copy(bf16, tmp_path_factory.mktemp("fp8") / "ckpt")


def planned_model(folder):
    """The ModelConfig a model=hf run builds from `folder`, and its layer roles."""
    cfg = compose(["model=hf", f"model.hf_path={folder}", "track=none"], model_source=apply_hf_model)
    return cfg.model, hf_model(read_config_json(folder)).roles


def loaded(folder):
    model_cfg, roles = planned_model(folder)
    model = build_model(model_cfg, roles=roles).float().eval()
    load_hf_weights({0: model}, folder, model_cfg, report=lambda m: None)
    return model_cfg, model


def test_mtp_tensors_load_export_and_load_again_bit_identical(with_mtp, tmp_path):
    family, bf16, fp8 = with_mtp
    for name, folder in (("bf16", bf16), ("fp8", fp8)):
        model_cfg, model = loaded(folder)
        assert model_cfg.mtp_layers == 1 and model.mtp is not None
        n = model_cfg.num_layers
        stored = HF.read_tensors(folder)
        mtp = model.mtp[str(n)]
        # the MTP layer's own tensors, as stored (bf16 -> fp32 exactly; FP8 ones dequantized by the loader)
        assert torch.equal(mtp.enorm.weight, stored[f"model.layers.{n}.enorm.weight"].float())
        assert torch.equal(mtp.head_norm.weight, stored[f"model.layers.{n}.shared_head.norm.weight"].float())
        assert torch.equal(mtp.embed.weight, stored[f"model.layers.{n}.embed_tokens.weight"].float())
        assert torch.equal(mtp.attn_norm.weight, stored[f"model.layers.{n}.input_layernorm.weight"].float())
        if name == "bf16":
            assert torch.equal(mtp.eh_proj.weight, stored[f"model.layers.{n}.eh_proj.weight"].float())
        out = write_hf_checkpoint(model.state_dict(), model_cfg, tmp_path / name, report=lambda m: None)
        exported = HF.read_tensors(out)
        want = {k for k in stored if not k.endswith("_scale_inv")}
        assert set(exported) == want  # tensor for tensor, the MTP layer's and its shared_head.head included
        if name == "bf16":
            for k, t in stored.items():
                assert torch.equal(exported[k].to(t.dtype), t), k
        assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
        HF.save_tokenizer(out)
        again_cfg, again = loaded(out)
        assert again_cfg.mtp_layers == 1
        first, second = model.state_dict(), again.state_dict()
        assert first.keys() == second.keys()
        for k in first:
            assert torch.equal(first[k], second[k]), k


def test_an_mtp_tensor_config_json_does_not_declare_is_refused(with_mtp, tmp_path):
    family, bf16, _ = with_mtp
    bad = tmp_path / "bad"
    shutil.copytree(bf16, bad)
    raw = json.loads((bad / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 0  # the MTP layer's tensors are still there
    (bad / "config.json").write_text(json.dumps(raw))
    hf = hf_model(read_config_json(bad))
    model = build_model(hf.model, roles=hf.roles).float()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"belongs to layer \d+, but config.json declares .* num_nextn"):
        load_hf_weights({0: model}, bad, hf.model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing loaded


def test_an_mtp_head_copy_that_differs_from_lm_head_is_refused(with_mtp, tmp_path):
    from safetensors.torch import save_file

    family, bf16, _ = with_mtp
    bad = tmp_path / "bad"
    shutil.copytree(bf16, bad)
    tensors = HF.read_tensors(bad)
    n = json.loads((bad / "config.json").read_text())["num_hidden_layers"]
    name = f"model.layers.{n}.shared_head.head.weight"
    mtp_shard = {k: v for k, v in tensors.items() if k.startswith(f"model.layers.{n}.")}
    mtp_shard[name] = mtp_shard[name] * 2
    save_file({k: v.contiguous() for k, v in mtp_shard.items()}, str(bad / "model-mtp.safetensors"))
    model_cfg, roles = planned_model(bad)
    model = build_model(model_cfg, roles=roles).float()
    with pytest.raises(CheckpointError, match="differs from lm_head.weight"):
        load_hf_weights({0: model}, bad, model_cfg)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A checkpoint whose config.json declares an MTP layer whose tensors it does not hold."""
    folder = HF.save_checkpoint("deepseek_v32", tmp_path_factory.mktemp("plain"))
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 1}))
    return folder


def test_a_checkpoint_without_the_declared_mtp_tensors_plans_without_mtp(plain, capsys):
    assert hf_model(read_config_json(plain)).mtp_layers == 1
    model_cfg, _ = planned_model(plain)
    assert model_cfg.mtp_layers == 0
    assert "no model.layers.3.* tensors: planned without multi-token prediction" in capsys.readouterr().err


def test_speculative_greedy_tokens_of_a_checkpoint_with_mtp_equal_plain_greedy(with_mtp):
    """The checkpoint's MTP layer drafts (random weights: mostly rejected); the tokens are the model's greedy ones."""
    from dsaflow.serve import reference as R
    from dsaflow.serve.speculative import allocate_speculative_caches, generate_speculative

    family, bf16, _ = with_mtp
    _, model = loaded(bf16)
    stages = {0: model}
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 96, (n,), generator=g).tolist() for n in (5, 11, 8)]
    limits = [9, 6, 12]
    want = R.generate(stages, R.allocate_caches(stages, 3, 48, 16), prompts, limits)
    got, stats = generate_speculative(stages, allocate_speculative_caches(stages, 3, 48, 16), prompts, limits, 2)
    assert got == want and stats.passes > 0


def test_glm_index_share_for_mtp_iteration_plans():
    """GLM-5.x config.json files carry index_share_for_mtp_iteration (a draft-chain knob): it is accepted."""
    from pathlib import Path

    raw = read_config_json(Path(__file__).parent / "fixtures" / "hf" / "glm_52")
    hf = hf_model({**raw, "index_share_for_mtp_iteration": True})
    assert hf.mtp_layers == 1 and hf.model.num_layers == 78
