"""`dsaflow train model=hf model.hf_path=DIR data=text`: the weights come from the checkpoint (each rank reads
only its stages' tensors) and the text is tokenized by the checkpoint's tokenizer.json."""

import os
import re
import subprocess
import sys

import pytest

from tests.script_helpers import load_script

HF = load_script("hf_tiny_checkpoint")
TEXT = HF.TEXT
save_checkpoint = HF.save_checkpoint
save_tokenizer = HF.save_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_train_from_a_hf_checkpoint_with_its_tokenizer(tmp_path):
    folder = save_checkpoint("glm_moe_dsa", tmp_path / "ckpt")
    save_tokenizer(folder)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((TEXT + "\n") * 40)  # bytes such as 'q' (113) lie outside the model's 96 ids
    cmd = [sys.executable, "-c", "from dsaflow.cli import main; main()", "train", "model=hf"]
    cmd += [f"model.hf_path={folder}", "data=text", f"data.path={corpus}", "pipeline=pp2", "train.steps=2"]
    cmd += ["train.batch_size=2", "train.seq_len=32", "train.eval_every=0", "train.eval_batches=1", "track=none"]
    cmd += [f"run_dir={tmp_path / 'run'}"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    read = dict(re.findall(r"\[rank (\d)\] model weights from .*?: read ([\d.]+) MiB", res.stdout))
    assert set(read) == {"0", "1"} and float(read["0"]) > 0 and float(read["1"]) > 0
    assert "planned with index.promote=false" in res.stderr  # GLM's shared layers carry no indexer
