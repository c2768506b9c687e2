"""Held-out prompts of the main job's retrieval task, as JSONL for `dsaflow generate serve.prompts_file=...`.

    python scripts/retrieval_prompts.py --count 8 > docs/retrieval_prompts.jsonl
    python scripts/retrieval_prompts.py data=retrieval_hard      # the same Hydra overrides as `dsaflow train`

Each line is {"prompt": ..., "answer": ...}: a sample of the composed data config (the main job's: one key-value
pair in filler, one query, `train.seq_len` bytes of input) drawn from a split no run trains or evaluates on, cut
just before the answer. `dsaflow generate` reads the "prompt" key; "answer" is there for the reader to compare.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from dsaflow.config.compose import compose
from dsaflow.data.retrieval import RetrievalSpec, retrieval_sample

HELD_OUT_SPLIT = 7  # training uses split 0, evaluation split 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for dsaflow train (data=..., train.seq_len=...)")
    args = ap.parse_args()
    cfg = compose(args.overrides)
    d = cfg.data
    if str(d.kind) != "retrieval":
        raise SystemExit(f"data.kind={d.kind}: these prompts come from the retrieval task. Fix: data=retrieval.")
    spec = RetrievalSpec(cfg.train.seq_len, d.num_pairs, d.key_len, d.value_len, 1)
    for row in range(args.count):
        sample, _ = retrieval_sample(spec, np.random.default_rng([args.seed, HELD_OUT_SPLIT, 0, row]))
        text = bytes(sample).decode("ascii")
        cut = len(text) - spec.value_len
        print(json.dumps({"prompt": text[:cut], "answer": text[cut:]}))


if __name__ == "__main__":
    main()
