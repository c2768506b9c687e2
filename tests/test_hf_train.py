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


def _train_hf(folder, corpus, run_dir, *overrides) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "from dsaflow.cli import main; main()", "train", "model=hf"]
    cmd += [f"model.hf_path={folder}", "data=text", f"data.path={corpus}", "pipeline=pp2", "train.steps=2"]
    cmd += ["train.batch_size=4", "train.seq_len=32", "train.eval_every=0", "train.eval_batches=1", "track=none"]
    cmd += [f"run_dir={run_dir}", *overrides]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


@pytest.mark.slow
def test_hf_weights_train_sharded_over_dp_as_one_replica(tmp_path):
    """pp2 x dp2 with FSDP2 sharding from a HF checkpoint: every rank reads its stages whole before sharding (and
    says so), and the losses are those of pp2 x dp1 with twice the microbatches (the same global batch)."""
    from dsaflow.rundir.folder import read_metrics

    folder = save_checkpoint("glm_moe_dsa", tmp_path / "ckpt")
    save_tokenizer(folder)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((TEXT + "\n") * 40)
    sharded = _train_hf(folder, corpus, tmp_path / "dp2", "parallel.dp=2", "parallel.dp_shard=true")
    one = _train_hf(folder, corpus, tmp_path / "dp1", "pipeline.microbatches=4")
    pattern = r"\[rank (\d)\] \(pp (\d), dp (\d)\) model weights from .*?: read ([\d.]+) MiB"
    read = {(int(pp), int(dp)): float(mib) for _, pp, dp, mib in re.findall(pattern, sharded.stdout)}
    assert set(read) == {(0, 0), (1, 0), (0, 1), (1, 1)}, sharded.stdout[-2000:]
    one_read = {int(r): float(mib) for r, mib in re.findall(r"\[rank (\d)\] model .*?: read ([\d.]+) MiB", one.stdout)}
    for (pp, _), mib in read.items():  # each replica reads what the one pipeline's rank reads: whole stages
        assert mib == one_read[pp] > 0, (read, one_read)
    losses = [[r["loss"] for r in read_metrics(tmp_path / run) if "loss" in r] for run in ("dp2", "dp1")]
    assert len(losses[0]) == 2 and len(set(losses[1])) == 2, losses
    for a, b in zip(*losses):
        assert abs(a - b) <= 1e-5 * abs(b), losses
