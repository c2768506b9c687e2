"""What serve.kv_dtype=fp8 does to a model's outputs, beside what serve.weights=fp8 does: a JSON file and a markdown
table (docs/serving.md, "FP8 KV cache").

    python scripts/kv_fp8_accuracy.py --out DIR [--device auto|cpu|cuda] [--models hf,tiny,small]
        [--small RUN | --small-steps 150] [--tiny-steps 150] [--prompts 16] [--new-tokens 16]

Models (`--models`): `hf`, the tiny random Hugging Face checkpoints of both families (scripts/hf_tiny_checkpoint.py,
written to DIR/hf-*); `tiny`, model=tiny trained on the docs (about two minutes on a 2-core CPU); `small`,
model=small trained on the docs (`--small RUN` serves a run dir or checkpoint of yours; otherwise the script trains
one into DIR/small-run: a minute or two on one GPU, hours on a 2-core CPU, so a CPU run takes `--models hf,tiny`).
A trained run in DIR is reused by the next run.

Each model serves its prompts greedily with the exact configuration (serve.dtype's KV cache and weights: fp32 on a
CPU, bf16 on a GPU) and with FP8 KV, FP8 weights, and both. On the exact run's greedy continuation (the same context
for every variant, so one early difference does not count again at every later token) it reports per variant:
  greedy agreement   the share of generated positions whose argmax equals the exact run's token;
  logit cosine       the next-token logits' cosine with the exact run's, mean and minimum over those positions;
  same output        the share of prompts whose whole free-running greedy output equals the exact run's;
  top-k overlap      (FP8 KV) per F layer and call, |top-k with FP8 keys n top-k with exact keys| / |top-k|, for the
                     same queries: what rounding the keys alone does to the indexer's choice.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import random
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from bench_lib import command_line, environment, out_dir, resolve_device, user_error, write_results

import dsaflow.model.mla as mla_module
from dsaflow.checkpoint.hf_config import apply_hf_model
from dsaflow.config.compose import compose
from dsaflow.config.kv_cache_format import Fp8RowFormat
from dsaflow.ops.kv_fp8 import quantize_fp8_rows
from dsaflow.plan import build_plan
from dsaflow.serve import reference
from dsaflow.serve.generate import build_stage_modules, serve_dtype

PROG = "kv_fp8_accuracy.py"
REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"fp8 KV": ("bf16", "fp8"), "fp8 weights": ("fp8", "bf16"), "fp8 weights + KV": ("fp8", "fp8")}


def hf_tiny(family: str, folder: Path) -> list:
    """The tiny random checkpoint of `family` in `folder` -> its config overrides."""
    spec = importlib.util.spec_from_file_location("hf_tiny", REPO / "scripts" / "hf_tiny_checkpoint.py")
    hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf)
    if not (folder / "config.json").exists():
        hf.save_checkpoint(family, folder)
    return ["model=hf", f"model.hf_path={folder}"]


# `dsaflow train` settings of the trained models: model=tiny as the serving tests train it (about a minute on a
# 2-core CPU), model=small on more tokens (a minute or two on one GPU; hours on a 2-core CPU)
TRAIN = {
    "tiny": ["train.seq_len=64", "train.batch_size=16", "train.lr=5e-3", "train.warmup_steps=10"],
    "small": ["train.seq_len=128", "train.batch_size=16", "train.lr=2e-3", "train.warmup_steps=20"],
}


def trained(out: Path, model: str, run: str | None, steps: int) -> list:
    """model=<model> trained on the docs for `steps` steps into out/<model>-run (or the given run dir) -> its
    config overrides."""
    if run is None:
        run = out / f"{model}-run"
        if not (run / "checkpoints").exists():
            cmd = [sys.executable, "-c", "from dsaflow.cli import main; main()", "train", f"model={model}",
                   "data=text", f"data.path={REPO}/docs", f"train.steps={steps}", "train.eval_every=0",
                   "track=none", f"run_dir={run}", *TRAIN[model]]  # fmt: skip
            print(f"{PROG}: training model={model} for {steps} steps into {run}", flush=True)
            subprocess.run(cmd, check=True)
    return [f"model={model}", f"serve.checkpoint={run}"]


def prompts_for(vocab: int, n: int, seed: int = 0) -> list:
    """n prompts of 24 to 64 tokens: text of the docs as bytes for a byte vocabulary, else seeded random ids."""
    rng = random.Random(seed)
    if vocab >= 256:
        text = bytes(b if b < 128 else 32 for b in (REPO / "docs" / "serving.md").read_bytes())
        starts = [rng.randrange(len(text) - 64) for _ in range(n)]
        return [list(text[s : s + rng.randint(24, 64)]) for s in starts]
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(24, 64))] for _ in range(n)]


def stages_of(overrides: list, weights: str, device: str):
    cfg = compose(["mode=serve", "track=none", *overrides, f"serve.weights={weights}"], model_source=apply_hf_model)
    dtype = serve_dtype(cfg.serve.dtype, torch.device(device))
    return cfg, build_stage_modules(cfg, build_plan(cfg), None, device, dtype)


def greedy(stages, kv_dtype: str, prompts: list, new: int) -> list:
    caches = reference.allocate_caches(stages, len(prompts), max(map(len, prompts)) + new + 1, max(map(len, prompts)),
                                       kv_dtype)  # fmt: skip
    return reference.generate(stages, caches, prompts, [new] * len(prompts))


def context_logits(stages, kv_dtype: str, seen: list) -> torch.Tensor:
    """fp32 logits [T, vocab] of every position of one token sequence, one prefill pass over caches of kv_dtype."""
    device = next(next(iter(stages.values())).parameters()).device
    caches = reference.allocate_caches(stages, 1, len(seen) + 1, len(seen), kv_dtype)
    tokens = torch.tensor([seen], device=device)
    return reference.forward(stages, caches, tokens, torch.arange(len(seen), device=device).view(1, -1))[0].float()


@contextlib.contextmanager
def topk_overlap_probe(sink: list):
    """While active, every indexer call of the model is repeated with its keys rounded to the FP8 cache's format,
    and sink gets |both| / |exact| per call (the exact call's result is what the model uses)."""
    real = mla_module.indexer_topk

    def probe(q, k, w, positions, topk, fp8=False, key_rows=None):
        exact = real(q, k, w, positions, topk, fp8=fp8, key_rows=key_rows)
        if k.dtype != torch.uint8:
            packed = quantize_fp8_rows(k, Fp8RowFormat(k.shape[-1], k.shape[-1]))  # the FP8 key cache's rows
            rounded = real(q, packed, w, positions, topk, fp8=fp8, key_rows=key_rows)
            valid = exact >= 0
            both = (exact.unsqueeze(-1) == rounded.unsqueeze(-2)).any(-1) & valid
            sink.append(both.sum().item() / max(1, valid.sum().item()))
        return exact

    mla_module.indexer_topk = probe
    try:
        yield
    finally:
        mla_module.indexer_topk = real


def evaluate(name: str, overrides: list, device: str, n_prompts: int, new: int) -> list:
    """Every variant of one model against its exact run -> rows of the table."""
    cfg, exact_stages = stages_of(overrides, "bf16", device)
    prompts = prompts_for(cfg.model.vocab_size, n_prompts)
    with torch.no_grad():
        base = greedy(exact_stages, "bf16", prompts, new)
        overlap: list = []  # the exact run's indexer calls, repeated with FP8-rounded keys
        with topk_overlap_probe(overlap):
            base_logits = [context_logits(exact_stages, "bf16", p + o)[len(p) - 1 : -1] for p, o in zip(prompts, base)]
        rows = []
        for variant, (weights, kv) in VARIANTS.items():
            stages = exact_stages if weights == "bf16" else stages_of(overrides, weights, device)[1]
            out = greedy(stages, kv, prompts, new)
            agree, cos = [], []
            for p, o, lb in zip(prompts, base, base_logits):
                lv = context_logits(stages, kv, p + o)[len(p) - 1 : -1]
                agree += (lv.argmax(-1) == torch.tensor(o, device=lv.device)).tolist()
                cos += torch.nn.functional.cosine_similarity(lv, lb, dim=-1).tolist()
            keys = overlap if variant == "fp8 KV" else []
            rows.append(
                dict(
                    model=name,
                    variant=variant,
                    positions=len(agree),
                    greedy_agreement=sum(agree) / len(agree),
                    logit_cosine_mean=statistics.fmean(cos),
                    logit_cosine_min=min(cos),
                    same_output=sum(a == b for a, b in zip(out, base)) / len(base),
                    topk_overlap=statistics.fmean(keys) if keys else None,
                    topk_overlap_min=min(keys) if keys else None,
                )
            )
            print(f"{PROG}: {name}, {variant}: agreement {rows[-1]['greedy_agreement']:.4f}", flush=True)
    return rows


def markdown(rows: list, env: dict, command: str) -> str:
    lines = [
        f"FP8 KV cache against FP8 weights, greedy on each model's exact run ({env['device_name']}, `{command}`)",
        "",
        "| model | variant | greedy agreement | logit cosine mean / min | same output | indexer top-k overlap mean / min |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        ov = "-" if r["topk_overlap"] is None else f"{r['topk_overlap']:.4f} / {r['topk_overlap_min']:.4f}"
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['greedy_agreement']:.2%} ({r['positions']}) | "
            f"{r['logit_cosine_mean']:.6f} / {r['logit_cosine_min']:.6f} | {r['same_output']:.0%} | {ov} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--models", default="hf,tiny,small", help="of hf (both tiny HF families), tiny, small")
    ap.add_argument("--small", default=None, help="a model=small run dir or checkpoint (default: train one)")
    ap.add_argument("--small-steps", type=int, default=150)
    ap.add_argument("--tiny-steps", type=int, default=150)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    device = resolve_device(PROG, args.device)
    out = out_dir(PROG, args.out)
    wanted = set(args.models.split(","))
    if not wanted <= {"hf", "tiny", "small"}:
        user_error(PROG, f"--models {args.models}: use a comma-separated subset of hf, tiny, small")
    models = {}
    if "hf" in wanted:
        models["HF tiny deepseek_v32"] = hf_tiny("deepseek_v32", out / "hf-deepseek_v32")
        models["HF tiny glm_moe_dsa"] = hf_tiny("glm_moe_dsa", out / "hf-glm_moe_dsa")
    if "tiny" in wanted:
        models[f"model=tiny, trained {args.tiny_steps} steps"] = trained(out, "tiny", None, args.tiny_steps)
    if "small" in wanted:
        name = f"model=small, {args.small}" if args.small else f"model=small, trained {args.small_steps} steps"
        models[name] = trained(out, "small", args.small, args.small_steps)
    rows = [r for name, ov in models.items() for r in evaluate(name, ov, device, args.prompts, args.new_tokens)]
    env = environment(device)
    command = command_line(PROG, argv)
    write_results(out, "kv_fp8_accuracy", dict(env=env, command=command, rows=rows), markdown(rows, env, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
