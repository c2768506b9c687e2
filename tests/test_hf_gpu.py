"""Hugging Face parity on the GPU, for both families' tiny random checkpoints:

- fp32: dsaflow's logits equal transformers' (both on the GPU) to 1e-4 of their scale, as on CPU;
- bf16: dsaflow in bf16 against transformers in fp32, within 3e-2 of the logits' scale. bf16 keeps 8 significant
  bits (a relative rounding of 2^-9 per stored value); the activations pass about 25 roundings on the way through a
  3-8 layer model (norms, projections, attention, experts), which random-walk to about 1e-2 of the scale;
- serving with CUDA graphs on (prefill and decode graphs, fp32): the greedy tokens equal transformers' `generate`.

    .venv/bin/python -m pytest -q -m gpu tests/test_hf_gpu.py
"""

import pytest
import torch

from dsaflow.checkpoint.hf_config import apply_hf_model, hf_model, read_config_json
from dsaflow.checkpoint.hf_weights import load_hf_weights
from dsaflow.config.compose import compose
from dsaflow.model import build_model
from dsaflow.plan import build_plan
from dsaflow.serve.generate import build_engine
from tests.script_helpers import load_script

HF = load_script("hf_tiny_checkpoint")
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def checkpoint(request, tmp_path_factory):
    return HF.save_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def _logits(folder, dtype):
    ref = HF.load_reference(folder).cuda().float().eval()
    hf = hf_model(read_config_json(folder))
    model = build_model(hf.model, roles=hf.roles).float().eval()
    load_hf_weights({0: model}, folder, hf.model, report=lambda msg: None)
    model = model.cuda().to(dtype)
    ids = torch.randint(2, hf.model.vocab_size, (3, 24), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        want = ref(ids).logits.float()
        got = model(ids).float()
    return (got - want).abs().max() / want.abs().max()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_logits_equal_transformers_on_the_gpu(checkpoint, dtype, tol):
    err = _logits(checkpoint, dtype)
    assert err < tol, f"{dtype}: max error {err:.2e} of the logits' scale"


def test_greedy_tokens_with_graphs_equal_transformers(checkpoint):
    g = torch.Generator().manual_seed(5)
    prompts = [
        [0] + torch.randint(2, 90, (n,), generator=g).tolist()
        for n in torch.randint(3, 20, (16,), generator=g).tolist()
    ]
    ref = HF.load_reference(checkpoint).float().eval()
    want_cpu = _greedy(ref, prompts, "cpu")
    want = _greedy(ref.cuda(), prompts, "cuda")
    overrides = ["mode=serve", "model=hf", f"model.hf_path={checkpoint}", "serve.dtype=fp32", "graphs=decode_prefill"]
    overrides += ["serve.max_batch=4", "serve.max_context=64", "serve.prefill_chunk=8", "serve.batching=fixed"]
    cfg = compose(overrides, model_source=apply_hf_model)
    cfg.graphs.blocks[0].shape_classes = [1, 2, 4]
    cfg.graphs.blocks[1].shape_classes = [8, 16, 32]
    engine = build_engine(cfg, build_plan(cfg), 0, "cuda:0", all_stages=True)
    report = engine.capture()
    assert report.records and all(r.status == "captured" for r in report.records)
    captures = engine.graphs.captures
    got = engine.generate(prompts, [6] * len(prompts))
    assert engine.graphs.captures == captures  # replays only
    assert got == want, (
        f"{sum(a != b for a, b in zip(got, want))} of 16 differ from transformers on the GPU, "
        f"{sum(a != b for a, b in zip(got, want_cpu))} from transformers on CPU; transformers GPU vs CPU: "
        f"{sum(a != b for a, b in zip(want, want_cpu))}"
    )


def _greedy(ref, prompts, device):
    out = []
    for p in prompts:
        with torch.no_grad():
            gen = ref.generate(torch.tensor([p], device=device), max_new_tokens=6, do_sample=False, eos_token_id=None)
        out.append(gen[0, len(p) :].tolist())
    return out
