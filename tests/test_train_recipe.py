"""The DSA recipe on one rank: dense_warmup trains only the indexers (main weights bit-identical), sparse trains
everything; lr schedule; a non-finite gradient skips the update instead of poisoning the weights."""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from train_harness import tiny_cfg

from dsaflow.pipeline.run_context import RunContext
from dsaflow.plan import build_plan
from dsaflow.train.optim import advance, build_optimizers, build_schedulers, lr_factor
from dsaflow.train.trainer import Trainer


@pytest.fixture
def trainer(tmp_path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = tiny_cfg(1, None, "1F1B", steps=4, dense_warmup_steps=1)
    ctx = RunContext(cfg, build_plan(cfg), 0, 1, 0, torch.device("cpu"), Path(tmp_path))
    yield Trainer(ctx)
    dist.destroy_process_group()


def _snapshot(tr):
    return {tr.opt.names[p]: p.detach().clone() for p in tr.opt.names}


def test_dense_warmup_trains_only_indexers_then_sparse_trains_all(trainer):
    before = _snapshot(trainer)
    m = trainer.step(0)
    assert m["dense"] == 1.0 and m["indexer_loss"] > 0
    after = _snapshot(trainer)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    indexer = {k for k in before if ".attn.indexer." in k}
    assert changed == indexer, (
        f"dense_warmup changed {sorted(changed - indexer)[:3]}, missed {sorted(indexer - changed)[:3]}"
    )
    # no LM backward ran: the frozen main weights got no gradient at all, every indexer weight did
    assert all(p.grad is None for p in trainer.opt.main_params) and m["grad_norm"] == 0.0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.opt.indexer_params)
    assert all(p.requires_grad for p in trainer.opt.names)  # the freeze is undone after the step
    m = trainer.step(1)
    assert m["dense"] == 0.0
    final = _snapshot(trainer)
    assert all(not torch.equal(after[k], final[k]) for k in after if k not in indexer and "norm" not in k)


def test_evaluation_leaves_gradients_and_weights_untouched(trainer):
    """Evaluation is forward-only: the step's gradients stay as they were, nothing moves, the metrics are real."""
    trainer.step(1)
    grads = {k: p.grad.clone() for p, k in trainer.opt.names.items() if p.grad is not None}
    weights = _snapshot(trainer)
    out = trainer.evaluate(1)
    assert math.isfinite(out["eval_loss"]) and out["eval_loss"] > 0 and 0.0 <= out["eval_acc"] <= 1.0
    assert {k: p.grad for p, k in trainer.opt.names.items() if p.grad is not None}.keys() == grads.keys()
    assert all(torch.equal(p.grad, grads[k]) for p, k in trainer.opt.names.items() if p.grad is not None)
    assert all(torch.equal(v, _snapshot(trainer)[k]) for k, v in weights.items())
    assert trainer.evaluate(1)["eval_loss"] == out["eval_loss"]  # deterministic: the same batches, the same loss


def test_nonfinite_gradient_skips_the_update(trainer):
    before = _snapshot(trainer)
    wo = trainer.modules[0].layers["1"].attn.wo.weight
    hook = wo.register_hook(lambda g: torch.full_like(g, float("nan")))
    m = trainer.step(1)  # sparse step: main weights would move
    hook.remove()
    assert math.isnan(m["grad_norm"]) and m["skipped_main"] == 1.0 and m["skipped_indexer"] == 0.0
    after = _snapshot(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before if ".attn.indexer." not in k)
    assert all(torch.isfinite(v).all() for v in after.values())


def test_lr_schedule_warmup_then_cosine():
    f = [lr_factor(s, 100, 10, 0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0) and f[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert lr_factor(100, 100, 10, 0.1) == pytest.approx(0.1)


def test_lambdalr_schedulers_follow_lr_factor_and_resume_in_place():
    """torch's LambdaLR drives the schedule: step s trains at lr * lr_factor(s) for both optimisers, and schedulers
    positioned at a resumed step give the lrs the uninterrupted run had."""
    cfg = tiny_cfg(1, None, "1F1B", steps=12, warmup_steps=3, lr=2e-3, indexer_lr=5e-4)
    t = cfg.train
    model = torch.nn.ModuleDict(
        {
            "layers": torch.nn.ModuleDict(
                {
                    "0": torch.nn.ModuleDict(
                        {"attn": torch.nn.ModuleDict({"indexer": torch.nn.Linear(2, 2)}), "w": torch.nn.Linear(2, 2)}
                    )
                }
            )
        }
    )
    opt = build_optimizers([model], t)
    scheds = build_schedulers(opt, t)
    seen = []
    for _ in range(t.steps):
        seen.append((opt.main.param_groups[0]["lr"], opt.indexer.param_groups[0]["lr"]))
        advance(scheds)
    for step, (main_lr, idx_lr) in enumerate(seen):
        f = lr_factor(step, t.steps, t.warmup_steps, t.min_lr_ratio)
        assert main_lr == pytest.approx(t.lr * f) and idx_lr == pytest.approx(t.indexer_lr * f)
    opt2 = build_optimizers([model], t)
    build_schedulers(opt2, t, start_step=7)
    assert opt2.main.param_groups[0]["lr"] == pytest.approx(seen[7][0])
    assert opt2.indexer.param_groups[0]["lr"] == pytest.approx(seen[7][1])


def test_text_evaluation_reports_bits_per_byte(tmp_path, trainer):
    """Byte tokens: eval_bpb = eval_loss / ln 2 (nats per byte -> bits per byte); retrieval has accuracy instead."""
    assert "eval_bpb" not in trainer.evaluate(0)
    (tmp_path / "corpus").mkdir()
    for i in range(4):
        (tmp_path / "corpus" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 20)
    cfg = tiny_cfg(1, None, "1F1B", steps=1)
    cfg.data.kind, cfg.data.path, cfg.data.suffixes = "text", str(tmp_path / "corpus"), [".py"]
    cfg.data.split, cfg.data.val_fraction = "files", 0.25
    ctx = RunContext(cfg, build_plan(cfg), 0, 1, 0, torch.device("cpu"), Path(tmp_path))
    out = Trainer(ctx).evaluate(0)
    assert "eval_acc" not in out and out["eval_bpb"] == pytest.approx(out["eval_loss"] / math.log(2), rel=1e-12)
    assert 4 < out["eval_bpb"] < 12  # an untrained model over 256 byte values: about 8 bits


def test_the_training_step_fits_on_one_screen():
    """Trainer.step reads top to bottom: zero_grad, batch, schedule, clip, optimisers, lr schedule in <= 40 lines."""
    lines = inspect.getsource(Trainer.step).splitlines()
    assert len(lines) <= 40, f"Trainer.step is {len(lines)} lines: move bookkeeping into helpers (train/metrics.py)"
    body = "\n".join(lines)
    for call in ("zero_grad", "self.data.batch", "clip_global", ".step()", "advance(self.scheds)"):
        assert call in body, f"Trainer.step no longer shows {call}"
