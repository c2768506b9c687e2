"""Speculative decoding with the MTP layer in plain torch (dsaflow/serve/speculative.py): greedy tokens with
K = 1..3 drafts equal plain greedy decoding (reference.generate) for a whole model (K = 1, 3), a 2-stage (K = 2)
and a 4-stage split (K = 3, cross-stage indices), on a tiny model whose MTP layer learned a few steps (so drafts
are accepted and rejected), and on Hugging Face tiny models of both families carrying an MTP layer
(tests/test_mtp_checkpoint.py); roll-back leaves the caches as a run that never saw the rejected tokens (latent KV
and indexer keys of every stage); sampled speculation keeps the model's distribution."""

import pytest
import torch

from dsaflow.config.schema import ModelConfig
from dsaflow.model import LayerSpec, StageModule, build_model, load_full_state_dict
from dsaflow.serve import reference as R
from dsaflow.serve.speculative import allocate_speculative_caches, generate_speculative
from dsaflow.train.pipeline import LMLoss

V = 16
CFG = ModelConfig(num_layers=4, mtp_layers=1, vocab_size=V, index_topk=4, dim=32, inter_dim=64)
ROLES = "FSFS"


def arithmetic(batch: int, T: int, g: torch.Generator, vocab: int = V) -> torch.Tensor:
    """Sequences t[i] = a + i b (mod vocab), a and b random per row: the next token (and the one after) follow
    from the context, so the MTP layer can learn to draft."""
    a, b = torch.randint(0, vocab, (batch, 1), generator=g), torch.randint(1, 4, (batch, 1), generator=g)
    return (a + b * torch.arange(T)) % vocab


def train_on_arithmetic(model_cfg: ModelConfig, roles: str, vocab: int = V) -> dict:
    """The whole model's state dict after 20 Adam steps on `arithmetic` sequences over `vocab` (LM + MTP loss):
    drafts that are both accepted and rejected."""
    torch.manual_seed(0)
    model = build_model(model_cfg, roles=roles, seed=0).train()
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    g, loss_fn = torch.Generator().manual_seed(0), LMLoss(0, mtp_weight=1.0)
    for _ in range(20):
        x = arithmetic(8, 16, g, vocab)
        lm = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1)
        target = torch.stack([lm, torch.full_like(lm, -100), torch.full_like(lm, -1)], dim=1)
        loss = loss_fn(model.forward_train(x, mtp_tokens=x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.state_dict()


@pytest.fixture(scope="module")
def trained():
    return train_on_arithmetic(CFG, ROLES)


SPLITS = {"single": [[0, 1, 2, 3]], "pp2": [[0, 1], [2, 3]], "pp4": [[0], [1], [2], [3]]}


def stages_of(split, state):
    spans = SPLITS[split]
    stages = {}
    for s, span in enumerate(spans):
        specs = [LayerSpec(i, ROLES[i], i if ROLES[i] == "F" else i - 1) for i in span]
        stage = StageModule(CFG, specs, s == 0, s == len(spans) - 1, receives_indices=ROLES[span[0]] == "S")
        load_full_state_dict(stage, state)
        stages[s] = stage.eval()
    return stages


def prompts_and_limits():
    g = torch.Generator().manual_seed(5)
    prompts = [row[:n].tolist() for row, n in zip(arithmetic(4, 12, g), (6, 9, 4, 12))]
    prompts.append(torch.randint(0, V, (7,), generator=g).tolist())  # no pattern: drafts get rejected
    return prompts, [12, 8, 14, 6, 10]


@pytest.mark.parametrize("split,ks", [("single", (1, 3)), ("pp2", (2,)), ("pp4", (3,))])
def test_speculative_greedy_tokens_equal_plain_greedy(trained, split, ks):
    stages = stages_of(split, trained)
    prompts, limits = prompts_and_limits()
    plain = R.allocate_caches(stages, 5, 64, 16)
    want = R.generate(stages, plain, prompts, limits)
    for k in ks:
        spec = allocate_speculative_caches(stages, 5, 64, 16)
        got, stats = generate_speculative(stages, spec, prompts, limits, k)
        assert got == want, (split, k)
        summary = stats.summary()
        assert 5 <= stats.accepted[0] < stats.passes, summary  # drafts both accepted and rejected
        assert summary["mean_accept_length"] == pytest.approx(1 + sum(summary["per_position"]))
        assert_rolled_back(plain, spec, prompts, got)


def assert_rolled_back(plain, spec, prompts, out):
    """After speculative generation the main layers' cached rows (latent KV, indexer keys) equal plain decoding's
    at every position a row fed (up to float rounding of another pass shape) and are zero beyond, where rejected
    drafts were written: the caches of a run that never saw them."""
    for s, cache in plain.items():
        for buffers, theirs in ((cache.kv, spec[s].kv), (cache.index_k, spec[s].index_k)):
            for layer, want in buffers.items():
                for r, (p, o) in enumerate(zip(prompts, out)):
                    fed = len(p) + len(o) - 1  # the last emitted token is never fed
                    got = theirs[layer][r]
                    assert torch.allclose(got[:fed], want[r, :fed], atol=1e-5), (s, layer, r)
                    assert not got[fed:-1].any(), (s, layer, r)  # the rejected positions (the trash row aside)


@pytest.mark.gpu
def test_speculative_greedy_tokens_equal_plain_greedy_on_a_gpu(trained):
    """The same identity with the CUDA kernels (fp32): verify passes of K + 1 tokens run the prefill path, plain
    decoding the decode path."""
    stages = {s: m.cuda() for s, m in stages_of("pp2", trained).items()}
    prompts, limits = prompts_and_limits()
    want = R.generate(stages, R.allocate_caches(stages, 5, 64, 16), prompts, limits)
    for k in (1, 2, 3):
        got, stats = generate_speculative(stages, allocate_speculative_caches(stages, 5, 64, 16), prompts, limits, k)
        assert got == want, k
        assert stats.accepted[0] > 0


def test_sampled_speculation_keeps_the_models_distribution():
    """temperature 1, K = 2, one prompt in 3000 rows, 3 tokens each: the first comes from the prefill, the next two
    from one verify pass (accepted drafts, a residual resample or the bonus token). Their frequencies match the
    model's own p(t1) p(t2 | t1) and the marginal of t3, computed exactly by full forwards (chi-square, cells with
    fewer than 5 expected pooled). The untrained MTP layer's q is close to the near-uniform p: most drafts are
    accepted and some rejected, so both paths of the rule run."""
    from scipy.stats import chisquare

    cfg = ModelConfig(num_layers=2, mtp_layers=1, vocab_size=8, index_topk=4, dim=32, inter_dim=64)
    model = build_model(cfg, seed=2).eval()
    with torch.no_grad():  # scale the head up: distributions far from uniform, so a wrong rule shows
        model.head.weight.mul_(40)
    prompt, B = [3, 1, 4, 1], 3000
    stages = {0: model}
    out, stats = generate_speculative(
        stages, allocate_speculative_caches(stages, B, 16, 8), [prompt] * B, [3] * B, 2, temperature=1.0, seed=0
    )
    assert 0 < stats.accepted[0] < stats.passes
    with torch.no_grad():
        p1 = torch.softmax(model.forward_train(torch.tensor([prompt]))[0, -1], -1)
        pairs = torch.tensor([[*prompt, a] for a in range(8)])
        p2 = torch.softmax(model.forward_train(pairs)[:, -1], -1)  # [t1, t2]
        triples = torch.tensor([[*prompt, a, b] for a in range(8) for b in range(8)])
        p3 = torch.softmax(model.forward_train(triples)[:, -1], -1).view(8, 8, 8)
    joint12 = (p1[:, None] * p2).double()
    marginal3 = (joint12[..., None] * p3.double()).sum((0, 1))
    seen = torch.tensor(out)
    counts12 = torch.bincount(seen[:, 0] * 8 + seen[:, 1], minlength=64).double()
    counts3 = torch.bincount(seen[:, 2], minlength=8).double()
    for counts, probs in ((counts12, joint12.flatten()), (counts3, marginal3)):
        expected = probs / probs.sum() * B
        small = expected < 5
        obs = torch.cat([counts[~small], counts[small].sum().view(1)])
        exp = torch.cat([expected[~small], expected[small].sum().view(1)])
        assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3
