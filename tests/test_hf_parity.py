"""dsaflow's model against transformers' DeepSeek-V3.2 and GLM-5.x on tiny random checkpoints, fp32 on CPU: the
logits agree to 1e-4 (relative to their scale), and every F layer selects the same top-k key set."""

import pytest
import torch

from dsaflow.checkpoint.hf_config import hf_model, read_config_json
from dsaflow.checkpoint.hf_weights import load_hf_weights
from dsaflow.model import Indexer, build_model
from dsaflow.ops import indexer_topk
from tests.script_helpers import load_script

HF = load_script("hf_tiny_checkpoint")
load_reference = HF.load_reference
save_checkpoint = HF.save_checkpoint

FAMILIES = ["deepseek_v32", "glm_moe_dsa"]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    folder = save_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, folder


def dsaflow_model(folder):
    hf = hf_model(read_config_json(folder))
    model = build_model(hf.model, roles=hf.roles).float().eval()
    nbytes = load_hf_weights({0: model}, folder, hf.model, report=lambda msg: None)
    return hf, model, nbytes


def test_config_maps_the_family(checkpoint):
    family, folder = checkpoint
    hf = hf_model(read_config_json(folder))
    assert hf.family == family
    if family == "glm_moe_dsa":
        assert hf.roles == "FFSSFSSF"  # index_topk_freq=3, index_skip_topk_offset=2
        assert hf.model.norm_eps == 1e-5 and hf.model.rope_scaling is None
    else:
        assert hf.roles == "FFF" and hf.model.rope_scaling.factor == 4.0
    assert hf.model.latent_norm_eps == 1e-6 and hf.model.index_norm_eps == 1e-6
    assert hf.model.moe.dense_layers == [0] and hf.model.index_rope_head_dim == 8


def test_logits_and_topk_equal_transformers(checkpoint):
    family, folder = checkpoint
    ref = load_reference(folder)
    hf, model, nbytes = dsaflow_model(folder)
    assert nbytes > 0
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, hf.model.vocab_size, (3, 24), generator=g)  # 24 tokens > index_topk = 8

    theirs_topk, ours_topk = {}, {}
    hooks = [
        m.register_forward_hook(lambda mod, args, out, i=i: theirs_topk.__setitem__(i, out))
        for i, layer in enumerate(ref.model.layers)
        if (m := layer.self_attn.indexer) is not None
    ]
    with torch.no_grad():
        want = ref(ids).logits.float()
    for h in hooks:
        h.remove()

    def keep(i):
        return lambda mod, args, out: ours_topk.__setitem__(i, out)

    for name, m in model.named_modules():
        if isinstance(m, Indexer):
            m.register_forward_hook(keep(int(name.split(".")[1])))
    with torch.no_grad():
        got = model(ids)

    scale = want.abs().max()
    assert (got - want).abs().max() / scale < 1e-4, (got - want).abs().max() / scale
    f_layers = [i for i, r in enumerate(hf.roles) if r == "F"]
    assert sorted(theirs_topk) == sorted(ours_topk) == f_layers
    pos = torch.arange(24).expand(3, 24)
    for i in f_layers:
        q, k, w = ours_topk[i]
        mine = indexer_topk(q, k, w, pos, hf.model.index_topk)
        for t in range(24):
            theirs = {int(j) for j in theirs_topk[i][:, t].flatten().tolist() if j <= t}  # HF keeps masked keys too
            for b in range(3):
                ref_set = {int(j) for j in theirs_topk[i][b, t].tolist() if j <= t}
                assert {int(j) for j in mine[b, t].tolist() if j >= 0} == ref_set, (i, b, t)
            assert theirs  # every query sees at least itself
