"""The training memory estimate (dsaflow.plan.memory): a hand count for tiny shapes, the plan table and the
pre-launch check that refuses on it; on a GPU, the estimate against the measured peak of real steps."""

import pytest
import torch
from script_helpers import load_script

from dsaflow.config.compose import compose
from dsaflow.errors import ResourceError
from dsaflow.launch import resources
from dsaflow.plan import build_plan
from dsaflow.plan import estimates as E
from dsaflow.plan.memory import ACTIVATIONS, GRADS, TRANSIENT, WEIGHTS, train_memory_terms
from dsaflow.plan.render import render_table

# model=tiny: dim 64, inter 128, 4 heads, q_lora 32, kv_lora 32, nope 16, rope 8, v 16, indexer 4 x 16 (rope 8),
# topk 16, vocab 256. Layers "FS", one stage, 4 sequences of 128 tokens in one microbatch: 512 tokens.
TINY = [
    "model=tiny",
    "model.num_layers=2",
    "index=every2",
    "train.seq_len=128",
    "train.batch_size=4",
    "pipeline.microbatches=1",
]
TOKENS = 512
# Bytes per token of one layer under bf16 autocast, counted by hand from what autograd saves:
# S, none: fp32 block input + MLP-norm input 2*64*4 = 512; the four bf16 casts of the normed inputs 4*64*2 = 512;
#   q path (2*32 + 4*(16+8))*2 = 320; kv path 2*(32+8)*2 = 160; up-projected output 4*16*2 = 128; MLP 4*128*2 =
#   1024; absorbed query + attention output (4*40 + 4*32)*2 = 576; lse 4*4 = 16           -> 3248
# F adds: two more casts 2*64*2 = 256; indexer q 4*16*2 = 128, k 16*2 = 32, weights 4*2 = 8, fp32 LayerNorm input
#   16*4 = 64; indices int32 + target fp32 16*(4+4) = 128                                  -> 616
# attention drops the absorbed query, the attention output and lse: 576 + 16 = 592.
# block keeps the fp32 input 64*4 = 256, and on F the indices and target 128.
# Per stage: RoPE tables (8+8)*4 = 64; the loss head in chunks: its fp32 input 64*4 = 256 and one fp32
# log-sum-exp 4 (no logits).
PER_TOKEN = {"none": 3864 + 3248, "attention": 3272 + 2656, "block": 384 + 256}
STAGE_PER_TOKEN = 64 + 256 + 4
# The loss head's chunk (all 512 tokens: train.loss_chunk_tokens is 2048): forward fp32 logits and exponentials
# 2*512*256*4 = 1048576 + the head weight's bf16 copy 256*64*2 = 32768; backward logits, their bf16 cast and the
# head's gradient sum, product and cast 512*256*6 + 256*64*(4+2+4) + 32768 = 983040.
HEAD_TRANSIENT = 1048576 + 32768
# Backward transients: the attention gradients 2*4*(16+32+40) + 40*(4+2) = 944 per query; the attention
# backward's G buffer 512*2*4*16*2 = 131072.
TRANSIENT_BYTES = {
    "none": TOKENS * 944 + 131072,
    # one chunk (all 512 queries) rebuilt: (576 + 16) per query, plus the gradients
    "attention": TOKENS * (592 + 944) + 131072,
    # the F layer rebuilt whole (3864 - 384 kept), or without its MLP part (64*4 + 2*64*2 + 4*128*2 = 1536) plus
    # the attention gradients: max(512*3480, 512*1944 + 614400)
    "block": max(TOKENS * 3480, TOKENS * 1944 + TOKENS * 944 + 131072),
}


@pytest.mark.parametrize("mode", ["none", "attention", "block"])
def test_the_estimate_matches_a_hand_count(mode):
    cfg = compose(TINY + [f"train.recompute={mode}"])
    m = cfg.model
    assert (m.dim, m.inter_dim, m.n_heads, m.index_topk, m.vocab_size) == (64, 128, 4, 16, 256)
    terms = train_memory_terms(cfg, ["F", "S"], True, True, TOKENS, 1, 1, "cuda")
    params = E.layer_params(m, "F") + E.layer_params(m, "S") + E.embed_params(m) + E.head_params(m)
    assert terms[WEIGHTS] == 12 * params + 2 * (params - E.embed_params(m))  # + bf16 copies of matmul weights
    assert terms[GRADS] == 4 * (E.layer_params(m, "F") + E.head_params(m))  # one microbatch: no backward done yet
    assert terms[ACTIVATIONS] == (PER_TOKEN[mode] + STAGE_PER_TOKEN) * TOKENS
    assert terms[TRANSIENT] == max(TRANSIENT_BYTES[mode], HEAD_TRANSIENT)  # the last stage: the larger of the two
    middle = train_memory_terms(cfg, ["F", "S"], False, False, TOKENS, 1, 1, "cuda")
    assert middle[TRANSIENT] == TRANSIENT_BYTES[mode]
    se = build_plan(cfg).estimates["stages"][0]
    assert se["train_memory_bytes"] == terms and se["train_peak_bytes"] == sum(terms.values())


def test_microbatches_in_flight_multiply_the_activations_and_keep_every_gradient():
    cfg = compose(TINY[:-1] + ["pipeline.microbatches=4", "train.recompute=block"])
    one = train_memory_terms(cfg, ["F", "S"], True, True, TOKENS // 4, 1, 4, "cuda")
    three = train_memory_terms(cfg, ["F", "S"], True, True, TOKENS // 4, 3, 4, "cuda")
    assert three[ACTIVATIONS] == 3 * one[ACTIVATIONS]
    params = sum(E.layer_params(cfg.model, r) for r in "FS") + E.embed_params(cfg.model) + E.head_params(cfg.model)
    assert one[GRADS] == three[GRADS] == 4 * params  # 4 microbatches > in flight: a backward ran before the peak


def test_the_plan_table_prints_the_memory_terms():
    cfg = compose(TINY + ["train.recompute=block"])
    plan = build_plan(cfg)
    text = render_table(plan, cfg, width=100)
    peak = plan.estimates["stages"][0]["train_peak_bytes"] / 2**30
    assert "training memory per stage" in text and f"{peak:.1f}" in text


LONG = [
    "model=dsv32",
    "model.vocab_size=256",
    "model.inter_dim=2048",
    "model.moe=null",
    "model.num_layers=8",
    "index=every4",
    "train.batch_size=1",
    "pipeline.microbatches=1",
]


def _h200(monkeypatch):
    monkeypatch.setattr(resources, "available_memory", lambda device, ranks: (139.8 * 2**30, "an H200"))


def test_the_prelaunch_check_refuses_with_the_largest_term_and_the_fix(monkeypatch):
    _h200(monkeypatch)
    seq = ["train.seq_len=65536", "model.max_seq_len=65536"]
    cfg = compose(LONG + seq + ["train.recompute=attention"])
    with pytest.raises(ResourceError) as err:
        resources.check_resources(cfg, build_plan(cfg), "cuda")
    msg = str(err.value)
    assert "largest consumer is activations" in msg and "train.recompute=block" in msg and "pipeline.stages" in msg
    ok = compose(LONG + seq + ["train.recompute=block"])
    resources.check_resources(ok, build_plan(ok), "cuda")


def test_eight_layers_at_128k_fit_an_h200_only_with_block_recompute(monkeypatch):
    _h200(monkeypatch)
    seq = ["train.seq_len=131072", "model.max_seq_len=131072"]
    peaks = {}
    for mode in ("none", "attention", "block"):
        cfg = compose(LONG + seq + [f"train.recompute={mode}"])
        peaks[mode] = sum(resources.rank_memory(cfg, build_plan(cfg), 0, "cuda", "train").values())
    assert peaks["block"] < 135 * 2**30 < peaks["attention"] < peaks["none"]


# The GPU check: real steps of the bench (the trainer's step for one microbatch) against the plan's estimate.
# Rows chosen to run in about a minute on one H200 (each builds 8 layers of V3.2 attention shapes).
GPU_ROWS = [(16384, "none"), (16384, "attention"), (16384, "block"), (32768, "block")]


@pytest.fixture(scope="module")
def bench_stage():
    bench = load_script("benches.train_stage")
    stage, opts = bench.build(8, "every4")
    yield bench, stage, opts
    del stage, opts
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("seq,mode", GPU_ROWS)
def test_gpu_estimate_within_15_percent_of_the_measured_peak(bench_stage, seq, mode):
    bench, stage, opts = bench_stage
    row = bench.measure(stage, opts, 8, "every4", seq, mode, reps=1)
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    if "out of memory" in row.get("error", "") and row["estimate_gib"] > 0.9 * total_gib:
        pytest.skip(f"the plan estimates {row['estimate_gib']:.1f} GiB, beyond this {total_gib:.0f} GiB GPU")
    assert "error" not in row, row
    assert abs(row["estimate_error"]) <= 0.15, row


def test_the_bench_table_records_out_of_memory_rows():
    """CPU: the bench's markdown from rows as `measure` returns them, one of them out of memory."""
    bench = load_script("benches.train_stage")
    rows = [
        {
            "seq": 16384,
            "layers": 8,
            "recompute": "block",
            "step_s": 1.5,
            "tokens_per_s": 10923.0,
            "tflops": 300.0,
            "mfu": 0.3033,
            "moe_experts": 16,
            "peak_gib": 40.0,
            "estimate_gib": 42.0,
            "estimate_error": 0.05,
        },
        {"seq": 131072, "layers": 8, "recompute": "none", "estimate_gib": 574.4, "error": "out of memory: ..."},
    ]
    text = bench.markdown(rows, "an H200")
    assert "| 16 | 16K | block | 1.50 s | 10,923 | 300 | 30.3 % | 40.0 GiB | 42.0 GiB | +5.0 % |" in text
    assert "| dense | 128K | none | out of memory | | | | | 574.4 GiB | |" in text
