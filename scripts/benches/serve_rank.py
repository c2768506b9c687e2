"""One pipeline rank of the serving benchmark alone on one GPU: its partners replaced by a loopback link.

    python scripts/bench_serve.py rank --device cuda --pipeline pp2 --rank 0 --out bench_out/serve_rank

A rank of ppN serves the same requests as `bench_serve.py engine`, but every receive is answered at once
(the activation from the previous rank, the sampled tokens from the last) and every send is dropped. The rank's
busy fraction is then its ceiling on a real ppN run, where it can also wait on its partners and on the transfers:
a rank whose host builds its passes more slowly than its GPU runs them shows a busy fraction below 1 here, with no
second GPU needed. The values are stand-ins (LoopbackLink), so the text is meaningless; the schedule is that of the
real run (no EOS: serve.eos_id is unset in the benchmark). Takes the options of `bench_serve.py engine`, with
--pipeline and --rank in place of --pipelines. Writes <out>/bench_serve_rank.json and bench_serve_rank.md.
"""

from __future__ import annotations

import argparse

import torch
from bench_lib import command_line, out_dir, user_error, write_results

from benches import serve_engine, serve_setup


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


def parse_args(argv=None, prog: str = "bench_serve.py rank") -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", default="pp2", choices=[p for p, n in serve_setup.RANKS.items() if n > 1])
    ap.add_argument("--rank", type=int, default=0, help="which rank of the split runs here (default 0)")
    serve_setup.add_options(ap, out="bench_out/serve_rank")
    a = ap.parse_args(argv)
    ranks = serve_setup.RANKS[a.pipeline]
    if not 0 <= a.rank < ranks:
        user_error(prog, f"--rank {a.rank}: {a.pipeline} has ranks 0..{ranks - 1}")
    a.pipelines = a.pipeline
    return serve_setup.finish_args(ap, a, prog, one_process=True)


def main(argv=None, prog: str = "bench_serve.py rank") -> int:
    args = parse_args(argv, prog)
    out = out_dir(prog, args.out)
    args.out = str(out)
    device = torch.device(args.device)
    serve_engine.partial_path(args).unlink(missing_ok=True)
    rows = serve_engine.measure(
        args, args.pipeline, args.rank, device, LoopbackLink(device, args.seed), lambda x: [x], every_rank=True
    )
    for r in rows:
        r["rank_alone"] = args.rank
    cmd = command_line(prog, argv)
    lines = [
        f"# {args.pipeline} rank {args.rank} alone (loopback link)",
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
    write_results(out, "bench_serve_rank", {"command": cmd, "rows": rows}, "\n".join(lines))
    serve_engine.partial_path(args).unlink(missing_ok=True)
    return 0
