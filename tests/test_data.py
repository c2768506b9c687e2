"""Data: byte tokenizer, retrieval task structure and determinism, text / nanoGPT .bin corpora, step-indexed batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsaflow.config.schema import DataConfig
from dsaflow.data import IGNORE, BatchSource, ByteTokenizer, CorpusError, RetrievalSpec, retrieval_batch
from dsaflow.data.retrieval import COPY
from dsaflow.train.pipeline import LMLoss


def test_byte_tokenizer_round_trips_unicode():
    tok = ByteTokenizer()
    text = "key K7; naïve → ok"
    ids = tok.encode(text)
    assert max(ids) < 256 and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert tok.encode_array(text).tolist() == ids


@pytest.mark.parametrize("pairs,queries,klen,vlen,T", [(4, 4, 1, 1, 64), (6, 2, 2, 3, 128), (1, 1, 1, 1, 8)])
def test_retrieval_answers_are_the_queried_values(pairs, queries, klen, vlen, T):
    spec = RetrievalSpec(T, pairs, klen, vlen, queries)
    spec.check()
    tokens, qid = retrieval_batch(spec, seed=3, split=0, step=5, batch=16)
    assert tokens.shape == qid.shape == (16, T + 1)
    for row, q in zip(tokens, qid):
        text = bytes(row).decode()
        body = text[: T + 1 - queries * spec.query_len]
        assert "?" not in body
        pairs_found = {}
        for chunk in body.split(";")[:-1]:
            item = chunk.split(" ")[-1]
            pairs_found[item[:klen]] = item[klen:]
        assert len(pairs_found) == pairs and all(k.isupper() for k in pairs_found)
        for i in range(queries):
            start = T + 1 - (queries - i) * spec.query_len
            query = text[start : start + spec.query_len]
            key, value = query[1 : 1 + klen], query[1 + klen :]
            assert query[0] == "?" and pairs_found[key] == value
            answer = "".join(chr(c) for c, k in zip(row, q) if k == i)
            assert answer == value


def test_retrieval_is_deterministic_and_varies_by_step():
    spec = RetrievalSpec(64, 4, 1, 1, 4)
    a, _ = retrieval_batch(spec, 0, 0, 7, 4)
    b, _ = retrieval_batch(spec, 0, 0, 7, 4)
    c, _ = retrieval_batch(spec, 0, 0, 8, 4)
    v, _ = retrieval_batch(spec, 0, 1, 7, 4)
    assert (a == b).all() and not (a == c).all() and not (a == v).all()
    # row r does not depend on the batch size (resume and re-sharding keep samples)
    assert (retrieval_batch(spec, 0, 0, 7, 2)[0] == a[:2]).all()


def test_retrieval_spec_errors_name_the_field():
    with pytest.raises(ValueError, match="train.seq_len=10"):
        RetrievalSpec(10, 4, 1, 1, 4).check()
    with pytest.raises(ValueError, match="data.key_len=1"):
        RetrievalSpec(1024, 30, 1, 1, 1).check()


def _source(**kw) -> BatchSource:
    kw = {"num_pairs": 4, "num_queries": 4, **kw}
    return BatchSource(DataConfig(**kw), seq_len=64, batch_size=4, seed=1, vocab_size=256)


def test_batch_targets_and_loss_modes():
    x, y = _source().batch(3)
    assert x.shape == (4, 64) and y.shape == (4, 3, 64) and x.dtype == y.dtype == torch.int64
    lm, ans, qid = y[:, 0], y[:, 1], y[:, 2]
    assert ((ans != IGNORE) == (qid >= 0)).all() and (qid.max(dim=1).values == 3).all()
    assert (lm == ans).all(), "loss_on=answer trains on the answers only"
    x2, y2 = _source(loss_on="all").batch(3)
    assert (x2 == x).all()
    assert (y2[:, 0, :-1] == x[:, 1:]).all(), "loss_on=all: next-token targets everywhere"


def test_lm_loss_accuracy_is_per_query_exact_match():
    _, y = BatchSource(DataConfig(num_pairs=4, num_queries=4, value_len=2), 64, 2, 0, 256).batch(0)
    ans, qid = y[:, 1], y[:, 2]
    logits = torch.zeros(2, 64, 256)
    logits.scatter_(2, ans.clamp_min(0).unsqueeze(-1), 1.0)  # perfect on every answer byte
    loss_fn = LMLoss(num_queries=4)
    loss_fn(logits, y)
    assert loss_fn.accuracy() == 1.0
    # break one byte of query 2 in row 0: that query (only) is wrong
    pos = int((qid[0] == 2).nonzero()[0])
    logits[0, pos] = 0.0
    logits[0, pos, (int(ans[0, pos]) + 1) % 256] = 1.0
    loss_fn.reset()
    loss_fn(logits, y)
    assert loss_fn.accuracy() == 7 / 8


def test_text_folder_corpus(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha " * 50)
    (tmp_path / "sub" / "b.md").write_text("beta " * 50)
    (tmp_path / "skip.bin").write_bytes(b"\xff" * 1000)
    src = BatchSource(DataConfig(kind="text", path=str(tmp_path), val_fraction=0.2), 16, 3, 0, 256)
    x, y = src.batch(0)
    assert x.shape == (3, 16)
    assert (y[:, 0, :-1] == x[:, 1:]).all() and (y[:, 1] == IGNORE).all()
    assert set(bytes(x.flatten().tolist()).decode()) <= set("alphbet \n")
    assert (src.batch(0)[0] == x).all() and not (src.batch(1)[0] == x).all()


def test_bin_corpus_memmap(tmp_path):
    tokens = (np.arange(5000) % 1000).astype(np.uint16)
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    src = BatchSource(DataConfig(kind="bin", path=str(path), val_fraction=0.1), 32, 4, 0, 1024)
    x, y = src.batch(2)
    assert ((x[:, 1:] - x[:, :-1]) % 1000 == 1).all(), "windows are contiguous slices of the file"
    vx, _ = src.val_batch(0)
    assert (vx >= 0).all() and ((vx[:, 0] - tokens[4500]) % 1000 < 500).all()
    with pytest.raises(ValueError, match="model.vocab_size=256"):
        BatchSource(DataConfig(kind="bin", path=str(path)), 32, 4, 0, 256).batch(0)


def test_corpus_errors(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        _source(kind="text", path=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="holds no"):
        _source(kind="text", path=str(tmp_path / "empty"))
    (tmp_path / "short.txt").write_text("tiny")
    with pytest.raises(CorpusError, match="train.seq_len"):
        _source(kind="text", path=str(tmp_path / "short.txt"))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(CorpusError, match="odd size"):
        _source(kind="bin", path=str(tmp_path / "odd.bin"))


def test_distinct_queries_ask_every_pair_once():
    spec = RetrievalSpec(64, 4, 1, 2, 4, distinct_queries=True)
    spec.check()
    tokens, _ = retrieval_batch(spec, 0, 0, 3, 32)
    for row in tokens:
        tail = bytes(row[-4 * spec.query_len :]).decode()
        keys = [q[0] for q in tail.split("?")[1:]]
        assert len(keys) == 4 and len(set(keys)) == 4, tail
    # without the flag, 32 rows of 4 draws with replacement repeat a key somewhere (the stream is unchanged)
    plain, _ = retrieval_batch(RetrievalSpec(64, 4, 1, 2, 4), 0, 0, 3, 32)
    assert any(len({q[0] for q in bytes(r[-16:]).decode().split("?")[1:]}) < 4 for r in plain)
    with pytest.raises(ValueError, match="data.distinct_queries=true needs data.num_queries <= data.num_pairs"):
        RetrievalSpec(64, 2, 1, 2, 3, distinct_queries=True).check()


def _is_filler(a: np.ndarray) -> np.ndarray:
    return ((a >= ord("a")) & (a <= ord("z"))) | (a == ord(" "))


def test_copy_len_repeats_a_filler_run_and_trains_on_it():
    plain_spec = RetrievalSpec(128, 8, 1, 1, 4, distinct_queries=True)
    spec = RetrievalSpec(128, 8, 1, 1, 4, distinct_queries=True, copy_len=16)
    spec.check()
    plain, plain_qid = retrieval_batch(plain_spec, 0, 0, 3, 32)
    tokens, qid = retrieval_batch(spec, 0, 0, 3, 32)
    # the same pairs, queries and answers: the run only overwrites filler with filler
    assert ((qid >= 0) == (plain_qid >= 0)).all() and (qid[qid >= 0] == plain_qid[plain_qid >= 0]).all()
    changed = tokens != plain
    assert changed.any(1).all() and _is_filler(plain[changed]).all() and _is_filler(tokens[changed]).all()
    trained = (qid == COPY).sum(1)
    assert trained.max() <= 15 and trained.mean() > 10  # up to copy_len - 1; fewer where a pair splits a run
    for row, q in zip(tokens, qid):
        # each stretch of trained bytes, with the byte before it, occurs earlier: predictable by induction alone
        at = np.flatnonzero(q == COPY)
        for run in np.split(at, np.flatnonzero(np.diff(at) != 1) + 1):
            s, e = int(run[0]), int(run[-1])
            assert bytes(row[s - 1 : e + 1]) in bytes(row[: s - 1]), (bytes(row), s, e)
    assert not (plain_qid == COPY).any()


def test_copy_chars_mixed_draws_the_run_from_key_and_value_bytes():
    """copy_chars=mixed: the same pairs, queries and answers; the run holds letters of both cases and digits (the
    bytes keys and values use), no space, and it still repeats earlier, so induction predicts each trained byte."""
    base = dict(seq_len=128, num_pairs=8, key_len=1, value_len=1, num_queries=4, distinct_queries=True, copy_len=16)
    plain, plain_qid = retrieval_batch(RetrievalSpec(**base), 0, 0, 3, 32)
    tokens, qid = retrieval_batch(RetrievalSpec(**base, copy_mixed=True), 0, 0, 3, 32)
    assert ((qid >= 0) == (plain_qid >= 0)).all() and (qid[qid >= 0] == plain_qid[plain_qid >= 0]).all()
    assert ((qid == COPY) == (plain_qid == COPY)).all()  # the same positions are trained
    run = tokens[qid == COPY]
    assert np.isin(run, np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", dtype=np.uint8)).mean() > 0.4
    assert not (run == ord(" ")).any()
    for row, q in zip(tokens, qid):
        at = np.flatnonzero(q == COPY)
        for stretch in np.split(at, np.flatnonzero(np.diff(at) != 1) + 1):
            s, e = int(stretch[0]), int(stretch[-1])
            assert bytes(row[s - 1 : e + 1]) in bytes(row[: s - 1]), (bytes(row), s, e)
        text = bytes(row)
        # the run forms no pair: every " X" (space, uppercase) in the row is one of the 8 real pairs
        assert sum(text[i] == 32 and 65 <= text[i + 1] <= 90 for i in range(len(text) - 1)) == 8, text


def test_copy_chars_needs_a_retrieval_run():
    with pytest.raises(CorpusError, match="data.copy_len=0 repeats none. Fix: set data.copy_len"):
        _source(copy_chars="mixed")
    _source(num_pairs=2, num_queries=1, copy_len=12, copy_chars="mixed").batch(0)


def test_copy_len_bytes_are_trained_not_scored():
    x, y = _source(num_pairs=2, num_queries=1, copy_len=12).batch(3)
    lm, ans, qid = y[:, 0], y[:, 1], y[:, 2]
    copy = qid == COPY
    assert copy.any(1).all()
    assert ((lm != IGNORE) == ((qid >= 0) | copy)).all(), "loss_on=answer trains on the answers and the repeat"
    assert ((ans != IGNORE) == (qid >= 0)).all(), "the repeat is no answer"
    logits = torch.zeros(4, 64, 256)
    logits.scatter_(2, ans.clamp_min(0).unsqueeze(-1), 1.0)  # right on every answer, wrong on every repeated byte
    loss_fn = LMLoss(num_queries=1)
    loss_fn(logits, y)
    assert loss_fn.accuracy() == 1.0 and int(loss_fn.total) == 4
    _, y_all = _source(num_pairs=2, num_queries=1, copy_len=12, loss_on="all").batch(3)
    assert (y_all[:, 0, :-1] == x[:, 1:]).all()


def test_copy_len_errors_name_the_field():
    with pytest.raises(ValueError, match="data.copy_len=1: a repeated run needs >= 2 bytes"):
        RetrievalSpec(64, 2, 1, 1, 1, copy_len=1).check()
    with pytest.raises(ValueError, match=r"train.seq_len=64 cannot hold 4 pairs and 2 queries and a 24-byte run"):
        RetrievalSpec(64, 4, 1, 1, 2, copy_len=24).check()
    RetrievalSpec(64, 4, 1, 1, 2, copy_len=20).check()  # 16 + 6 + 40 = 62 bytes fit
    with pytest.raises(CorpusError, match="data.copy_len=8 does nothing with data.kind=text"):
        _source(kind="text", path=__file__, copy_len=8)
    with pytest.raises(CorpusError, match="data.copy_chars=mixed does nothing with data.kind=text"):
        _source(kind="text", path=__file__, copy_chars="mixed")


def _files(root, names):
    """One file per name, filled with its own letter, so a window tells which files it read."""
    for name, letter in names.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(letter * 300)


def test_split_files_holds_out_whole_files(tmp_path):
    names = {f"m{i}.py": "abcdefghij"[i] for i in range(10)}
    _files(tmp_path, {**names, "notes.txt": "z", "site-packages/x.py": "y", "pkg/sub.py": "k"})
    cfg = DataConfig(
        kind="text", path=str(tmp_path), suffixes=[".py"], exclude=["site-packages/*"], split="files", val_fraction=0.2
    )
    src = BatchSource(cfg, 32, 16, 0, 256)
    seen = {0: set(), 1: set()}
    for i in range(20):
        seen[0] |= set(bytes(src.batch(i)[0].flatten().tolist()).decode()) - {"\n"}
        seen[1] |= set(bytes(src.val_batch(i)[0].flatten().tolist()).decode()) - {"\n"}
    # 11 files read in sorted order (m0..m9, pkg/sub.py): the held-out ones are the 5th and the 10th (m4, m9)
    assert seen[1] == {"e", "j"}
    assert seen[0] == set("abcdfghi") | {"k"}  # never .txt, never site-packages, never a held-out file
    # tail split of the same files: the held-out part is the end of the joined bytes (pkg/sub.py, m9, m8's end)
    cfg.split = "tail"
    tail = BatchSource(cfg, 32, 16, 0, 256)
    assert set(bytes(tail.val_batch(0)[0].flatten().tolist()).decode()) <= {"i", "j", "k", "\n"}


def test_text_options_are_refused_where_they_do_nothing(tmp_path):
    _files(tmp_path, {"a.py": "a", "b.py": "b"})
    one = str(tmp_path / "a.py")
    with pytest.raises(CorpusError, match="data.split=files holds out whole files, but data.path=.* is one file"):
        _source(kind="text", path=one, split="files")
    with pytest.raises(
        CorpusError, match="holds out no file of the 2 read. Fix: raise data.val_fraction to at least 0.5"
    ):
        _source(kind="text", path=str(tmp_path), suffixes=[".py"], split="files", val_fraction=0.3)
    with pytest.raises(CorpusError, match=r"data.suffixes=\['py'\]: each must be a file suffix with its dot"):
        _source(kind="text", path=str(tmp_path), suffixes=["py"])
    with pytest.raises(CorpusError, match=r"holds no .py files outside data.exclude=\['\*'\]"):
        _source(kind="text", path=str(tmp_path), suffixes=[".py"], exclude=["*"])
    with pytest.raises(
        CorpusError, match=r"data.split=files, data.suffixes=\['.py'\] do nothing with data.kind=retrieval"
    ):
        _source(split="files", suffixes=[".py"])
    with pytest.raises(CorpusError, match="data.distinct_queries=true does nothing with data.kind=text"):
        _source(kind="text", path=one, distinct_queries=True)


def _elimination_accuracy(spec: RetrievalSpec, rows: int) -> float:
    """Expected accuracy of a model that never matches keys: each answer guessed uniformly among the context's
    values that no earlier query has taken (with distinct queries, the last answer is the one value left)."""
    tokens, _ = retrieval_batch(spec, 0, 0, 0, rows)
    hits = []
    for row in tokens:
        text = bytes(row).decode()
        body, tail = text[: -spec.num_queries * spec.query_len], text[-spec.num_queries * spec.query_len :]
        k, v = spec.key_len, spec.value_len
        values = [
            body[i + 1 + k : i + 1 + k + v]
            for i in range(len(body) - spec.pair_len + 1)
            if body[i] == " " and body[i + 1 : i + 1 + k].isupper() and body[i + spec.pair_len - 1] == ";"
        ]
        assert len(values) == spec.num_pairs, text
        for q in tail.split("?")[1:]:
            answer = q[k:]
            hits.append(values.count(answer) / len(values))
            values.remove(answer)
    return float(np.mean(hits))


def test_retrieval_long_cannot_be_answered_by_elimination():
    """`data=retrieval_long` must need key matching: asking every pair once lets a model that only knows which
    values remain score about 0.57 with 4 pairs and 4 queries; with 8 pairs it scores about 0.24 (one-digit values
    repeat among the pairs), far below the 0.9 a model that retrieves reaches."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load("configs/data/retrieval_long.yaml")
    spec = RetrievalSpec(1024, cfg.num_pairs, cfg.key_len, cfg.value_len, cfg.num_queries, cfg.distinct_queries)
    spec.check()
    assert _elimination_accuracy(spec, 256) < 0.3
    with_copy = RetrievalSpec(1024, cfg.num_pairs, cfg.key_len, cfg.value_len, cfg.num_queries, True, copy_len=32)
    assert _elimination_accuracy(with_copy, 256) < 0.3  # the repeated filler run tells nothing about the pairs
    leaky = RetrievalSpec(1024, 4, 1, 1, 4, distinct_queries=True)
    assert _elimination_accuracy(leaky, 256) > 0.45  # the check itself sees the shortcut where there is one
