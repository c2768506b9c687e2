"""The FP8 KV cache (serve.kv_dtype=fp8) on CPU: its rounding, its kernels in the Triton interpreter, the model and the
engine over it, the planner's bytes.

The rounding (dsaflow.ops.kv_fp8.naive). Each block of 128 latent values (or the whole latent when narrower) gets the
fp32 scale s = amax x (1 / 448), and a value x is stored as e4m3 round-to-nearest-even(x / s). e4m3 keeps 3 mantissa
bits, so a normal value (|x / s| >= 2^-6) is off by at most half a unit in its last place, 2^-4 |x|; a subnormal one
is a multiple of 2^-9 s, off by at most 2^-10 s. The RoPE part is bf16 (8 significant bits): off by at most 2^-8 |x|. The block's
largest value is stored as exactly +-448 (its scale divides it back to 448 up to one fp32 rounding).

The model. An FP8 cache changes nothing but the cached values: a stage serving over it gives the logits of a stage
whose fp32 cache holds the rounded rows (checked up to fp32 reordering). Greedy tokens on a trained model are checked
as tests/test_fp8_serve.py checks FP8 weights: where FP8 KV first picks another token, the bf16-KV logits of that
context must have a near-tie (top-2 margin within twice the largest logit change), and a typical position's logits
move by less than one e4m3 rounding, 2^-4 of their norm.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import planned_sharp, tokens
from test_dense_prefill import _prefill_then_decode
from test_fp8_serve import assert_greedy_follows, passage_prompts
from test_serve_pipelined import MODEL, SERVE, shared_checkpoint

import dsaflow.model.mla as mla_module
from dsaflow.cli import main
from dsaflow.config.compose import compose
from dsaflow.config.kv_cache_format import Fp8RowFormat, index_key_format, latent_format
from dsaflow.ops.indexer_topk import indexer_topk_naive
from dsaflow.ops.indexer_topk.triton_indexer import indexer_topk_triton
from dsaflow.ops.kv_fp8 import dequantize_fp8_rows, quantize_fp8_rows, unpack_fp8_rows, write_fp8_rows
from dsaflow.ops.kv_fp8.triton_write import write_fp8_rows_triton
from dsaflow.ops.sparse_mla import sparse_mla_naive
from dsaflow.ops.sparse_mla.triton_prefill import launch_sparse_mla_fwd
from dsaflow.pipeline.stages import build_stages, stage_cache
from dsaflow.plan import build_plan
from dsaflow.plan.serve_memory import kv_bytes_per_token
from dsaflow.serve import reference
from dsaflow.serve.generate import build_engine, build_stage_modules

POISON = 0x7F  # an e4m3 NaN byte: an unwritten cache byte or output shows up


def wide_rows(B, T, fmt, seed=0):
    """[B, T, width + rope] fp32 values over six decades (normal and subnormal e4m3 after scaling), a block of zeros
    and a negative zero."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(B, T, fmt.width + fmt.rope, generator=g) * torch.logspace(-4, 2, fmt.width + fmt.rope)
    rows[0, 0, : fmt.block] = 0.0
    rows[-1, -1, 3] = -0.0
    return rows


def test_rounding_matches_its_specification_and_bound():
    fmt = Fp8RowFormat(256, 128, 64)
    assert fmt.nbytes == 256 + 2 * 4 + 64 * 2
    x = wide_rows(3, 5, fmt)
    packed = quantize_fp8_rows(x, fmt)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, fmt.nbytes)
    values, scales, rope = unpack_fp8_rows(packed, fmt)
    blocks = x[..., :256].reshape(3, 5, 2, 128)
    amax = blocks.abs().amax(-1)
    assert torch.equal(scales, torch.where(amax > 0, amax * (1.0 / 448.0), torch.ones_like(amax)))
    assert scales[0, 0, 0] == 1.0 and (values[0, 0, :128].float() == 0).all()
    big = values.float().reshape(3, 5, 2, 128).abs().amax(-1)
    assert torch.equal(big[amax > 0], torch.full_like(big[amax > 0], 448.0))
    back = dequantize_fp8_rows(packed, fmt)
    s = scales.repeat_interleave(128, dim=-1)
    err = (back[..., :256] - x[..., :256]).abs()
    assert (err <= torch.maximum(x[..., :256].abs() * 2.0**-4, s * 2.0**-10)).all()
    assert (err > 0).any() and ((x[..., :256] / s).abs() < 2.0**-6).any(), "rounding and subnormals must occur"
    assert ((back[..., 256:] - x[..., 256:]).abs() <= x[..., 256:].abs() * 2.0**-8).all()
    assert torch.equal(rope, x[..., 256:].to(torch.bfloat16))
    exact = torch.tensor([448.0, -224.0, 1.0, 0.5, 0.0, -(2.0**-9), 2.0**-6, 3 * 2.0**-9])  # e4m3 values, scale 1
    f = Fp8RowFormat(8, 8)
    assert torch.equal(dequantize_fp8_rows(quantize_fp8_rows(exact, f), f), exact)


def test_formats_of_deepseek_v32():
    cfg = compose(["model=dsv32"])
    assert latent_format(cfg.model).nbytes == 656 and index_key_format(cfg.model).nbytes == 132


def every_e4m3_and_its_ties() -> torch.Tensor:
    """One row of 1024 values, scale exactly 1 (the row holds 448): every finite e4m3 value, the midpoint after
    each (a tie: round to the even code), values a hair either side of it, both signs."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448, ascending
    mids = (codes[:-1] + codes[1:]) / 2
    out = torch.cat([codes, mids, mids * (1 + 2.0**-20), mids * (1 - 2.0**-20)])
    out = torch.cat([out, -out])
    return torch.nn.functional.pad(out, (0, 1024 - out.numel()), value=448.0)


def test_write_kernel_is_bit_identical_to_the_reference():
    """The Triton write (interpreter) against torch's conversion: every e4m3 value and tie, then ragged writes
    into a poisoned buffer: written slots equal the reference, every other byte keeps its poison."""
    f = Fp8RowFormat(1024, 1024)
    row = every_e4m3_and_its_ties().view(1, 1, -1)
    slot = torch.zeros(1, 1, 1, dtype=torch.long)
    buf = torch.full((1, 1, f.nbytes), POISON, dtype=torch.uint8)
    assert torch.equal(write_fp8_rows_triton(buf, slot, row, f), quantize_fp8_rows(row, f))

    fmt = Fp8RowFormat(256, 128, 32)
    x = wide_rows(2, 5, fmt, seed=1)
    g = torch.Generator().manual_seed(2)
    S = 11
    slots = torch.stack([torch.randperm(S, generator=g)[:5] for _ in range(2)]).unsqueeze(-1)
    slots[1, 4] = slots[1, 3]  # a padding query writes its row's trash slot: the last write of one slot wins
    x[1, 4] = x[1, 3]
    ref = torch.full((3, S, fmt.nbytes), POISON, dtype=torch.uint8)
    got = ref.clone()
    write_fp8_rows(ref, slots, x, fmt)  # CPU: the reference
    write_fp8_rows_triton(got, slots, x, fmt)
    assert torch.equal(got, ref)
    written = torch.zeros(3, S, dtype=torch.bool)
    written[torch.arange(2).view(2, 1), slots[..., 0]] = True
    assert (got[~written] == POISON).all()


def ragged_indices(B, T, K, lengths, g):
    """[B, T, K] int32: query (b, t) selects distinct keys below lengths[b], -1 after (a row shorter than K)."""
    idx = torch.full((B, T, K), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(T):
            n = min(K, lengths[b])
            idx[b, t, :n] = torch.randperm(lengths[b], generator=g)[:n].sort().values.int()
    return idx


@pytest.mark.parametrize("num_splits", [1, 2])
def test_sparse_mla_kernel_reads_the_fp8_cache(num_splits):
    """The forward kernel (interpreter, fp32 queries) over a packed cache equals the reference over the dequantized
    rows, ragged lengths (one row with no key at all), outputs poisoned before the launch."""
    B, T, H, C, R, S, K = 3, 2, 4, 64, 16, 40, 24
    fmt = Fp8RowFormat(C, C, R)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, T, H, C + R, generator=g)
    packed = quantize_fp8_rows(torch.randn(B, S, C + R, generator=g) * 3, fmt)
    idx = ragged_indices(B, T, K, [S, 9, 0], g)
    ref_out, ref_lse = sparse_mla_naive(q, dequantize_fp8_rows(packed, fmt), idx, 0.1, C)
    assert torch.equal(sparse_mla_naive(q, packed, idx, 0.1, C)[0], ref_out)  # the reference reads it too
    shape = (num_splits, B, T, H) if num_splits > 1 else (B, T, H)
    out, lse = torch.full((*shape, C), float("nan")), torch.full(shape, float("nan"))
    launch_sparse_mla_fwd(q, packed, idx, 0.1, C, out, lse, num_splits)
    if num_splits > 1:  # the combine: softmax-weighted partials
        w = torch.softmax(torch.nan_to_num(lse, neginf=-1e30), dim=0)
        out, lse = (w.unsqueeze(-1) * torch.nan_to_num(out)).sum(0), torch.logsumexp(lse, dim=0)
    assert not out.isnan().any()
    assert torch.allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    assert torch.allclose(lse[:2], ref_lse[:2], atol=1e-5) and torch.isinf(lse[2]).all()


def test_indexer_reads_fp8_keys():
    """Triton top-k (interpreter) over packed keys equals the reference scoring the dequantized keys: the tiled
    kernel (T > 1), the one-query kernel (T == 1), and a token-major pass (key_rows)."""
    B, T, H, D, S, K = 2, 3, 4, 32, 70, 16
    fmt = Fp8RowFormat(D, D)
    g = torch.Generator().manual_seed(4)
    q, w = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, H, generator=g)
    packed = quantize_fp8_rows(torch.randn(B, S, D, generator=g), fmt)
    pos = torch.tensor([[5, 40, 69], [0, -1, 30]])
    want = indexer_topk_naive(q, dequantize_fp8_rows(packed, fmt), w, pos, K)
    assert torch.equal(indexer_topk_naive(q, packed, w, pos, K), want)
    assert torch.equal(indexer_topk_triton(q, packed, w, pos, K), want)
    assert torch.equal(indexer_topk_triton(q[:, :1], packed, w[:, :1], pos[:, :1], K), want[:, :1])
    rows = torch.tensor([[1, 0, 1]])
    got = indexer_topk_triton(q[:1], packed, w[:1], pos[1:], K, key_rows=rows)
    assert torch.equal(got, indexer_topk_naive(q[:1], packed, w[:1], pos[1:], K, key_rows=rows))


def rounded_rows_writer(real):
    """mla.write_cache_rows for an fp32 cache that stores each row as the FP8 cache would hold it."""

    def write(buffer, slots, rows, fmt):
        return real(buffer, slots, dequantize_fp8_rows(quantize_fp8_rows(rows, fmt), fmt), fmt)

    return write


def test_an_fp8_cache_changes_only_the_cached_values(monkeypatch):
    """Prefill then decode over an FP8 cache gives, at every step, the logits of the same stages over an fp32 cache
    holding the rounded rows; and those differ from the unrounded fp32 cache's (the rounding is real)."""
    cfg, plan = planned_sharp("FS|SF", "model.num_layers=4", "model.index_topk=6")
    stages = dict(enumerate(build_stages(cfg, plan)))
    prompt, steps = tokens(2, 12, seed=5), tokens(2, 3, seed=6)

    def run(kv_dtype):
        caches = reference.allocate_caches(stages, 2, 16, 12, kv_dtype)
        out = [reference.forward(stages, caches, prompt, torch.arange(12).expand(2, 12))[:, -1]]
        for i in range(3):
            out.append(reference.decode_one_token(stages, caches, steps[:, i], torch.full((2,), 12 + i)))
        return torch.stack(out)

    with torch.no_grad():
        fp8, exact = run("fp8"), run("bf16")
        monkeypatch.setattr(mla_module, "write_cache_rows", rounded_rows_writer(mla_module.write_cache_rows))
        rounded = run("bf16")
    assert torch.allclose(fp8, rounded, atol=1e-5 * rounded.abs().max().item(), rtol=0)
    assert (fp8 - exact).abs().max() > 1e-3 * exact.abs().max()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The briefly trained tiny model the serving tests share (tests/test_serve_pipelined.py)."""
    return shared_checkpoint(tmp_path_factory)


# Per generated position, ||fp8-KV logits - bf16-KV logits|| / ||bf16-KV logits|| for the median position. The FP8
# cache moves each cached latent and key value by at most 2^-4 of itself (3 mantissa bits) and nothing else: the
# attention output is a convex mix of rounded values, and the residual stream carries each layer's input unchanged
# beside it, so a typical position's logits move by less than one rounding. The median leaves out the positions
# where a rounding flips the indexer's top-k choice, which depends on the weights, not on the arithmetic. A wrong
# scale, block or layout moves them by 1 or more.
FP8_KV_MEDIAN_RELATIVE_LOGIT_ERROR = 2.0**-4


def serve_cfg(run, kv_dtype, pipeline="single"):
    return compose(["mode=serve", f"pipeline={pipeline}", *MODEL, *SERVE, f"serve.checkpoint={run}",
                    f"serve.kv_dtype={kv_dtype}"])  # fmt: skip


def engine_greedy(run, kv_dtype, prompts, limits, pipeline="single"):
    cfg = serve_cfg(run, kv_dtype, pipeline)
    eng = build_engine(cfg, build_plan(cfg), 0, "cpu", all_stages=True)
    eng.capture()
    return eng.generate(prompts, limits)


def context_logits(stages, kv_dtype, seen):
    """fp32 logits [T, vocab] of every position of `seen` [1, T] through caches of kv_dtype (one prefill pass)."""
    caches = reference.allocate_caches(stages, 1, seen.shape[1] + 1, seen.shape[1], kv_dtype)
    return reference.forward(stages, caches, seen, torch.arange(seen.shape[1]).view(1, -1))[0]


def test_greedy_tokens_with_an_fp8_cache_follow_bf16(trained):
    """8 prompts, 8 new tokens each, served by the engine (one stage, and pp2 in one process) with an FP8 cache and
    with the serve dtype's cache. pp2 gives the single stage's tokens. Where FP8 first picks another token (same
    context before it), the exact-cache logits la and the FP8-cache logits lb of that context must have a near-tie,
    la[a] - la[b] <= 2 max|la - lb| (+ REORDER_SLACK for the engine's order); elsewhere the tokens agree."""
    prompts = passage_prompts(8, seed=2)
    limits = [8] * len(prompts)
    exact, fp8 = engine_greedy(trained, "bf16", prompts, limits), engine_greedy(trained, "fp8", prompts, limits)
    assert engine_greedy(trained, "fp8", prompts[:3], limits[:3], "pp2") == fp8[:3]
    cfg = serve_cfg(trained, "bf16")
    stages = build_stage_modules(cfg, build_plan(cfg), None, "cpu", torch.float32)

    def logits(seen: torch.Tensor, start: int):
        return context_logits(stages, "bf16", seen)[start:-1], context_logits(stages, "fp8", seen)[start:-1]

    assert_greedy_follows(prompts, exact, fp8, logits, FP8_KV_MEDIAN_RELATIVE_LOGIT_ERROR, "FP8 KV cache")


def test_planner_counts_the_bytes_the_cache_allocates():
    """KV bytes per token in the plan == the bytes StageCache.allocate holds per position, for both kv dtypes; the
    FP8 cache of V3.2 pp8 holds at least 1.7x the tokens of the bf16 one on every stage."""
    for kv in ("bf16", "fp8"):
        cfg = compose(["mode=serve", "model=tiny", f"serve.kv_dtype={kv}", "layout=FSFS|SSFS"])
        plan = build_plan(cfg)
        for st in plan.stages:
            stage = reference.allocate_caches({0: build_stages(cfg.model, plan)[st.index]}, 2, 7, 4, kv)[0]
            held = sum(t[0, 0].numel() * t.element_size() for t in (*stage.kv.values(), *stage.index_k.values()))
            roles = [plan.layer(i).role for i in st.layers]
            assert kv_bytes_per_token(cfg.model, roles, 4, kv) == held  # CPU stages: an fp32 bf16-kind cache
    fit = {}
    for kv in ("bf16", "fp8"):
        cfg = compose(["mode=serve", "model=dsv32", "pipeline=pp8", "serve.weights=fp8", f"serve.kv_dtype={kv}"])
        fit[kv] = [se["serve_kv_tokens_fit"] for se in build_plan(cfg).estimates["stages"]]
    assert all(b >= 1.7 * a for a, b in zip(fit["bf16"], fit["fp8"])), fit


def test_a_model_the_packed_rows_cannot_hold_exits_2(capsys):
    assert main(["plan", "mode=serve", "model.kv_lora_rank=30", "serve.kv_dtype=fp8"]) == 2
    err = capsys.readouterr().err
    assert "serve.kv_dtype=fp8" in err and "model.kv_lora_rank=30" in err and "serve.kv_dtype=bf16" in err


def test_a_plan_short_of_kv_room_offers_the_fp8_cache(capsys):
    v32 = ["mode=serve", "model=dsv32", "pipeline=pp8", "serve.weights=fp8", "serve.max_batch=64"]
    assert main(["plan", *v32, "serve.max_context=131072"]) == 2
    err = capsys.readouterr().err
    assert "serve.kv_dtype=fp8 (788 instead of 1,408 cache bytes per token of an F layer)" in err
    assert main(["plan", *v32, "serve.max_context=65536", "serve.kv_dtype=fp8"]) == 0  # 64 x 64K: over 3.6M in bf16
    assert "KV B/tok" in capsys.readouterr().out


@torch.no_grad()
def test_short_prefill_paths_read_the_fp8_cache_like_the_sparse_path():
    """tests/test_dense_prefill.py's prefill (one chunk of 21 tokens, top-k 2: 2 dense columns, 12 masked in blocks
    of 4, 7 sparse) then decode over poisoned FP8 caches: the short paths (which dequantize the rows they
    up-project) give the sparse path's logits, both over the same rounded rows (fp32 arithmetic in another order)."""
    topk, max_keys, chunk = 2, 16, 21
    model, plan = planned_sharp(
        "FSSS|FSS", "model.num_layers=7", f"model.index_topk={topk}", "pipeline.cross_stage_indices=true"
    )
    stages = build_stages(model, plan, seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [21, 13]
    seqs = [torch.randint(0, 256, (P + 3,), generator=g) for P in prompts]

    def caches():
        out = [stage_cache(model, plan, i, 3, 32, chunk, "cpu", torch.float32, "fp8") for i in range(plan.num_stages)]
        for c in out:
            for t in (*c.kv.values(), *c.index_k.values()):
                t.fill_(POISON)
        return out

    ref = _prefill_then_decode(stages, caches(), seqs, prompts, chunk, False, topk, max_keys)
    got = _prefill_then_decode(stages, caches(), seqs, prompts, chunk, True, topk, max_keys)
    assert {p for p, *_ in got} - {"decode", "sparse"} == {"split"}
    for (path, a, _), (_, b, _) in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=path)
