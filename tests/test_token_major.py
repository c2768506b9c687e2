"""Token-major passes (tokens of many cache rows side by side in one batch row, each addressed by its row and
position): the indexer top-k with per-query key rows equals scoring each row alone (naive and the Triton kernels, in
the interpreter on CPU), and a stage forward over a token-major pass equals the same tokens as a right-padded
[rows, T] pass: the logits of every real token, the cached rows and the index slot's row-local indices."""

from __future__ import annotations

import pytest
import torch
from model_helpers import SHARP_INIT

from dsaflow.config.compose import compose
from dsaflow.model import LayerSpec, StageCache
from dsaflow.model.stage import build_model
from dsaflow.ops.indexer_topk import indexer_topk_naive
from dsaflow.ops.indexer_topk.triton_indexer import indexer_topk_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def int_inputs(R, N, H, D, S, g):
    """Small integers: every score is exact in fp32, ties frequent (the order rule must hold too)."""
    q = torch.randint(-2, 3, (1, N, H, D), generator=g).float()
    k = torch.randint(-1, 2, (R, S, D), generator=g).float()
    w = torch.randint(-2, 3, (1, N, H), generator=g).float()
    rows = torch.randint(0, R, (1, N), generator=g)
    positions = torch.randint(-1, S, (1, N), generator=g)
    return q, k, w, rows, positions


def per_row(q, k, w, rows, positions, topk):
    """Each query scored alone against its own key row, through the plain [B, T] op."""
    out = [
        indexer_topk_naive(q[:, n : n + 1], k[r : r + 1], w[:, n : n + 1], positions[:, n : n + 1], topk)
        for n, r in enumerate(rows[0].tolist())
    ]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("chunk", [None, 3])
def test_naive_key_rows_equal_scoring_each_row_alone(chunk):
    g = torch.Generator().manual_seed(0)
    q, k, w, rows, pos = int_inputs(R=4, N=11, H=3, D=8, S=40, g=g)
    got = indexer_topk_naive(q, k, w, pos, 6, chunk=chunk, key_rows=rows)
    assert torch.equal(got, per_row(q, k, w, rows, pos, 6))
    assert (got[0, pos[0] < 0] == -1).all()  # padding queries select nothing


@pytest.mark.parametrize("chunk", [None, 4])
def test_triton_key_rows_equal_the_naive_op(chunk):
    """The one-query logits kernel reading k[key_rows[b]] (interpreter on CPU), chunked over queries."""
    g = torch.Generator().manual_seed(1)
    q, k, w, rows, pos = (t.to(DEV) for t in int_inputs(R=3, N=9, H=4, D=16, S=150, g=g))
    want = indexer_topk_naive(q, k, w, pos, 8, key_rows=rows)
    assert torch.equal(indexer_topk_triton(q, k, w, pos, 8, chunk=chunk, key_rows=rows), want)


def test_triton_key_rows_refuse_the_tiled_kernels_overrides():
    from dsaflow.ops.indexer_topk.triton_indexer import indexer_logits_triton

    g = torch.Generator().manual_seed(2)
    q, k, w, rows, pos = int_inputs(R=2, N=3, H=2, D=16, S=20, g=g)
    with pytest.raises(ValueError, match="key_rows needs one query per batch row"):
        indexer_logits_triton(q, k, w, pos, key_rows=rows[0], overrides={"BLOCK_T": 16})


def stage_and_caches(*overrides, kv_dtype="bf16"):
    cfg = compose(["model=tiny", "model.index_topk=8", SHARP_INIT, *overrides]).model
    model = build_model(cfg, roles="FSF" + "S" * (cfg.num_layers - 3), seed=3).eval()
    specs = [LayerSpec(b.layer_index, b.role, b.source) for b in model.layers.values()]
    return model, [StageCache.allocate(cfg, specs, 4, 64, 32, kv_dtype=kv_dtype) for _ in range(2)]


@pytest.mark.parametrize("attn,kv_dtype", [("sparse", "bf16"), ("dense", "bf16"), ("sparse", "fp8")])
def test_token_major_pass_equals_the_padded_rows_pass(attn, kv_dtype):
    """Rows 0-3 first prefill prompts of different lengths; then one pass with row 0 decoding, row 1 idle, rows 2
    and 3 prefilling chunks of 5 and 9 tokens: [4, 9] right-padded against [1, 14 + 2 padding tokens]. fp8: the
    packed FP8 caches (serve.kv_dtype=fp8), written through the flat view, byte for byte as the padded pass writes."""
    model, (padded, major) = stage_and_caches(kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(4)
    lengths = [12, 7, 3, 20]
    first = torch.randint(0, 256, (4, 20), generator=g)
    pos0 = torch.tensor([[t if t < n else -1 for t in range(20)] for n in lengths])
    with torch.no_grad():
        for cache in (padded, major):
            model.forward_prefill(first, pos0, cache, attn=attn)
        # the next pass: (row, positions) of its real tokens
        segments = [(0, [12]), (2, list(range(3, 8))), (3, list(range(20, 29)))]
        toks = torch.randint(0, 256, (4, 9), generator=g)
        pos = torch.full((4, 9), -1)
        for r, ps in segments:
            pos[r, : len(ps)] = torch.tensor(ps)
        want = model.forward_prefill(toks, pos, padded, attn=attn)
        want_idx = padded.index.clone()
        flat_tok, flat_pos, flat_rows, where = [], [], [], []
        for r, ps in segments:
            for c, p in enumerate(ps):
                flat_tok.append(int(toks[r, c])), flat_pos.append(p), flat_rows.append(r), where.append((r, c))
        flat_tok += [0, 0]  # padding at the end of a static buffer
        flat_pos += [-1, -1]
        flat_rows += [0, 0]
        got = model.forward_prefill(
            torch.tensor([flat_tok]), torch.tensor([flat_pos]), major, attn=attn, token_rows=torch.tensor([flat_rows])
        )
    for n, (r, c) in enumerate(where):
        torch.testing.assert_close(got[0, n], want[r, c], rtol=1e-5, atol=1e-5)
        if attn == "sparse":
            assert torch.equal(major.index[0, n], want_idx[r, c])  # row-local indices in the slot
    for layer in padded.kv:
        torch.testing.assert_close(major.kv[layer][:, :64], padded.kv[layer][:, :64])
    for layer in padded.index_k:
        torch.testing.assert_close(major.index_k[layer][:, :64], padded.index_k[layer][:, :64])


def test_token_rows_refuse_a_prefill_hint_and_a_wrong_shape():
    model, (cache, _) = stage_and_caches()
    with pytest.raises(ValueError, match="token_rows"):
        model.forward_prefill(
            torch.zeros(1, 4, dtype=torch.long),
            torch.zeros(1, 4, dtype=torch.long),
            cache,
            token_rows=torch.zeros(1, 3),
        )
