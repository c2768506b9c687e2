"""`dsaflow serve`: check, write the run dir, start the workers (torchrun, job "serve"), and run the HTTP front end
in this process until a stop signal or a dead worker.

    parent (this module + dsaflow/serve/http/)        workers (dsaflow/serve/online.py), one per rank
    aiohttp on server.host:server.port      <---->   pipeline rank 0 of each replica: requests in
    balances requests over the replicas               the last stage's rank: tokens out
                                                      every rank: the same scheduler, fed each tick by rank 0

Lifecycle:
- The HTTP port is bound first (a port in use is a user error, exit 2, before any worker starts); until every
  worker has captured its graphs and connected, /health and generation answer 503.
- SIGTERM, SIGINT or SIGHUP: stop admitting (503), let the requests in flight finish for server.drain_s, end those
  still running with an error, tell the workers to stop, exit 0 once they have.
- A worker that dies (its connection closes, or torchrun exits): every request in flight and every new one gets
  503, /health says why, and the server exits with status 1 within DEAD_EXIT_S seconds; it never hangs.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from dsaflow.errors import PlanError

DEAD_EXIT_S = 10.0  # a dead worker: the server answers 503 and exits (status 1) within this many seconds
DEAD_GRACE_S = 1.0  # ... after answering 503 this long, so clients that are connected hear why
STOP_WAIT_S = 30.0  # after the drain: how long the workers have to exit before they are killed
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def check_serve_launch(cfg, plan) -> None:
    """Everything `dsaflow serve` can check before a process starts. Raises PlanError (exit 2)."""
    from dsaflow.pipeline.devices import resolve_device_type
    from dsaflow.rundir.folder import check_run_dir
    from dsaflow.serve.generate import check_serve_model

    from .resources import check_resources

    device = resolve_device_type(cfg.train.device)
    check_resources(cfg, plan, device, "generate", True)
    check_serve_model(cfg, plan, device)
    if cfg.serve.prompts or cfg.serve.prompts_file or cfg.serve.output_file:
        raise PlanError(
            "serve.prompts, serve.prompts_file and serve.output_file belong to `dsaflow generate`; `dsaflow serve` "
            "takes its requests over HTTP. Fix: drop them, or run dsaflow generate."
        )
    if cfg.serve.speculative_tokens > 0:
        raise PlanError(
            f"serve.speculative_tokens={cfg.serve.speculative_tokens}: speculative decoding runs in `dsaflow "
            "generate` only; `dsaflow serve` samples each request with its own settings and does not verify drafts "
            "yet. Fix: serve.speculative_tokens=0."
        )
    chat_template(cfg)  # a server.chat_template file that is missing or does not parse
    check_listen(cfg.server.host, cfg.server.port)
    check_run_dir(cfg, plan, "generate")


def check_listen(host: str, port: int) -> None:
    """The server can listen at host:port (bound and released at once: a port taken later still fails at start,
    with the same message, and the run dir then stays behind)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise PlanError(
            f"server.host={host}: not an address of this machine ({exc}). Fix: 127.0.0.1 or 0.0.0.0."
        ) from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            sock.bind(address)
        except OSError as exc:
            raise PlanError(
                f"server.host={host} server.port={port}: cannot listen there ({exc.strerror}). Fix: another "
                "server.port (0 picks a free one), or stop what holds it."
            ) from None


def chat_template(cfg):
    from dsaflow.checkpoint.hf_run_copy import hf_files_folder
    from dsaflow.serve.generate import trained_run_dir
    from dsaflow.serve.http.chat import load_chat_template

    folder = hf_files_folder(cfg.model.hf_path, trained_run_dir(cfg.serve.checkpoint))
    return load_chat_template(cfg.server.chat_template, folder)


def launch_serve(cfg, plan) -> int:
    """Check, write the run dir, serve until stopped -> exit status (0 after a drain)."""
    from dsaflow.checkpoint.store import report_stderr
    from dsaflow.config.server_schema import API_KEY_ENV
    from dsaflow.plan import render_table
    from dsaflow.rundir.folder import write_run_dir
    from dsaflow.rundir.lock import run_dir_lock

    check_serve_launch(cfg, plan)
    api_key = cfg.server.api_key or os.environ.get(API_KEY_ENV) or None
    cfg.server.api_key = None  # a secret stays out of the run dir's config.yaml (the workers never need it)
    run_dir = write_run_dir(cfg, plan, render_table(plan, cfg), "generate")
    cfg.server.api_key = api_key
    with run_dir_lock(run_dir, "serve", report_stderr):
        return ServerProcess(cfg, plan, run_dir).run()


class ServerProcess:
    def __init__(self, cfg, plan, run_dir: Path):
        from dsaflow.serve.generate import job_tokenizer
        from dsaflow.serve.http.server import Frontend
        from dsaflow.serve.http.workers import WorkerHub

        self.cfg, self.plan, self.run_dir = cfg, plan, Path(run_dir)
        p = plan.pipeline
        self.hub = WorkerHub(p.world_size, p.ranks, self._on_message, self._on_lost)
        name = cfg.server.model_name or cfg.model.name
        self.front = Frontend(cfg, job_tokenizer(cfg.model, cfg.serve), chat_template(cfg), self.hub, p.dp, name)
        self.front.dead = "the workers are starting"
        self.proc: Optional[subprocess.Popen] = None
        self.stop_signal: Optional[int] = None
        self.stopping = False

    def _on_message(self, rank: int, msg) -> None:
        self.front.on_message(rank, msg)

    def _on_lost(self, rank: int) -> None:
        if not self.stopping and self.front.dead is None:
            self._die(f"worker rank {rank} exited")

    def _die(self, why: str) -> None:
        self.front.dead = why
        self.front.fail_all(why)
        print(f"dsaflow serve: {why}; answering 503 and stopping", file=sys.stderr, flush=True)

    def run(self) -> int:
        old = {s: signal.getsignal(s) for s in SIGNALS}
        try:
            return asyncio.run(self._main())
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self._kill()
            self.hub.close()
            from dsaflow.rundir.folder import TMP

            shutil.rmtree(self.run_dir / TMP, ignore_errors=True)

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            from .lifecycle import kill_tree

            kill_tree(self.proc.pid)
            self.proc.wait()

    async def _main(self) -> int:
        from aiohttp import web

        loop = asyncio.get_running_loop()
        for s in SIGNALS:
            loop.add_signal_handler(s, self._on_signal, s)
        runner = web.AppRunner(self.front.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.cfg.server.host, self.cfg.server.port)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise PlanError(
                f"server.host={self.cfg.server.host} server.port={self.cfg.server.port}: cannot listen there "
                f"({exc.strerror}). Fix: another server.port (0 picks a free one), or stop what holds it."
            ) from None
        try:
            self._start_workers(loop)
            rc = await self._serve(runner)
        finally:
            await runner.cleanup()
        return rc

    def _on_signal(self, signum: int) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
            self.front.draining = True
            print(
                f"dsaflow serve: {signal.Signals(signum).name}: no new requests; draining the {len(self.front.live)} "
                f"in flight (server.drain_s={self.cfg.server.drain_s:g})",
                file=sys.stderr,
                flush=True,
            )

    def _start_workers(self, loop) -> None:
        from dsaflow.rundir.folder import TMP
        from dsaflow.rundir.lock import LOCK_ENV

        from .launch import launch_env, torchrun_command
        from .lifecycle import die_with_parent
        from .run_summary import shell_command

        self.hub.start(loop)
        cmd = torchrun_command(self.run_dir, self.plan.pipeline.world_size, "serve")
        env = launch_env(run_dir=self.run_dir)
        env.update(self.hub.env())
        env[LOCK_ENV] = str(self.run_dir.resolve())
        (self.run_dir / TMP).mkdir(exist_ok=True)  # TMPDIR must exist, or tempfile falls back to /tmp
        print(f"run dir: {self.run_dir}\nlaunch:  {shell_command(cmd)}", flush=True)
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=die_with_parent)

    async def _serve(self, runner) -> int:
        """Wait for the workers, serve, and stop as the module docstring says -> exit status."""
        while not self.hub.ready.is_set():  # startup: a worker that fails here ends the server
            rc = self.proc.poll()
            if rc is not None:
                return self._failed_start(rc)
            if self.stop_signal is not None:
                return 128 + self.stop_signal
            await asyncio.sleep(0.05)
        self.front.dead = None
        self._say_ready(runner)
        while self.stop_signal is None and self.front.dead is None:
            if self.proc.poll() is not None:
                self._die(f"the workers exited (status {self.proc.returncode})")
                break
            await asyncio.sleep(0.1)
        if self.front.dead is not None:
            await asyncio.sleep(DEAD_GRACE_S)
            return 1
        return await self._drain()

    async def _drain(self) -> int:
        deadline = time.monotonic() + self.cfg.server.drain_s
        while self.front.live and time.monotonic() < deadline and self.proc.poll() is None:
            await asyncio.sleep(0.05)
        if self.front.live:
            self.front.fail_all(f"the server stopped before it finished (server.drain_s={self.cfg.server.drain_s:g})")
            await asyncio.sleep(0.2)  # let their handlers answer
        self.stopping = True
        self.hub.broadcast(("stop",))
        deadline = time.monotonic() + STOP_WAIT_S
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        rc = self.proc.poll()
        if rc is None:
            print(f"dsaflow serve: the workers did not stop within {STOP_WAIT_S:g} s; killed", file=sys.stderr)
            return 1
        print(f"dsaflow serve: stopped (workers exited with status {rc})", file=sys.stderr, flush=True)
        return 0 if rc == 0 else rc

    def _failed_start(self, rc: int) -> int:
        from dsaflow.errors import EXIT_USER_ERROR

        errors = sorted(self.run_dir.glob("error-rank*.txt"))
        if rc == EXIT_USER_ERROR and errors:
            print(f"dsaflow serve: error: {errors[0].read_text().strip()}", file=sys.stderr, flush=True)
        else:
            print(f"dsaflow serve: the workers exited with status {rc} before serving", file=sys.stderr, flush=True)
        return rc or 1

    def _say_ready(self, runner) -> None:
        host, port = runner.addresses[0][:2]
        url = f"http://{host}:{port}"
        auth = ' -H "Authorization: Bearer $DSAFLOW_API_KEY"' if self.cfg.server.api_key else ""
        p = self.plan.pipeline
        body = f'{{"model": "{self.front.model_name}", "prompt": "Hello", "max_tokens": 16}}'
        print(
            f"dsaflow serve: ready on {url} (model {self.front.model_name}: {p.dp} replica(s) x {p.ranks} pipeline "
            f"rank(s)); OpenAI API at {url}/v1\n"
            f"  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} -d '{body}'",
            flush=True,
        )
