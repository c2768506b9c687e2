"""train.init_from: a new run from another run's model weights (fresh optimiser), with a new top-k or an index
layout whose S layers drop their indexers; every misuse exits 2 before anything starts."""

from __future__ import annotations

import pytest

from dsaflow import cli
from dsaflow.checkpoint.safetensors_io import load_tensors
from dsaflow.checkpoint.store import newest_good_checkpoint

TINY = ["track=none", "train.progress=off", "train.eval_every=0", "train.eval_batches=1", "train.batch_size=4"]


def _weights(run_dir):
    ckpt = newest_good_checkpoint(run_dir)[1]
    out = {}
    for f in sorted(ckpt.glob("model-rank*.safetensors")):
        out.update(load_tensors(f))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    rd = tmp_path_factory.mktemp("init") / "allf"
    assert cli.main(["train", *TINY, "train.steps=3", f"run_dir={rd}"]) == 0
    return rd


@pytest.fixture(scope="module")
def every4(trained, tmp_path_factory):
    """all-F at top-16 -> every4 at top-8: one step at a negligible lr from `trained`'s weights (a launch of its own,
    shared by the two tests that read an every4 run)."""
    new = tmp_path_factory.mktemp("init") / "every4"
    args = ["train", *TINY, "train.steps=1", "train.lr=1e-9", "train.indexer_lr=1e-9", "index=every4"]
    assert cli.main([*args, "model.index_topk=8", f"train.init_from={trained}", f"run_dir={new}"]) == 0
    return new


def test_a_new_run_starts_from_the_weights_with_a_new_topk_and_layout(trained, every4):
    """all-F at top-16 -> every4 at top-8 (`every4`): one step at a negligible lr leaves every weight the new model
    has where the checkpoint put it (S layers simply have no indexer), and the run's log names the checkpoint."""
    new = every4
    before, after = _weights(trained), _weights(new)
    assert set(after) < set(before) and any(".attn.indexer." in k for k in set(before) - set(after))
    for k, t in after.items():
        assert (t.float() - before[k].float()).abs().max() < 1e-5, k
    assert "model weights from" in (new / "train.log").read_text()


@pytest.mark.parametrize(
    "extra,message",
    [
        (["train.resume=true"], "with train.resume=true"),
        (["model.dim=48"], "was trained with a different model (model.dim"),
    ],
)
def test_misuse_exits_2_before_launch(trained, tmp_path, capsys, extra, message):
    rc = cli.main(["train", *TINY, "train.steps=1", f"train.init_from={trained}", f"run_dir={tmp_path / 'r'}", *extra])
    assert rc == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_missing_path_exits_2(tmp_path, capsys):
    rc = cli.main(["train", *TINY, f"train.init_from={tmp_path / 'nope'}", f"run_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "train.init_from=" in err and "does not exist" in err


def test_a_layer_trained_as_s_cannot_become_f(every4, tmp_path, capsys):
    """every4 -> all-F: the S layers' indexers were never trained (`every4` has none); the run stops with the field
    and the fix."""
    src = every4
    rc = cli.main(["train", *TINY, "train.steps=1", f"train.init_from={src}", f"run_dir={tmp_path / 'r'}"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "train.init_from=" in err and "has no weights for" in err and "cannot become F" in err
