"""`dsaflow serve` end to end on CPU: the parent's HTTP front end, torchrun, gloo workers, against one process per
configuration (single, pp2, pp2 x 2 replicas; module-scoped), driven by the official `openai` client and by curl.

The reference is `dsaflow generate`'s engine in this process (`build_engine(...).generate`, one stage holding every
layer): a greedy completion over HTTP must be its tokens, decoded, whatever the pipeline split or replica. The last
test of each server stops it: SIGTERM drains (single, pp2 x 2), a killed worker gives 503 and exit 1 (pp2)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from dsaflow.config.compose import compose
from dsaflow.data.tokenizer import ByteTokenizer
from dsaflow.launch.lifecycle import descendants
from dsaflow.plan import build_plan
from dsaflow.serve.generate import build_engine

openai = pytest.importorskip("openai")  # the dev extra; CI installs it

REPO = Path(__file__).resolve().parents[1]
KEY = "test-key"
COMMON = [
    "model.num_layers=4",
    "serve.max_batch=8",
    "serve.max_context=96",
    "serve.prefill_chunk=16",
    "server.max_queue=40",
    "server.max_body_bytes=4096",
    "track=none",
]
CONFIGS = {"single": [], "pp2": ["pipeline=pp2"], "pp2x2": ["pipeline=pp2", "parallel.dp=2"]}
PROMPTS = ["hello", "hi there, friend", "abc", "the quick brown fox", "x", "0123456789", "a b c d e", "?!"]
MAX_NEW = 8
CHAT = (REPO / "tests" / "fixtures" / "chat_template.jinja").resolve()
TOK = ByteTokenizer()


CHAT_MESSAGES = [{"role": "user", "content": "hello"}]
CHAT_RENDERED = "<|user|>hello\n<|assistant|>"  # tests/fixtures/chat_template.jinja on CHAT_MESSAGES


@pytest.fixture(scope="module")
def reference():
    """{prompt: (greedy tokens, fp32 logits per token)} from the in-process engine, every stage in one process."""
    cfg = compose(["mode=serve", "serve.temperature=0", *COMMON])
    eng = build_engine(cfg, build_plan(cfg), 0, "cpu", all_stages=True)
    eng.capture()
    eng.record_logits = True
    prompts = [*PROMPTS, CHAT_RENDERED]
    out = eng.generate([TOK.encode(p) for p in prompts], [MAX_NEW] * len(prompts))
    return {p: (toks, eng.logits_log[i]) for i, (p, toks) in enumerate(zip(prompts, out))}


class Server:
    def __init__(self, name: str, tmp: Path):
        self.name, self.log = name, tmp / "server.log"
        cmd = [sys.executable, "-c", "from dsaflow.cli import main; main()", "serve", "server.port=0"]
        cmd += [f"server.chat_template={CHAT}", f"run_dir={tmp / 'run'}", *COMMON, *CONFIGS[name]]
        env = {**os.environ, "DSAFLOW_API_KEY": KEY}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while not (m := re.search(r"ready on (http://\S+)", self.log.read_text())):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.1)
        self.url = m.group(1)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def curl(self, path: str, body=None, key: str = KEY, *extra: str) -> tuple:
        """-> (status, body text) of one request through curl."""
        cmd = ["curl", "-sS", "-N", "-w", "\n%{http_code}", "-H", f"Authorization: Bearer {key}", *extra]
        if body is not None:
            data = body if isinstance(body, str) else json.dumps(body)
            cmd += ["-H", "Content-Type: application/json", "--data-binary", data]
        res = subprocess.run([*cmd, self.url + path], capture_output=True, text=True, timeout=120)
        text, _, status = res.stdout.rpartition("\n")
        return int(status), text

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module", params=list(CONFIGS))
def server(request, tmp_path_factory):
    s = Server(request.param, tmp_path_factory.mktemp(request.param))
    yield s
    s.stop()


def text_of(reference, prompt: str) -> str:
    return TOK.decode(reference[prompt][0])


def test_greedy_completions_equal_generate_streamed_and_not(server, reference):
    for prompt in PROMPTS[:3]:
        got = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0)
        assert got.choices[0].text == text_of(reference, prompt)
        assert got.choices[0].finish_reason == "length"
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(prompt.encode()), MAX_NEW)
        chunks = list(
            server.client.completions.create(
                model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0, stream=True
            )
        )
        assert "".join(c.choices[0].text for c in chunks) == text_of(reference, prompt)
        assert chunks[-1].choices[0].finish_reason == "length"
    # a prompt of token ids, through curl
    status, body = server.curl(
        "/v1/completions", {"model": "tiny", "prompt": list(b"abc"), "max_tokens": MAX_NEW, "temperature": 0}
    )
    assert status == 200 and json.loads(body)["choices"][0]["text"] == text_of(reference, "abc")


def test_logprobs_are_the_engines_top1(server, reference):
    got = server.client.completions.create(model="tiny", prompt="hello", max_tokens=MAX_NEW, temperature=0, logprobs=1)
    lp = got.choices[0].logprobs
    toks, logits = reference["hello"]
    want = [torch.log_softmax(row.double(), -1) for row in logits]
    assert len(lp.token_logprobs) == MAX_NEW
    for i, (tok, w) in enumerate(zip(toks, want)):
        assert lp.token_logprobs[i] == pytest.approx(float(w[tok]), abs=1e-4)  # fp32 log_softmax of the same logits
        ((top_text, top_lp),) = lp.top_logprobs[i].items()
        assert top_lp == pytest.approx(float(w.max()), abs=1e-4) and top_text == TOK.decode([int(w.argmax())])


def test_stops_seeds_and_chat(server, reference):
    toks = reference["hi there, friend"][0]
    # a stop token id ends the text before it
    cut = toks[4]
    got = server.client.completions.create(
        model="tiny", prompt="hi there, friend", max_tokens=MAX_NEW, temperature=0, extra_body={"stop_token_ids": [cut]}
    )
    assert got.choices[0].finish_reason == "stop" and got.choices[0].text == TOK.decode(toks[: toks.index(cut)])
    # a stop string: the text ends before its first occurrence, streamed and not
    full = text_of(reference, "hi there, friend")
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop
    for stream in (False, True):
        res = server.client.completions.create(
            model="tiny", prompt="hi there, friend", max_tokens=MAX_NEW, temperature=0, stop=[stop], stream=stream
        )
        text = "".join(c.choices[0].text for c in res) if stream else res.choices[0].text
        assert text == full[: full.index(stop)]
    # sampling: the same seed gives the same text, another seed (almost surely) another
    draw = lambda seed: (
        server.client.completions.create(  # noqa: E731
            model="tiny", prompt="abc", max_tokens=MAX_NEW, temperature=1.0, top_p=0.9, seed=seed
        )
        .choices[0]
        .text
    )
    assert draw(7) == draw(7) != draw(8)
    # chat: the template renders the messages into the prompt the engine sees
    want = text_of(reference, CHAT_RENDERED)
    chat = server.client.chat.completions.create
    got = chat(model="tiny", messages=CHAT_MESSAGES, max_tokens=MAX_NEW, temperature=0)
    assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
    chunks = list(chat(model="tiny", messages=CHAT_MESSAGES, max_tokens=MAX_NEW, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want


def test_32_concurrent_streaming_clients(server, reference):
    def one(i: int) -> tuple:
        prompt = PROMPTS[i % len(PROMPTS)]
        stream = server.client.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0, stream=True
        )
        return prompt, "".join(c.choices[0].text for c in stream)

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert all(text == text_of(reference, prompt) for prompt, text in results)


def test_bad_inputs_get_their_status_and_others_are_served(server, reference):
    # a streaming client runs through all the bad requests below, and must still get its whole, right answer
    streamed = {}

    def long_client():
        stream = server.client.completions.create(
            model="tiny", prompt="hello", max_tokens=MAX_NEW, temperature=0, stream=True
        )
        streamed["text"] = "".join(c.choices[0].text for c in stream)

    t = threading.Thread(target=long_client)
    t.start()
    cases = [
        ("{not json", 400, None),
        ({"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": "tiny", "prompt": 5}, 400, "prompt"),
        ({"model": "tiny", "prompt": "x" * 200}, 400, "prompt"),  # longer than serve.max_context=96
        ({"model": "tiny", "prompt": "x", "max_tokens": 200}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "n": 2}, 400, "n"),
        ({"model": "tiny", "prompt": "x", "best_of": 3}, 400, "best_of"),
        ({"model": "tiny", "prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
        ({"model": "tiny", "prompt": "x", "colour": "red"}, 400, "colour"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ({"model": "tiny", "prompt": "x" * 5000}, 413, None),  # over server.max_body_bytes=4096
    ]
    for body, status, param in cases:
        got, text = server.curl("/v1/completions", body)
        err = json.loads(text)["error"]
        assert (got, err["param"]) == (status, param), text
        assert err["message"] and err["type"]
    got, text = server.curl("/v1/chat/completions", {"model": "tiny", "messages": "hi"})
    assert got == 400 and json.loads(text)["error"]["param"] == "messages"
    assert server.curl("/v1/models", None, "wrong-key")[0] == 401
    assert server.curl("/health", None, "wrong-key")[0] == 200  # /health needs no key
    t.join(120)
    assert streamed["text"] == text_of(reference, "hello")
    status, text = server.curl("/v1/models")
    assert status == 200 and json.loads(text)["data"][0]["id"] == "tiny"


def test_a_client_that_leaves_frees_its_row(server):
    """The stream is dropped after its first chunk: its replica cancels it, and the running rows reported in
    /metrics fall back to 0 long before its 80 tokens could have been generated."""
    import httpx

    body = {"model": "tiny", "prompt": "hello", "max_tokens": 80, "temperature": 0, "stream": True}
    head = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=head, timeout=60) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        page = httpx.get(server.url + "/metrics", headers=head, timeout=10).text
        running = float(re.search(r"^dsaflow:num_requests_running (\S+)", page, re.M).group(1))
        waiting = float(re.search(r"^dsaflow:num_requests_waiting (\S+)", page, re.M).group(1))
        if running == 0 and waiting == 0:
            break
        time.sleep(0.05)
    assert running == 0 and waiting == 0
    assert re.search(r'^dsaflow:rank_busy_fraction\{rank="0"\} ', page, re.M)
    assert float(re.search(r"^dsaflow:time_to_first_token_seconds_count (\S+)", page, re.M).group(1)) > 0


def test_stop(server, reference):
    """single and pp2 x 2: SIGTERM drains (the request in flight finishes, a new one gets 503) and exits 0.
    pp2: a killed worker makes the request in flight and /health answer 503, and the server exits 1."""
    results = {}

    def client():
        try:
            got = server.client.completions.create(model="tiny", prompt="hello", max_tokens=90, temperature=0)
            results["text"] = got.choices[0].text
        except openai.APIStatusError as exc:
            results["status"] = exc.status_code

    t = threading.Thread(target=client)
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    if server.name == "pp2":
        rank1 = [p for p in descendants(server.proc.pid) if b"RANK=1\0" in Path(f"/proc/{p}/environ").read_bytes()]
        os.kill(rank1[0], signal.SIGKILL)
        t.join(30)
        assert results == {"status": 503}
        assert server.proc.wait(30) == 1
        assert time.monotonic() - t0 < 10.0  # DEAD_EXIT_S
        assert "worker" in server.log.read_text() and "503" in server.log.read_text()
        return
    server.proc.send_signal(signal.SIGTERM)
    while server.curl("/health")[0] == 200:  # until the signal is handled: then it says "draining"
        time.sleep(0.02)
    assert server.curl("/v1/completions", {"model": "tiny", "prompt": "x"})[0] == 503
    t.join(60)
    assert server.proc.wait(60) == 0
    assert len(results["text"]) > 0  # answered in full (a request cut by the drain would have got 503)
