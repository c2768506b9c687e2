"""Context parallelism (dsaflow.model.context_parallel): the zigzag layout, and cp ranks that together give the
whole-sequence loss, indexer KL and every gradient (gloo, fp32), with the gathered keys gathered again in backward."""

from __future__ import annotations

import pytest
import torch
from cp_harness import run_cases

from dsaflow.model.context_parallel import unzigzag, zigzag_positions, zigzag_shard


def test_zigzag_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    x = torch.arange(16)
    assert zigzag_shard(x, 2, 0, dim=0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_shard(x, 2, 1, dim=0).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert zigzag_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    for cp in (1, 2, 4):
        shards = [zigzag_shard(x.view(1, 16, 1), cp, r) for r in range(cp)]
        assert torch.equal(unzigzag(shards), x.view(1, 16, 1))
        # every rank gets the same causal work: the sum of (position + 1) over its tokens
        work = {int((zigzag_positions(16, cp, r) + 1).sum()) for r in range(cp)}
        assert len(work) == 1
    with pytest.raises(ValueError, match="2 \\* cp = 6"):
        zigzag_shard(x, 3, 0, dim=0)


CASES = [("none", True), ("none", False), ("block", True)]


@pytest.fixture(scope="module")
def cp2(tmp_path_factory):
    return run_cases(2, CASES, tmp_path_factory.mktemp("cp2"))


# fp32: the shards sum the same terms as the whole sequence in another order (gradients over the gathered keys are
# all-reduced, the LM loss's sum is split over two ranks): a few ulps of each sum
RTOL = 1e-5


@pytest.mark.parametrize("i", range(len(CASES)))
def test_cp2_equals_the_whole_sequence(cp2, i):
    recompute, kl_in_backward = CASES[i]
    got = cp2[i]
    (ref_lm, ref_kl, ref_grads), (lm, kl, grads) = got["ref"], got["cp"]
    assert abs(float(lm - ref_lm)) <= RTOL * float(ref_lm), (float(lm), float(ref_lm))
    assert float(ref_kl) > 0 and abs(float(kl - ref_kl)) <= RTOL * float(ref_kl) + 1e-9, (float(kl), float(ref_kl))
    assert grads.keys() == ref_grads.keys()
    assert any(".attn.indexer." in n for n in grads)
    for n, r in ref_grads.items():
        err = float((grads[n] - r).norm() / r.norm().clamp_min(1e-12))
        assert err < RTOL, (CASES[i], n, err)


def test_the_backward_gathers_the_keys_again(cp2):
    """Forward: one gather of latent rows per layer and one of indexer keys per F layer (4 layers FSFS: 6). The
    backward does not find them kept: with the KL in the backward, each F layer's KL node saved its gathered indexer
    keys as the rank's rows and gathers them again (2); under recompute=block every block's recomputation gathers
    its keys again (6). (On CPU the reference attention keeps no key rows: it saves its gathered [T, K, D] rows.)"""
    want = {("none", True): 2, ("none", False): 0, ("block", True): 6}
    for key, got in zip(CASES, cp2):
        assert got["gathers"] == (6, want[key]), (key, got["gathers"])
        # no gathered storage outlives the forward: between forward and backward a rank holds only its own rows
        assert got["alive_after_forward"] == 0, key
