"""The parent's side of the connections to the serving workers (their side: dsaflow/serve/online.py).

A `Listener` on 127.0.0.1 with a random key that only the workers' environment carries. Every worker connects once
its graphs are captured and says ("ready", global rank); then one thread per connection reads what it sends and hands
it to the event loop. Requests go to pipeline rank 0 of a replica; tokens come from the replica's last stage's rank.
A connection that closes means its worker is gone (`on_lost`).
"""

from __future__ import annotations

import os
import threading
from multiprocessing.connection import Listener
from typing import Callable, Dict, List

from dsaflow.serve.online import ADDRESS_ENV, KEY_ENV


class WorkerHub:
    """world: the workers' processes; ranks: pipeline ranks per replica. on_message(rank, msg) and on_lost(rank)
    run on the event loop `loop` (set before `start`)."""

    def __init__(self, world: int, ranks: int, on_message: Callable, on_lost: Callable):
        self.key = os.urandom(32)
        self.listener = Listener(("127.0.0.1", 0), authkey=self.key)
        self.world, self.ranks = world, ranks
        self.on_message, self.on_lost = on_message, on_lost
        self.conns: Dict[int, object] = {}
        self.locks: Dict[int, threading.Lock] = {}
        self.ready = threading.Event()  # every worker said ready
        self.loop = None

    def env(self) -> Dict[str, str]:
        host, port = self.listener.address
        return {ADDRESS_ENV: f"{host}:{port}", KEY_ENV: self.key.hex()}

    @property
    def replicas(self) -> int:
        return self.world // self.ranks

    def start(self, loop) -> None:
        self.loop = loop
        threading.Thread(target=self._accept, daemon=True, name="dsaflow-serve-accept").start()

    def _accept(self) -> None:
        for _ in range(self.world):
            try:
                conn = self.listener.accept()
                kind, rank = conn.recv()
            except (OSError, EOFError, ValueError):  # a stranger without the key, or the listener closed
                continue
            self.conns[rank], self.locks[rank] = conn, threading.Lock()
            threading.Thread(target=self._read, args=(rank, conn), daemon=True).start()
            if len(self.conns) == self.world:
                self.ready.set()

    def _read(self, rank: int, conn) -> None:
        try:
            while True:
                msg = conn.recv()
                self.loop.call_soon_threadsafe(self.on_message, rank, msg)
        except (EOFError, OSError):
            self.loop.call_soon_threadsafe(self.on_lost, rank)

    def send(self, replica: int, msg) -> bool:
        """To pipeline rank 0 of `replica` -> False when it is gone."""
        rank = replica * self.ranks
        try:
            with self.locks[rank]:
                self.conns[rank].send(msg)
            return True
        except (KeyError, OSError, EOFError):
            return False

    def broadcast(self, msg) -> List[bool]:
        return [self.send(d, msg) for d in range(self.replicas)]

    def close(self) -> None:
        self.listener.close()
        for conn in list(self.conns.values()):
            try:
                conn.close()
            except OSError:
                pass
