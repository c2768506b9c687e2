"""The speculative-decoding acceptance rules (dsaflow/serve/speculation.py): greedy against a naive loop, and the
sampling rule keeping the target's distribution (a chi-square test over 20k draws on a 6-token vocabulary, which a
deliberately broken rule fails)."""

import pytest
import torch
from scipy.stats import chisquare

from dsaflow.serve.speculation import accept_greedy, accept_sampled

V, K, DRAWS = 6, 2, 20_000


def test_greedy_accepts_the_longest_matching_prefix_plus_one():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, K + 1, V, generator=g)
    best = logits.argmax(-1)
    drafts = torch.where(torch.rand(64, K, generator=g) < 0.6, best[:, :K], torch.randint(0, V, (64, K), generator=g))
    n, tokens = accept_greedy(logits, drafts)
    for r in range(64):
        want = 0
        while want < K and drafts[r, want] == best[r, want]:
            want += 1
        assert n[r] == want
        assert tokens[r, : want + 1].tolist() == [*drafts[r, :want].tolist(), best[r, want].item()]
    assert {0, 1, 2} <= set(n.tolist())  # every outcome occurs


def emitted(rule_uniform_scale: float):
    """DRAWS rows of one verify pass with fixed target p_0..p_K and draft q_0..q_{K-1} -> (first token [DRAWS],
    second tokens of the rows that emitted two or more), p."""
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(2 * torch.randn(K + 1, V, generator=g), -1)
    q = torch.softmax(2 * torch.randn(K, V, generator=g), -1)
    drafts = torch.stack([torch.multinomial(q[j], DRAWS, replacement=True, generator=g) for j in range(K)], 1)
    uniforms = torch.rand(DRAWS, K, generator=g) * rule_uniform_scale
    race = torch.empty(DRAWS, V).exponential_(generator=g)
    n, tokens = accept_sampled(p.expand(DRAWS, -1, -1), q.expand(DRAWS, -1, -1), drafts, uniforms, race)
    return tokens[:, 0], tokens[n >= 1, 1], p


def p_value(tokens, probs):
    counts = torch.bincount(tokens, minlength=V).double()
    expected = probs.double() / probs.double().sum() * counts.sum()
    return chisquare(counts.numpy(), expected.numpy()).pvalue


def test_sampling_rule_keeps_the_target_distribution():
    first, second, p = emitted(1.0)
    assert p_value(first, p[0]) > 1e-3
    assert p_value(second, p[1]) > 1e-3
    assert len(second) > DRAWS // 10  # the second position is tested on many rows


@pytest.mark.parametrize("scale", [0.0, 0.5])
def test_a_broken_rule_fails_the_same_test(scale):
    """u scaled by 0 (every draft kept) or 0.5 (accepted with min(1, 2 p / q): too often): the first token leans
    towards the draft's q_0 and the test must see it."""
    first, _, p = emitted(scale)
    assert p_value(first, p[0]) < 1e-6
