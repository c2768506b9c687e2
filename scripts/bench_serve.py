"""Serving benchmarks: the engine over pipeline splits and workloads, one pp rank alone, decode steps eager vs
CUDA graphs, and the cost of a pipeline tick's transfers.

    python scripts/bench_serve.py engine --device cpu --pipelines single,pp2 --out bench_out/serve
    python scripts/bench_serve.py rank --device cuda --pipeline pp2 --rank 0
    python scripts/bench_serve.py decode --gpus 1,2,4
    python scripts/bench_serve.py p2p --out bench_out/p2p                                       # 2 GPUs
    python scripts/bench_serve.py stage --out bench_out          # a DeepSeek-V3.2 pp8 stage, FP8 weights, one H200
    python scripts/bench_serve.py http --device cpu --requests 64 --rate 8   # `dsaflow serve` beside the engine
"""

from __future__ import annotations

import sys

from bench_lib import family_main

SUBCOMMANDS = {
    "engine": "serve_engine",
    "rank": "serve_rank",
    "decode": "serve_decode",
    "p2p": "serve_p2p",
    "stage": "serve_stage",
    "http": "serve_http",
}


def main(argv=None) -> int:
    return family_main("bench_serve.py", __doc__.split("\n\n")[0], SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
