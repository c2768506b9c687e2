"""Speculative decoding with the MTP layer: train a model with one MTP layer on real text, then measure the acceptance
of each draft position and decode tokens/s at batch 1 and batch 64 for K = 0 (plain greedy decoding), 1, 2, 3.

    python scripts/bench_speculative.py --out bench_out/speculative                  # one GPU: model=small, ~6 min
    python scripts/bench_speculative.py --device cpu --model tiny --steps 3 --new 4 --batches 1,2 --out DIR  # smoke
    python scripts/bench_speculative.py --engine --out bench_out/speculative_engine   # the engine (eager passes)

Training (no Hydra, one process): the model's YAML (configs/model/<name>.yaml) with model.mtp_layers=1, bytes of
Python's standard library sources (`data.kind=text`, every .py file under the running interpreter's stdlib), AdamW
at --lr with a linear warm-up, bf16 autocast on a GPU, the LM loss plus --mtp-weight x the MTP loss
(dsaflow.train.pipeline.LMLoss). Decoding: the plain-torch references dsaflow.serve.reference.generate (K = 0) and
dsaflow.serve.speculative.generate_speculative (K >= 1), eager, in the serve dtype (bf16 on a GPU), over the
same prompts (held-out text, --prompt bytes each) with --new tokens each; tokens/s = generated tokens / wall time of
the whole generate after one warm-up call. --engine: the serving engine instead (dsaflow.serve.engine.PipelineEngine,
one stage, one group of --batch rows, eager passes, serve.speculative_tokens=K; the acceptance from its stats).
`same_tokens` says whether the tokens equal K = 0's (greedy: they are
in exact arithmetic; bf16 rounds a verify pass of K + 1 tokens differently from single-token steps).
"""

from __future__ import annotations

import argparse
import math
import sysconfig
import time
from pathlib import Path

import torch
from bench_lib import command_line, environment, out_dir, resolve_device, sync, user_error, write_results

from dsaflow.config.schema import DataConfig, ModelConfig
from dsaflow.data import BatchSource
from dsaflow.model import build_model
from dsaflow.serve import reference as R
from dsaflow.serve.speculative import allocate_speculative_caches, generate_speculative
from dsaflow.train.pipeline import LMLoss

PROG = "bench_speculative.py"
CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "model"


def model_config(name: str) -> ModelConfig:
    """configs/model/<name>.yaml (flat `key: value` lines) as a ModelConfig with one MTP layer."""
    fields = {}
    for line in (CONFIGS / f"{name}.yaml").read_text().splitlines():
        key, _, value = line.partition("#")[0].partition(":")
        if value.strip() and key.strip() in ModelConfig.__dataclass_fields__:
            fields[key.strip()] = _scalar(value.strip())
    if "moe" in fields:
        user_error(PROG, f"--model {name}: a MoE model; this benchmark builds dense models (e.g. --model small)")
    return ModelConfig(**fields, mtp_layers=1)


def _scalar(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "null": None}.get(text, text)


def train(cfg: ModelConfig, data: BatchSource, a, device) -> tuple:
    """The trained model (eval mode) and its loss log [(step, LM loss, MTP loss)]."""
    torch.manual_seed(0)
    model = build_model(cfg, seed=0).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / a.warmup))
    loss_fn, log = LMLoss(0, a.mtp_weight), []
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    t0 = time.perf_counter()
    for step in range(a.steps):
        x, y = data.batch(step)
        x, y = x.to(device), y.to(device)
        loss_fn.reset()
        with autocast:
            loss = loss_fn(model.forward_train(x, mtp_tokens=x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == a.steps - 1:
            log.append((step, float(loss_fn.lm_losses[0]), float(loss_fn.mtp_losses[0])))
            print(f"step {step}: loss {log[-1][1]:.3f} mtp_loss {log[-1][2]:.3f} ({time.perf_counter() - t0:.0f} s)")
    return model.eval(), log


def measure(model, prompts, new: int, k: int, device, dtype) -> tuple:
    """(tokens, seconds, acceptance summary or None) of one generate after a warm-up call."""
    stages = {0: model}
    context = max(len(p) for p in prompts) + new + k + 2
    caches = (allocate_speculative_caches if k else R.allocate_caches)(stages, len(prompts), context, len(prompts[0]))
    limits = [new] * len(prompts)

    def run():
        if k == 0:
            return R.generate(stages, caches, prompts, limits), None
        out, stats = generate_speculative(stages, caches, prompts, limits, k)
        return out, stats.summary()

    run()
    sync(device)
    t0 = time.perf_counter()
    out, summary = run()
    sync(device)
    return out, time.perf_counter() - t0, summary


def measure_engine(model, prompts, new: int, k: int, device, dtype) -> tuple:
    """`measure` through the serving engine: one stage, one group of len(prompts) rows, eager passes."""
    from dsaflow.config.schema import DSAFlowConfig
    from dsaflow.plan import build_plan
    from dsaflow.serve.engine import PipelineEngine

    cfg = DSAFlowConfig()
    cfg.model = model.cfg
    s = cfg.serve
    s.max_batch, s.max_new_tokens, s.speculative_tokens = len(prompts), new, k
    s.max_context, s.prefill_chunk = max(len(p) for p in prompts) + new + 1, max(len(p) for p in prompts)
    engine = PipelineEngine(cfg.model, build_plan(cfg), {0: model}, s, cfg.graphs, device, dtype)
    engine.capture()
    engine.generate(prompts)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    out = engine.generate(prompts)
    sync(device)
    return out, time.perf_counter() - t0, engine.stats.get("speculation")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--model", default="small", help="configs/model/<name>.yaml (a dense model)")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--prompt", type=int, default=128, help="prompt bytes")
    p.add_argument("--new", type=int, default=128, help="generated tokens per prompt")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--out", default="bench_out/speculative")
    p.add_argument("--engine", action="store_true", help="measure the serving engine, not the references")
    a = p.parse_args(argv)
    device = torch.device(resolve_device(PROG, a.device))
    out = out_dir(PROG, a.out)
    cfg = model_config(a.model)
    data_cfg = DataConfig(name="text", kind="text", path=sysconfig.get_paths()["stdlib"], suffixes=[".py"])
    data = BatchSource(data_cfg, a.seq_len, a.batch_size, 0, cfg.vocab_size)
    model, log = train(cfg, data, a, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = model.to(dtype)
    held_out = torch.cat([data.val_batch(i)[0] for i in range(math.ceil(max(map(int, a.batches.split(","))) / 4))])
    rows = []
    for batch in map(int, a.batches.split(",")):
        prompts = [held_out[r % len(held_out), : a.prompt].tolist() for r in range(batch)]
        base = None
        for k in range(4):
            tokens, seconds, summary = (measure_engine if a.engine else measure)(
                model, prompts, a.new, k, device, dtype
            )
            base = tokens if k == 0 else base
            row = {"batch": batch, "k": k, "tokens_per_s": batch * a.new / seconds, "seconds": seconds}
            row.update(summary or {"acceptance_rate": None, "mean_accept_length": 1.0, "per_position": []})
            row["same_tokens"] = tokens == base
            rows.append(row)
            print(row, flush=True)
    for row in rows:
        k0 = next(r for r in rows if r["batch"] == row["batch"] and r["k"] == 0)
        row["speedup"] = row["tokens_per_s"] / k0["tokens_per_s"]
    md = [
        f"Speculative decoding, model={a.model} + 1 MTP layer trained {a.steps} steps on stdlib .py bytes "
        f"(final loss {log[-1][1]:.3f}, mtp_loss {log[-1][2]:.3f}); {'the engine' if a.engine else 'the references'}; "
        f"{environment(device)['device_name']}; "
        f"`{command_line(PROG, argv)}`",
        "",
        "| batch | K | tokens/s | x K=0 | accept rate | mean accept length | per draft position | same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        per = ", ".join(f"{x:.3f}" for x in r["per_position"]) or "-"
        md.append(
            f"| {r['batch']} | {r['k']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} | {rate} | "
            f"{r['mean_accept_length']:.2f} | {per} | {r['same_tokens']} |"
        )
    data_out = {"env": environment(device), "command": command_line(PROG, argv), "train_log": log, "rows": rows}
    write_results(out, "speculative", data_out, "\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
