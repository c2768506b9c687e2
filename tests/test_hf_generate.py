"""`dsaflow generate model=hf model.hf_path=DIR` (greedy) returns transformers' `generate` tokens for 16 prompts,
on pipeline=single and pipeline=pp2 (two gloo workers), for both families; the checkpoint's tokenizer.json encodes
text prompts as transformers' AutoTokenizer does."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.script_helpers import load_script

HF = load_script("hf_tiny_checkpoint")
load_reference = HF.load_reference
save_checkpoint = HF.save_checkpoint
save_tokenizer = HF.save_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_NEW = 6


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def checkpoint(request, tmp_path_factory):
    folder = save_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    save_tokenizer(folder)
    return folder


def prompts():
    g = torch.Generator().manual_seed(5)
    rows = [{"prompt": "the lazy dog picks the keys"}]  # text: the checkpoint's tokenizer encodes it
    for n in torch.randint(3, 20, (15,), generator=g).tolist():
        rows.append({"prompt": [0] + torch.randint(2, 90, (n,), generator=g).tolist()})
    return rows


def transformers_tokens(folder, rows):
    from transformers import AutoTokenizer

    ref, tok = load_reference(folder), AutoTokenizer.from_pretrained(folder)
    out = []
    for r in rows:
        ids = tok(r["prompt"]).input_ids if isinstance(r["prompt"], str) else r["prompt"]
        with torch.no_grad():
            gen = ref.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
        out.append(gen[0, len(ids) :].tolist())
    return out


@pytest.fixture(scope="module")
def reference(checkpoint):
    """(prompt rows, transformers' greedy tokens for them) of `checkpoint`: one reference for both pipelines."""
    rows = prompts()
    return rows, transformers_tokens(checkpoint, rows)


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", ["single", "pp2"])
def test_generate_matches_transformers(checkpoint, reference, pipeline, tmp_path):
    rows, want = reference
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-c", "from dsaflow.cli import main; main()", "generate", "model=hf"]
    cmd += [f"model.hf_path={checkpoint}", f"pipeline={pipeline}", f"serve.prompts_file={path}"]
    cmd += [f"serve.output_file={out}", f"serve.max_new_tokens={MAX_NEW}", "serve.max_context=64"]
    cmd += ["serve.prefill_chunk=8", "serve.max_batch=4", "track=none", f"run_dir={tmp_path / 'run'}"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["tokens"] for r in got] == want
    assert "MiB of weights from" in res.stdout
