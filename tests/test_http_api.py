"""The pieces of `dsaflow serve` that need no worker process: per-request sampling, incremental detokenization,
stop strings, request checks, the front end's admission (429, 401, 413, no chat template) against a stand-in hub,
and the online scheduler's cancellation inside a real engine (tests/test_http_serve.py runs the whole server)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsaflow.config.compose import compose
from dsaflow.data.tokenizer import ByteTokenizer
from dsaflow.errors import ConfigError
from dsaflow.plan import build_plan
from dsaflow.serve.generate import build_engine
from dsaflow.serve.http.detok import IncrementalDetokenizer
from dsaflow.serve.http.protocol import ApiError, chat_request, completion_request, fit
from dsaflow.serve.http.server import Frontend, TextStream
from dsaflow.serve.online import OnlineScheduler, TokenStream, busy_period, float_bits
from dsaflow.serve.sampling import sample_keyed, sample_rowwise

TOK = ByteTokenizer()


def test_rowwise_sampling_is_each_rows_own_keyed_sampling():
    """Row r at temperature t_r, top_p p_r draws what `sample_keyed` draws for it alone; temperature 0 = argmax."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen) * 3
    settings_ = [(0.0, 1.0), (0.7, 1.0), (1.0, 0.9), (2.0, 0.5), (0.0, 0.3), (1.3, 1.0)]
    keys = torch.tensor([11, 12, 13, 14, 15, 16]) * (1 << 24) + 3
    params = torch.tensor([[int(k), float_bits(t), float_bits(p)] for k, (t, p) in zip(keys, settings_)])
    got = sample_rowwise(logits, params, seed=5)
    for r, (t, p) in enumerate(settings_):
        want = logits[r].argmax() if t == 0 else sample_keyed(logits[r : r + 1], t, p, 5, keys[r : r + 1])[0]
        assert int(got[r]) == int(want), r


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 255), min_size=1, max_size=40))
def test_incremental_detokenization_adds_up_and_never_splits_a_character(ids):
    d = IncrementalDetokenizer(TOK)
    pieces = [d.add(i) for i in ids] + [d.flush()]
    assert "".join(pieces) == TOK.decode(ids)
    for k, piece in enumerate(pieces[:-1]):  # a piece before the end never ends on an unfinished character
        assert not piece.endswith("\ufffd") or TOK.decode(ids[: k + 1]).endswith("\ufffd")


def test_text_stream_holds_back_what_may_start_a_stop_string():
    s = completion_request({"model": "m", "prompt": "x", "stop": ["END"], "max_tokens": 20}, TOK, 256)
    stream = TextStream(s, TOK, eos_id=None)
    pieces = [stream.token(t, None, None, None) for t in b"abcEN"]
    assert "".join(p[0] for p in pieces) == "abc" and all(p[2] is None for p in pieces)  # "EN" may start "END"
    text, _, reason = stream.token(ord("D"), None, None, None)
    assert (text, reason) == ("", "stop")
    # multi-byte characters arrive whole; the limit ends the text with what was held back
    s = completion_request({"model": "m", "prompt": "x", "max_tokens": 3}, TOK, 256)
    stream = TextStream(s, TOK, eos_id=None)
    out = [stream.token(t, None, None, None) for t in "é!".encode()]
    assert [p[0] for p in out] == ["", "é", "!"] and out[-1][2] == "length"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "m", "prompt": "x", "seed": "1"}, "seed"),
        ({"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        ({"model": "m", "prompt": [1, 999]}, "prompt"),
        ({"model": "m", "prompt": "x", "logprobs": 5}, "logprobs"),
        ({"model": "m", "prompt": "x", "echo": True}, "echo"),
        ({"model": 3, "prompt": "x"}, "model"),
    ],
)
def test_bad_fields_are_named(body, param):
    with pytest.raises(ApiError) as got:
        completion_request(body, TOK, 256)
    assert got.value.status == 400 and got.value.param == param and param in got.value.message


def test_chat_max_tokens_defaults_to_what_the_context_leaves():
    s, _ = chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}]}, 256)
    s.prompt = list(b"abcd")
    assert fit(s, 10).max_tokens == 6
    # completions default to 16, as OpenAI's; past the context it is the client's mistake
    with pytest.raises(ApiError, match="max_tokens"):
        fit(completion_request({"model": "m", "prompt": "abcd", "max_tokens": None}, TOK, 256), 10)


def test_server_fields_are_validated():
    with pytest.raises(ConfigError, match="server.drain_s"):
        compose(["server.drain_s=-1"])
    with pytest.raises(ConfigError, match="server.max_queue"):
        compose(["server.max_queue=0"])


class StandInHub:
    """Takes every message and never answers: requests stay in flight until their client leaves."""

    ranks = 1

    def __init__(self):
        self.sent = []

    def send(self, replica, msg):
        self.sent.append(msg)
        return True


def test_front_end_admission_auth_and_limits():
    from aiohttp.test_utils import TestClient, TestServer

    cfg = compose(["mode=serve", "serve.max_batch=1", "server.max_queue=1", "server.max_body_bytes=2048"])
    cfg.server.api_key = "k"
    hub = StandInHub()
    front = Frontend(cfg, TOK, None, hub, replicas=1, model_name="tiny")
    auth = {"Authorization": "Bearer k"}
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}

    async def scenario():
        async with TestClient(TestServer(front.app())) as client:
            assert (await client.get("/v1/models")).status == 401
            assert (await client.get("/health")).status == 200
            pending = [asyncio.ensure_future(client.post("/v1/completions", json=body, headers=auth)) for _ in range(2)]
            while len(front.live) < 2:
                await asyncio.sleep(0.01)
            full = await client.post("/v1/completions", json=body, headers=auth)
            assert full.status == 429 and full.headers["Retry-After"] == "1"
            assert (await full.json())["error"]["type"] == "rate_limit_error"
            chat = await client.post(
                "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
                headers=auth,
            )
            assert chat.status == 400 and "chat template" in (await chat.json())["error"]["message"]
            big = await client.post("/v1/completions", data=b"x" * 4096, headers=auth)
            assert big.status == 413
            for task in pending:  # the clients leave: their requests are cancelled on the replica
                task.cancel()
            while front.live:
                await asyncio.sleep(0.01)

    asyncio.run(scenario())
    adds = [m[1] for m in hub.sent if m[0] == "add"]
    assert sorted(m[1] for m in hub.sent if m[0] == "cancel") == sorted(adds) and len(adds) == 2


class ScriptedTidings:
    """Tidings in one process: the k-th exchange returns script[k] (nothing once the script runs out)."""

    def __init__(self, script):
        self.script, self.calls = dict(script), 0

    def exchange(self, wait_s: float = 0.0):
        news = self.script.get(self.calls, [])
        self.calls += 1
        return news


ONLINE_CFG = ["mode=serve", "model.num_layers=2", "serve.max_batch=2", "serve.max_context=64", "track=none"]
GREEDY = (7, float_bits(0.0), float_bits(1.0))  # a request's (key id, temperature bits, top_p bits)


def online_engine(script):
    """A one-stage engine driven as a replica's rank 0 is, its news scripted per exchange -> (engine, scheduler,
    the messages its TokenStream sends)."""
    cfg = compose(ONLINE_CFG)
    eng = build_engine(cfg, build_plan(cfg), 0, "cpu", per_request_sampling=True)
    eng.capture()
    eng.key_ids, eng.arrivals = {}, None
    sched = eng._scheduler([], kind=OnlineScheduler)
    sched.key_ids, sched.logprob_ids = eng.key_ids, set()
    sched.tidings = ScriptedTidings(script)
    eng.scheduler = sched
    sent = []
    eng.on_pass = TokenStream(eng, sched, sent.append)
    return eng, sched, sent


def engine_tokens(prompt, n):
    """The batch engine's greedy tokens for one prompt."""
    cfg = compose(ONLINE_CFG)
    ref = build_engine(cfg, build_plan(cfg), 0, "cpu")
    ref.capture()
    return ref.generate([prompt], [n])[0]


def test_a_cancelled_request_stops_at_the_tick_its_cancellation_arrives():
    """One stage: each tick picks a pass and finishes it. The cancellation arrives at the 6th tick's pick, so the
    request has exactly the 5 tokens of the ticks before it, and its row is free for that tick's pass."""
    eng, sched, sent = online_engine({0: [("add", 41, list(b"hello"), 30, GREEDY, False)], 5: [("cancel", 41)]})
    busy_period(eng, sched, is_last=True)
    tokens = [t for m in sent for (rid, _k, t, *_rest) in m[1] if rid == 41]
    assert len(tokens) == 5 and sched.idle() and sched.tidings.calls == 6
    assert tokens == engine_tokens(list(b"hello"), 5)  # greedy, per-request sampling: the engine's tokens


def test_a_long_busy_period_is_summarised_window_by_window(monkeypatch):
    """A server that is never idle keeps a bounded timeline: with 4-tick windows, a 20-token request reports one
    window per 4 ticks (each with its own ticks and tokens, together all 20), and no timeline holds more than a
    window's ticks; the tokens are the engine's."""
    import dsaflow.serve.online as online

    monkeypatch.setattr(online, "TIMELINE_WINDOW_TICKS", 4)
    eng, sched, sent = online_engine({0: [("add", 41, list(b"hello"), 20, GREEDY, False)]})
    windows = []
    busy_period(eng, sched, True, lambda stats, seconds: windows.append((stats, len(eng.timeline.ticks))))
    tokens = [t for m in sent for (rid, _k, t, *_rest) in m[1] if rid == 41]
    assert len(tokens) == 20 and len(windows) >= 5
    assert all(ticks <= 5 for _, ticks in windows), windows  # a window's ticks (+ the one that closed it)
    assert sum(stats["tokens"] for stats, _ in windows) == 20
    assert tokens == engine_tokens(list(b"hello"), 20)


def test_random_prompts_round_trip_through_the_request_check():
    r = random.Random(0)
    for _ in range(20):
        ids = [r.randrange(256) for _ in range(r.randrange(1, 30))]
        assert completion_request({"model": "m", "prompt": ids}, TOK, 256).prompt == ids


def test_serve_user_errors_exit_2_and_write_nothing(tmp_path, capsys):
    import socket

    from dsaflow.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["serve", f"server.port={port}", f"run_dir={tmp_path / 'run'}", "track=none"]) == 2
    assert f"server.port={port}" in capsys.readouterr().err and not (tmp_path / "run").exists()
    assert main(["serve", "server.port=70000"]) == 2 and "server.port=70000" in capsys.readouterr().err
    missing = tmp_path / "none.jinja"
    assert main(["serve", f"server.chat_template={missing}", f"run_dir={tmp_path / 'run'}", "track=none"]) == 2
    assert "server.chat_template" in capsys.readouterr().err and not (tmp_path / "run").exists()
    spec = ["model.mtp_layers=1", "serve.speculative_tokens=2", f"run_dir={tmp_path / 'run'}", "track=none"]
    assert main(["serve", *spec]) == 2  # generate verifies drafts; the server does not yet
    assert "serve.speculative_tokens=2" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_eos_and_stop_token_ids_end_the_text_without_their_own():
    s = completion_request({"model": "m", "prompt": "x", "stop_token_ids": [7], "max_tokens": 9}, TOK, 256)
    stream = TextStream(s, TOK, eos_id=3)
    assert stream.token(ord("a"), None, None, None) == ("a", [], None)
    assert stream.token(3, None, None, None) == ("", [], "stop")  # serve.eos_id
    stream = TextStream(s, TOK, eos_id=3)
    assert [stream.token(t, None, None, None)[2] for t in (ord("b"), 7)] == [None, "stop"]


def test_the_checkpoints_chat_template_renders_with_its_special_tokens(tmp_path):
    import json

    from dsaflow.serve.http.chat import load_chat_template

    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
    config = {"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    chat = load_chat_template(None, tmp_path)
    assert chat.render([{"role": "user", "content": "hi"}]) == "<s>[user] hi\n[assistant]"
    assert load_chat_template(None, tmp_path / "elsewhere") is None  # no tokenizer_config.json: no template
    # a template cannot reach Python internals (the sandbox), and its own raise_exception is the client's 400
    (tmp_path / "t.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ApiError):
        load_chat_template(str(tmp_path / "t.jinja"), None).render([{"role": "user", "content": "x"}])
    (tmp_path / "r.jinja").write_text("{{ raise_exception('only user turns') }}")
    with pytest.raises(ApiError, match="only user turns"):
        load_chat_template(str(tmp_path / "r.jinja"), None).render([{"role": "user", "content": "x"}])


def test_serve_refuses_a_sweep(capsys):
    from dsaflow.cli import main

    assert main(["serve", "-m", "server.port=8001,8002"]) == 2
    assert "-m" in capsys.readouterr().err


def byte_level_tokenizer(path):
    """A byte-level BPE tokenizer.json (no merges: one token per byte, as GPT-2's alphabet) whose post-processor
    adds a BOS token, as DeepSeek's and GLM's do -> the HFTokenizer dsaflow reads it with."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    from dsaflow.data.hf_tokenizer import HFTokenizer

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<bos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    tok.save(str(path))
    return HFTokenizer(path)


def test_byte_level_tokenizer_streams_whole_characters_and_chat_adds_no_second_bos(tmp_path):
    from dsaflow.serve.http.chat import encode_rendered

    hf = byte_level_tokenizer(tmp_path / "tokenizer.json")
    text = "héllo wörld 漢字 🙂 done"
    ids = hf.encode(text)
    assert ids[0] == hf.vocab_size - 1 and encode_rendered(hf, text) == ids[1:]  # the template writes its own BOS
    d = IncrementalDetokenizer(hf)
    pieces = [d.add(i) for i in ids[1:]] + [d.flush()]
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
    assert "漢" in pieces and "🙂" in pieces  # each multi-byte character arrives in one piece, once complete
