"""`/metrics` of `dsaflow serve` in the Prometheus text format (prometheus_client), one registry per server.

Names follow vLLM's where the meaning is the same, under the `dsaflow:` prefix: queue depth (requests admitted
that have no token yet), running rows (cache rows generating, as the replicas' last stages last reported), time to
first token and per output token (histograms, seconds, measured at the HTTP front end), generated and prompt tokens
(counters; rate() of the first is tokens/s), output tokens/s over the last `WINDOW_S` seconds, and each rank's busy
fraction over its latest busy period (a run of ticks from idle to idle).
"""

from __future__ import annotations

import time
from collections import deque

WINDOW_S = 10.0
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


class ServerMetrics:
    def __init__(self, model: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = reg = CollectorRegistry()
        labels = {"model_name": model}
        self.queue_depth = Gauge("dsaflow:num_requests_waiting", "requests admitted with no token yet", registry=reg)
        self.running = Gauge(
            "dsaflow:num_requests_running", "cache rows generating (last stages' reports)", registry=reg
        )
        self.ttft = Histogram(
            "dsaflow:time_to_first_token_seconds", "time to first token", buckets=LATENCY_BUCKETS, registry=reg
        )
        self.tpot = Histogram(
            "dsaflow:time_per_output_token_seconds",
            "time per output token after the first",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "dsaflow:e2e_request_latency_seconds", "request latency", buckets=LATENCY_BUCKETS, registry=reg
        )
        self.generated = Counter("dsaflow:generation_tokens", "generated tokens", registry=reg)
        self.prompt = Counter("dsaflow:prompt_tokens", "prompt tokens", registry=reg)
        self.rate = Gauge(
            "dsaflow:generation_tokens_per_second", f"generated tokens/s over the last {WINDOW_S:g} s", registry=reg
        )
        self.busy = Gauge(
            "dsaflow:rank_busy_fraction", "a rank's busy fraction in its latest busy period", ["rank"], registry=reg
        )
        self.finished = Counter(
            "dsaflow:request_success", "finished requests by reason", ["finished_reason"], registry=reg
        )
        self.errors = Counter(
            "dsaflow:request_errors", "requests answered with an error, by status", ["status"], registry=reg
        )
        self.labels = labels
        self.recent: deque = deque()  # (time, tokens) of the last WINDOW_S seconds

    def tokens(self, n: int) -> None:
        now = time.monotonic()
        self.generated.inc(n)
        self.recent.append((now, n))

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        now = time.monotonic()
        while self.recent and self.recent[0][0] < now - WINDOW_S:
            self.recent.popleft()
        self.rate.set(sum(n for _, n in self.recent) / WINDOW_S)
        return generate_latest(self.registry)
