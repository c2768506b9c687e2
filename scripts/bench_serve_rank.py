"""One pipeline rank of the serving benchmark alone on one GPU: its partners replaced by a loopback link.

    python scripts/bench_serve_rank.py --device cuda --pipeline pp2 --rank 0 --out bench_out/serve_rank

A rank of ppN serves the same requests as in `scripts/bench_serve.py`, but every receive is answered at once
(the activation from the previous rank, the sampled tokens from the last) and every send is dropped. The rank's
busy fraction is then its ceiling on a real ppN run, where it can also wait on its partners and on the transfers:
a rank whose host builds its passes more slowly than its GPU runs them shows a busy fraction below 1 here, with no
second GPU needed. The values are stand-ins (LoopbackLink), so the text is meaningless; the schedule is that of the
real run (no EOS: serve.eos_id is unset in the benchmark). Accepts every option of bench_serve.py; --pipelines is replaced by --pipeline and --rank.
Writes <out>/bench_serve_rank.json and bench_serve_rank.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serve  # noqa: E402


class LoopbackLink:
    """A StageLink stand-in for a rank run alone: sends are dropped and every receive is filled at once on the device
    (no wait). Activations get fixed standard-normal values, as a real hidden state would be: zeros would make
    every indexer score of the stage tie, and top-k over ties runs a slower path than any real pass. Integer
    messages (sampled tokens and EOS flags, cross-stage indices) get zeros: token 0, no EOS, index 0."""

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._values = torch.empty(0, device=device)  # float32; each receive copies a prefix of it

    def exchange(self, ops) -> None:
        for kind, tensor, _peer in ops:
            if kind != "recv":
                continue
            if not tensor.is_floating_point():
                tensor.zero_()
                continue
            n = tensor.numel()
            if n > self._values.numel():  # drawn on the device, once per new largest size (prefill shapes vary)
                self._values = torch.randn(n, generator=self.generator, device=self.device)
            tensor.copy_(self._values[:n].view(tensor.shape))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--pipeline", default="pp2", choices=[p for p, n in bench_serve.RANKS.items() if n > 1])
    ap.add_argument("--rank", type=int, default=0)
    own, rest = ap.parse_known_args(argv)
    args = bench_serve.parse_args(rest + ["--pipelines", own.pipeline], one_process=True)
    ranks = bench_serve.RANKS[own.pipeline]
    if not 0 <= own.rank < ranks:
        raise SystemExit(f"--rank {own.rank}: {own.pipeline} has ranks 0..{ranks - 1}")
    device = torch.device(args.device)
    bench_serve.partial_path(args).unlink(missing_ok=True)
    rows = bench_serve.measure(
        args, own.pipeline, own.rank, device, LoopbackLink(device, args.seed), lambda x: [x], every_rank=True
    )
    for r in rows:
        r["rank_alone"] = own.rank
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python scripts/bench_serve_rank.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "bench_serve_rank.json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=2))
    lines = [
        f"# {own.pipeline} rank {own.rank} alone (loopback link)",
        "",
        f"Command: `{cmd}`.",
        "",
        "| groups | workload | batching | tokens/s | busy | decode busy |",
        "|---:|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['microbatches']} | {r['workload']} | {r['batching']} | {r['tokens_per_s']:.1f} | "
            f"{r['busy_fraction'][0]:.2f} | {r['decode_busy_fraction'][0]:.2f} |"
        )
    (out / "bench_serve_rank.md").write_text("\n".join(lines) + "\n")
    bench_serve.partial_path(args).unlink(missing_ok=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
