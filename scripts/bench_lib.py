"""The one benchmark harness of scripts/: every `bench_*.py` takes from here its timing, the device's measured
ceilings, where and how it writes its rows (JSON, a markdown table, a PNG when matplotlib is installed), the
description of the device, its user errors (exit 2, one line) and, for the families, its subcommands.

Scripts run as `python scripts/bench_x.py ...`: Python puts scripts/ first on sys.path, so `import bench_lib` and
`from benches import ...` resolve here, and dsaflow is the installed package (`bash scripts/setup.sh` installs this
checkout editable).
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Callable, NoReturn

import torch

# DeepSeek-V3.2 attention shapes of the kernel benchmarks (bench_ops.py, benches/ops_peers.py)
H, D_QK, D_V, TOPK = 128, 576, 512, 2048
ROWS: list[dict] = []  # every timed row of a kernel benchmark, in order (`record`, `sweep`)
CEIL: dict = {}  # the device's ceilings, set by `measure_ceilings` before any row
# pipelined runs leave NVLink multicast off: NCCL's NVLS and symmetric memory are not available on every host
RANK_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


# ---- user errors and the device ----
def user_error(prog: str, message: str) -> NoReturn:
    """A mistake in the command line or a missing device: one line on stderr, exit 2, no traceback."""
    print(f"{prog}: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def resolve_device(prog: str, choice: str) -> str:
    """--device auto|cuda|cpu -> "cuda" or "cpu"; `cuda` without a CUDA GPU is a user error."""
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        user_error(prog, "--device cuda: this machine has no CUDA GPU (torch.cuda.is_available() is False); pass "
                   "--device cpu, or run it where a GPU is")  # fmt: skip
    return choice


def need_cuda(prog: str, gpus: int = 1, why: str = "it times CUDA kernels") -> None:
    """Stop with one line (exit 2) unless the machine has `gpus` CUDA GPUs."""
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < gpus:
        user_error(prog, f"needs {gpus} CUDA GPU{'s' * (gpus > 1)} ({why}), this machine has {found}")


def describe_device(device="cuda") -> str:
    """What a results file names as its machine: the GPU's name, or the CPU and its core count."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({os.cpu_count()} cores)"


def environment(device="cuda", **more) -> dict:
    """The device and the library versions a results file records beside its rows."""
    env = {"device_name": describe_device(device), "torch": torch.__version__}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return {**env, **more}


# ---- timing ----
def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def bench(fn, rep_ms: float = 200, warmup_ms: float = 50, device="cuda") -> float:
    """Median milliseconds of fn() by triton.testing.do_bench (CUDA); on CPU one wall-clock call, which checks a
    script's logic and nothing more."""
    if torch.device(device).type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def bench_graph(fn, rep_ms: float = 50) -> float:
    """Median milliseconds of fn() replayed from a CUDA graph: for calls of a few microseconds, below what eager
    timing resolves."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=rep_ms)


def timed_slow(fn, n: int = 3, device="cuda") -> float:
    """Median milliseconds of n calls between CUDA events, after one untimed call: for calls too slow for do_bench's
    repetitions. On CPU: wall clock."""
    if torch.device(device).type != "cuda":
        return wall_seconds(fn, device, n) * 1e3
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def wall_seconds(fn, device, repeats: int = 1, warmup: bool = True) -> float:
    """Median wall seconds of fn() between device syncs (after one untimed call unless warmup=False): what a whole
    step or pass costs, host work included."""
    if warmup:
        fn()
    out = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


# ---- ceilings and rates ----
def kernel_times(fn, device, passes: int = 1) -> list:
    """[(name, ms per pass, calls per pass)], most expensive first, of what `passes` calls of fn run: on a GPU its
    CUDA kernels (torch.profiler's device time; graph replays list the kernels they replay), on CPU its aten ops
    (self CPU time). Call fn once before, so one-time work (compiles, allocations) is not counted."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(passes):
            fn()
        sync(device)
    rows = []
    for e in prof.key_averages():
        if cuda != (e.device_type.name == "CUDA") or (not cuda and not e.key.startswith("aten::")):
            continue
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        rows.append((e.key, us / passes / 1e3, e.count / passes))
    return sorted(rows, key=lambda r: -r[1])


def measure_ceilings(device="cuda") -> dict:
    """The device's bf16 matmul rate (8192^3, TFLOP/s) and copy rate (512 MiB read + written, TB/s), measured in
    this process; every row's fraction is of these. On CPU (smoke runs) at small sizes."""
    cuda = torch.device(device).type == "cuda"
    n = 8192 if cuda else 256
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = bench(lambda: a @ b, rep_ms=300, device=device)
    CEIL["matmul_tflops"] = float(f"{2 * n**3 / ms / 1e9:.4g}")  # 4 figures: CPU smoke rates are small
    x = torch.randn((2**28 if cuda else 2**18), device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x), rep_ms=300, device=device)
    CEIL["copy_tbps"] = float(f"{2 * x.numel() * 2 / ms / 1e9:.4g}")
    del a, b, x, y
    print("ceilings", CEIL, flush=True)
    return dict(CEIL)


def fp8_ceiling(n: int = 8192) -> float:
    """TFLOP/s of torch._scaled_mm on n^3 e4m3 operands with per-tensor scales (bf16 out): the fp8 tensor cores'
    rate without block scaling."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    ms = bench(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), rep_ms=300)
    del a, b
    return float(f"{2 * n**3 / ms / 1e9:.4g}")


def add_rates(row: dict, ms: float, ceil: dict, flops=None, nbytes=None) -> dict:
    """A row timed at `ms` gains its TFLOP/s (given flops) and TB/s (given bytes), each also as a fraction of the
    ceilings in `ceil` (`matmul_tflops`, `copy_tbps`)."""
    if flops:
        row["tflops"] = round(flops / ms / 1e9, 1)
        row["frac_matmul"] = round(row["tflops"] / ceil["matmul_tflops"], 3)
    if nbytes:
        row["tbps"] = round(nbytes / ms / 1e9, 3)
        row["frac_copy"] = round(row["tbps"] / ceil["copy_tbps"], 3)
    return row


def record(kernel, impl, ctx, ms, flops=None, nbytes=None, **extra):
    row = dict(kernel=kernel, impl=impl, context=ctx, time_ms=round(ms, 4), flops=flops, bytes=nbytes, **extra)
    add_rates(row, ms, CEIL, flops, nbytes)
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    return row


def sweep(name, make_fn, configs):
    """Time each config's function; the fastest config (None when none compiled). Failures are reported."""
    best = None
    for cfg in configs:
        try:
            ms = bench(make_fn(cfg), rep_ms=150)
        except Exception as e:  # a config that does not compile (shared memory, registers) is reported, not fatal
            print(f"sweep {name} {cfg}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        print(f"sweep {name} {cfg}: {ms:.3f} ms", flush=True)
        ROWS.append(dict(kernel=name, impl="sweep", config=cfg, time_ms=round(ms, 4)))
        if best is None or ms < best[1]:
            best = (cfg, ms)
    return best[0] if best else None


def mla_inputs(ctx, n_q, h=H, batch=1, t_per_seq=None, seed=0):
    """Queries at the end of a ctx-token context; each selects TOPK random visible rows (all valid)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = t_per_seq or n_q
    q = torch.randn(batch, T, h, D_QK, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(batch, ctx, D_QK, device="cuda", dtype=torch.bfloat16, generator=g)
    pos = torch.arange(ctx - T, ctx, device="cuda").view(1, T, 1)
    idx = (torch.rand(batch, T, TOPK, device="cuda", generator=g) * (pos + 1)).to(torch.int32)
    return q, kv, idx


def rel_err(x, ref) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


# ---- where the rows go ----
def out_dir(prog: str, path) -> Path:
    """The results folder, created and announced (absolute) before any work, so a user sees where a run writes."""
    out = Path(path).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"{prog}: results go to {out}", flush=True)
    return out


def save_plot(path: Path, draw: Callable) -> bool:
    """draw(plt) onto a PNG at `path` with matplotlib's Agg backend; without matplotlib, a note and no file."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no {Path(path).name}: matplotlib is not installed (pip install 'dsaflow[plots]')", flush=True)
        return False
    fig = draw(plt)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_results(out, stem: str, data, markdown: str, plot: Callable | None = None, quiet: bool = False) -> list:
    """<out>/<stem>.json (data), <stem>.md (markdown) and, given `plot` (draw(plt) -> figure), <stem>.png; prints
    the table (unless quiet) and the paths written. Returns those paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    paths[0].write_text(json.dumps(data, indent=1) + "\n")
    paths[1].write_text(markdown.rstrip("\n") + "\n")
    if plot is not None and save_plot(out / f"{stem}.png", plot):
        paths.append(out / f"{stem}.png")
    if not quiet:
        print(markdown.rstrip("\n"))
    print("wrote " + ", ".join(str(p) for p in paths), flush=True)
    return paths


def command_line(prog: str, argv=None) -> str:
    """The command a results file records: `python scripts/<prog> <its arguments>`."""
    return " ".join(["python", f"scripts/{prog}", *(sys.argv[1:] if argv is None else argv)])


# ---- progress on long runs ----
class Heartbeat:
    """`with Heartbeat("pp2 mixed"):` prints a line every `every_s` seconds while the block runs, so a benchmark
    configuration that takes minutes is never silent."""

    def __init__(self, label: str, every_s: float = 60.0):
        self.label, self.every_s = label, every_s
        self.done = threading.Event()

    def __enter__(self):
        self.t0 = time.perf_counter()

        def beat():
            while not self.done.wait(self.every_s):
                print(f"  ... {self.label}: {time.perf_counter() - self.t0:.0f} s", flush=True)

        self.thread = threading.Thread(target=beat, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


# ---- processes: one per pipeline rank ----
def launch_ranks(entry: Path, argv: list, ranks: int, threads: int | None = None) -> int:
    """`entry argv` as `ranks` processes under torchrun (its --standalone rendezvous) -> the exit status. `threads`:
    OMP_NUM_THREADS per process (CPU runs)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(entry)]
    env = dict(os.environ, **RANK_ENV)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return subprocess.run([*cmd, *argv], env=env).returncode


def rows_from_ranks(entry: Path, argv: list, ranks: int, threads: int | None = None) -> list:
    """Like launch_ranks, with `--rows-file F` added: the rows a rank wrote to F (`write_rank_rows`)."""
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = Path(tmp) / "rows.json"
        rc = launch_ranks(entry, [*argv, f"--rows-file={rows_file}"], ranks, threads)
        if rc != 0:
            raise subprocess.CalledProcessError(rc, f"torchrun {entry.name} {' '.join(argv)}")
        return json.loads(rows_file.read_text())


def write_rank_rows(path, rows: list) -> None:
    Path(path).write_text(json.dumps(rows))


# ---- families: one script, one subcommand per benchmark ----
def family_main(prog: str, doc: str, subcommands: dict, argv=None) -> int:
    """`python scripts/<prog> SUBCOMMAND [options]`: runs benches.<module>.main(options, prog) for the subcommand's
    module in `subcommands` ({name: module}); no subcommand, or -h, lists them with their first docstring lines."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        width = max(len(s) for s in subcommands)
        lines = [f"usage: {prog} {{{','.join(subcommands)}}} [options]", "", doc.strip(), "", "subcommands:"]
        for name, module in subcommands.items():
            summary = " ".join((importlib.import_module(f"benches.{module}").__doc__ or "").split("\n\n")[0].split())
            lines += textwrap.wrap(
                summary, 120, initial_indent=f"  {name.ljust(width)}  ", subsequent_indent=" " * (width + 4)
            )
        lines += ["", f"{prog} SUBCOMMAND --help shows that subcommand's options."]
        print("\n".join(lines), file=sys.stdout if argv else sys.stderr)  # no subcommand: a usage error
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in subcommands:
        user_error(prog, f"{name!r} is not a subcommand; use one of {', '.join(subcommands)} ({prog} --help)")
    module = importlib.import_module(f"benches.{subcommands[name]}")
    return module.main(rest, prog=f"{prog} {name}") or 0
