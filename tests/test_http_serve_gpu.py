"""`dsaflow serve` on one GPU with decode and mixed CUDA graphs: greedy completions over HTTP (openai client,
streamed and not, 16 at once) are the in-process engine's tokens with the same graphs, and per-request sampling
(each request's own temperature / top_p / seed, [rows, 3] keys inside the decode graph) gives the same text for
the same seed. Skipped without a GPU."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dsaflow.config.compose import compose
from dsaflow.data.tokenizer import ByteTokenizer
from dsaflow.plan import build_plan
from dsaflow.serve.generate import build_engine

REPO = Path(__file__).resolve().parents[1]
SERVE = [
    "model.num_layers=4",
    "serve.max_batch=8",
    "serve.max_context=96",
    "serve.prefill_chunk=16",
    "serve.dtype=fp32",
    "graphs=decode_mixed",
    "graphs.blocks.0.shape_classes=[1,2,4,8]",
    "graphs.blocks.1.shape_classes=[8,16,32,48]",
    "serve.max_pass_tokens=48",
    "serve.short_prefill=false",
    "track=none",
]
PROMPTS = ["hello", "hi there, friend", "abc", "the quick brown fox"]
TOK = ByteTokenizer()


@pytest.mark.gpu
def test_serve_with_cuda_graphs_gives_the_engines_greedy_tokens(tmp_path):
    openai = pytest.importorskip("openai")
    cfg = compose(["mode=serve", "serve.temperature=0", *SERVE])
    eng = build_engine(cfg, build_plan(cfg), 0, "cuda:0", all_stages=True)
    eng.capture()
    want = [TOK.decode(t) for t in eng.generate([TOK.encode(p) for p in PROMPTS], [16] * len(PROMPTS))]
    del eng
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-c", "from dsaflow.cli import main; main()", "serve", "server.port=0"]
    proc = subprocess.Popen(
        [*cmd, f"run_dir={tmp_path / 'run'}", *SERVE], cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 300
        while not (m := re.search(r"ready on (http://\S+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        client = openai.OpenAI(base_url=m.group(1) + "/v1", api_key="none", max_retries=0, timeout=120)
        complete = lambda p, **kw: client.completions.create(model="tiny", prompt=p, max_tokens=16, **kw)  # noqa: E731
        for p, w in zip(PROMPTS, want):
            assert complete(p, temperature=0).choices[0].text == w
            assert "".join(c.choices[0].text for c in complete(p, temperature=0, stream=True)) == w
        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(lambda i: complete(PROMPTS[i % 4], temperature=0).choices[0].text, range(16)))
        assert got == [want[i % 4] for i in range(16)]
        draw = lambda s: complete("abc", temperature=0.8, top_p=0.9, seed=s).choices[0].text  # noqa: E731
        assert draw(3) == draw(3)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log.read_text()[-3000:]
