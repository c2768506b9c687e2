"""`dsaflow plan` in train mode against plan.device_memory_gib (dsaflow.plan.train_fit): the last stage plans no
logits (the loss head runs in chunks), and a rank over 90 % of the device exits 2 naming its largest term."""

from __future__ import annotations

from dsaflow.cli import main
from dsaflow.config.compose import compose
from dsaflow.plan import build_plan
from dsaflow.plan import estimates as E
from dsaflow.plan.memory import ACTIVATIONS, TRANSIENT
from dsaflow.plan.train_fit import rank_train_terms

GLM_256K = ["model=glm47flash", "pipeline=pp8", "train.seq_len=262144", "train.recompute=block"]
GiB = 2**30


def test_the_last_stage_plans_its_input_and_one_chunk_of_logits_not_every_token():
    cfg = compose(GLM_256K)
    plan = build_plan(cfg)
    m, tokens = cfg.model, plan.estimates["microbatch_tokens"]
    last = plan.estimates["stages"][-1]
    layers = [plan.layers[i] for i in plan.stages[-1].layers]
    per_token = sum(E.activation_bytes_per_token(m, l.role, "block") for l in layers)
    per_token += E.rope_table_bytes_per_token(m) + m.dim * 4 + 4  # the loss head's input and log-sum-exp
    assert last["activation_bytes_per_microbatch"] == per_token * tokens
    # every token's fp32 logits alone would be tokens * vocab * 4 = 302 GiB at two 256K sequences
    assert last["train_memory_bytes"][ACTIVATIONS] < tokens * m.vocab_size * 4 / 4
    chunk = cfg.train.loss_chunk_tokens
    assert last["train_memory_bytes"][TRANSIENT] >= 2 * chunk * m.vocab_size * 4  # one chunk's logits at least


def test_a_layout_over_the_device_exits_2_after_the_table_naming_the_largest_term(capsys):
    assert main(["plan", *GLM_256K]) == 2
    out, err = capsys.readouterr()
    assert "training memory per stage" in out  # the numbers first
    assert "plan.device_memory_gib=140.4" in err and "The largest term is activations" in err
    assert "rank 0 (stage 0)" in err and "Traceback" not in err
    # the rank named is the one with the largest peak, and its largest term is the one named
    ranks = rank_train_terms(build_plan(compose(GLM_256K)))
    rank, _, terms = max(ranks, key=lambda r: sum(r[2].values()))
    assert rank == 0 and max(terms, key=terms.get) == ACTIVATIONS
    assert f"{sum(terms.values()) / GiB:.1f} GiB" in err


def test_a_larger_device_or_a_shorter_sequence_fits(capsys):
    short = ["model=glm47flash", "pipeline=pp8", "train.seq_len=32768", "train.recompute=block", "train.batch_size=8"]
    assert main(["plan", *short]) == 0
    assert main(["plan", *short, "plan.device_memory_gib=79.6"]) == 2  # an H100: 94.7 GiB on stage 0 is too much
    assert "plan.device_memory_gib=79.6" in capsys.readouterr().err


# parallel.cp: a V3.2-attention stage split at 256K tokens, one sequence per step (GPipe, one microbatch)
CP_BASE = [
    "model=dsv32",
    "model.moe=null",
    "model.inter_dim=2048",
    "index=every4",
    "pipeline=pp4",
    "pipeline.schedule=GPipe",
    "pipeline.microbatches=1",
    "train.batch_size=1",
    "train.seq_len=262144",
    "model.max_seq_len=262144",
    "train.recompute=block",
]


def test_cp_halves_each_ranks_activations_and_counts_the_keys_it_gathers():
    one, two = (build_plan(compose(CP_BASE + [f"parallel.cp={cp}"])) for cp in (1, 2))
    m = compose(CP_BASE).model
    assert two.estimates["microbatch_tokens"] * 2 == one.estimates["microbatch_tokens"] == 262144
    for s1, s2 in zip(one.estimates["stages"], two.estimates["stages"]):
        assert s2["activation_bytes_per_microbatch"] * 2 == s1["activation_bytes_per_microbatch"]
        roles = [two.layers[i].role for i in two.stages[s2["index"]].layers]
        # each layer: the other rank's half of the latent rows (and indexer keys on F), gathered, gathered again in
        # backward and reduce-scattered, in bf16
        want = [3 * 131072 * (576 + (128 if r == "F" else 0)) * 2 for r in roles]
        assert s2["cp_comm_bytes_per_layer"] == want
        assert s1["cp_comm_bytes_per_layer"] == [0] * len(roles)
    # the transient adds every rank's keys: latent + indexer key of 262144 tokens, (3 x bf16 + fp32) each
    gathered = E.cp_gathered_key_bytes(m, "F", 262144)
    assert gathered == 262144 * (576 + 128) * 10
    terms = train_memory_terms_of(two, 0)
    assert terms[TRANSIENT] >= gathered


def train_memory_terms_of(plan, stage: int) -> dict:
    return plan.estimates["stages"][stage]["train_memory_bytes"]


def test_256k_fits_16_h200s_with_cp_and_not_4_without(capsys):
    assert main(["plan", *CP_BASE, "parallel.cp=4"]) == 0
    assert "context parallel: cp 4 ranks per sequence" in capsys.readouterr().out
    assert main(["plan", *CP_BASE]) == 2
    err = capsys.readouterr().err
    assert "The largest term is activations" in err and "parallel.cp" in err
