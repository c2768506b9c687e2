"""`python -m dsaflow.worker RUN_DIR [--job train|generate]`: the entry torchrun starts on every rank.

    torchrun --nproc-per-node 2 -m dsaflow.worker runs/20260101-120000-tiny-retrieval
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dsaflow.worker", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a run dir written by `dsaflow train` (config.yaml + plan.json)")
    ap.add_argument("--job", default="train", choices=("train", "generate"))
    args = ap.parse_args(argv)
    from dsaflow.launch.worker import run_worker

    run_worker(args.run_dir, args.job)


if __name__ == "__main__":
    main(sys.argv[1:])
