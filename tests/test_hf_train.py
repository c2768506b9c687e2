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


def _train_hf(folder, corpus, run_dir, *overrides) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "from dsaflow.cli import main; main()", "train", "model=hf"]
    cmd += [f"model.hf_path={folder}", "data=text", f"data.path={corpus}", "pipeline=pp2", "train.steps=2"]
    cmd += ["train.batch_size=4", "train.seq_len=32", "train.eval_every=0", "train.eval_batches=1", "track=none"]
    cmd += [f"run_dir={run_dir}", *overrides]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    """One tiny GLM checkpoint with its tokenizer.json, trained through the CLI twice (each launch starts a parent,
    torchrun and a process per rank: seconds of imports each, so the two tests share them): pp2 x dp1 with 4
    microbatches, and pp2 x dp2 FSDP2-sharded with 2 per replica (the same global batch) -> (dp1, dp2, root)."""
    root = tmp_path_factory.mktemp("hf_train")
    folder = save_checkpoint("glm_moe_dsa", root / "ckpt")
    save_tokenizer(folder)
    corpus = root / "corpus.txt"
    corpus.write_text((TEXT + "\n") * 40)  # bytes such as 'q' (113) lie outside the model's 96 ids
    one = _train_hf(folder, corpus, root / "dp1", "pipeline.microbatches=4")
    sharded = _train_hf(folder, corpus, root / "dp2", "parallel.dp=2", "parallel.dp_shard=true")
    return one, sharded, root


@pytest.mark.slow
def test_train_from_a_hf_checkpoint_with_its_tokenizer(hf_runs):
    """The pp2 run (`hf_runs`' dp1 launch): each rank reads its stages' tensors of the checkpoint, and the text is
    tokenized by its tokenizer.json."""
    res = hf_runs[0]
    read = dict(re.findall(r"\[rank (\d)\] model weights from .*?: read ([\d.]+) MiB", res.stdout))
    assert set(read) == {"0", "1"} and float(read["0"]) > 0 and float(read["1"]) > 0
    assert "planned with index.promote=false" in res.stderr  # GLM's shared layers carry no indexer


@pytest.mark.slow
def test_hf_weights_train_sharded_over_dp_as_one_replica(hf_runs):
    """pp2 x dp2 with FSDP2 sharding from a HF checkpoint: every rank reads its stages whole before sharding (and
    says so), and the losses are those of pp2 x dp1 with twice the microbatches (the same global batch)."""
    from dsaflow.rundir.folder import read_metrics

    one, sharded, root = hf_runs
    pattern = r"\[rank (\d)\] \(pp (\d), dp (\d)\) model weights from .*?: read ([\d.]+) MiB"
    read = {(int(pp), int(dp)): float(mib) for _, pp, dp, mib in re.findall(pattern, sharded.stdout)}
    assert set(read) == {(0, 0), (1, 0), (0, 1), (1, 1)}, sharded.stdout[-2000:]
    one_read = {int(r): float(mib) for r, mib in re.findall(r"\[rank (\d)\] model .*?: read ([\d.]+) MiB", one.stdout)}
    for (pp, _), mib in read.items():  # each replica reads what the one pipeline's rank reads: whole stages
        assert mib == one_read[pp] > 0, (read, one_read)
    losses = [[r["loss"] for r in read_metrics(root / run) if "loss" in r] for run in ("dp2", "dp1")]
    assert len(losses[0]) == 2 and len(set(losses[1])) == 2, losses
    for a, b in zip(*losses):
        assert abs(a - b) <= 1e-5 * abs(b), losses
