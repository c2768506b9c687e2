"""Device sampling: greedy, temperature, top-p nucleus, seeded determinism, and the sampled distribution itself."""

import pytest
import torch

from dsaflow.serve.sampling import make_generator, sample_next, top_p_mask


def nucleus_reference(p, top_p):
    """Python reference: the smallest prefix of tokens by descending prob whose mass reaches top_p."""
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep, mass = set(), 0.0
    for i in order:
        keep.add(i)
        mass += p[i]
        if mass >= top_p:
            break
    return keep


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.randn(5, 50)
    assert torch.equal(sample_next(logits, 0.0, 1.0), logits.argmax(-1))
    tied = torch.zeros(2, 10)
    tied[:, 3] = tied[:, 7] = 1.0
    assert sample_next(tied, 0.0, 0.5).tolist() == [3, 3]


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.999])
def test_top_p_mask_matches_reference(top_p):
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(6, 40, generator=g) * 2, -1).double()
    mask = top_p_mask(probs, top_p)
    for row in range(6):
        assert set(mask[row].nonzero().flatten().tolist()) == nucleus_reference(probs[row].tolist(), top_p)


def test_top_p_keeps_argmax_even_for_tiny_p():
    probs = torch.softmax(torch.randn(4, 30), -1)
    mask = top_p_mask(probs, 1e-9)
    assert mask.sum(-1).tolist() == [1] * 4 and mask[torch.arange(4), probs.argmax(-1)].all()


def test_sampling_is_seeded():
    logits = torch.randn(16, 100)
    a = sample_next(logits, 1.0, 0.9, make_generator("cpu", 7))
    b = sample_next(logits, 1.0, 0.9, make_generator("cpu", 7))
    c = sample_next(logits, 1.0, 0.9, make_generator("cpu", 8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_sampled_frequencies_follow_softmax():
    """Exponential race == categorical sampling: 40k draws of one row match softmax(logits / T) within 4 sigma."""
    T, n = 0.7, 40000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    p = torch.softmax(logits / T, -1)
    draws = sample_next(logits.expand(n, -1), T, 1.0, make_generator("cpu", 0))
    freq = torch.bincount(draws, minlength=6).double() / n
    sigma = (p * (1 - p) / n).sqrt().double()
    assert ((freq - p.double()).abs() <= 4 * sigma + 1e-4).all(), (freq, p)


def test_top_p_never_samples_outside_nucleus_and_renormalises():
    n = 20000
    logits = torch.tensor([3.0, 2.5, 2.0, 0.0, -1.0])
    p = torch.softmax(logits, -1)
    keep = nucleus_reference(p.tolist(), 0.8)
    draws = sample_next(logits.expand(n, -1), 1.0, 0.8, make_generator("cpu", 3))
    assert set(draws.unique().tolist()) <= keep
    kept = torch.tensor(sorted(keep))
    q = p[kept] / p[kept].sum()
    freq = torch.bincount(draws, minlength=5)[kept].double() / n
    assert ((freq - q.double()).abs() < 4 * (q * (1 - q) / n).sqrt().double() + 1e-4).all()


def test_invalid_arguments():
    with pytest.raises(ValueError):
        sample_next(torch.randn(2, 5), -1.0, 1.0)
    with pytest.raises(ValueError):
        sample_next(torch.randn(2, 5), 1.0, 0.0)
