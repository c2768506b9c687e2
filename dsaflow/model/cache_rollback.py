"""Rolling a serving cache back past rejected speculative tokens (dsaflow/serve/speculative.py).

A verify pass writes the latent KV rows (and, on F layers, the indexer keys) of all K + 1 tokens it feeds, at their
positions, before any query reads them; a row then keeps only the first n + 1. The rows at the rejected positions
are never visible to a later query (key s is visible to a query at position p only when s <= p, and the next pass
writes position s again before it attends), so forgetting them is for the cache's state, not for the next tokens:
after a roll-back every buffer holds exactly what a run that never fed the rejected tokens holds, which tests check.
The index slot holds one forward's top-k and is begun afresh by every forward, so rolling back forgets its writer.
"""

from __future__ import annotations

import torch

from .cache import StageCache, cache_slots, write_rows


def roll_back_positions(cache: StageCache, first: torch.Tensor, stop: torch.Tensor, width: int) -> None:
    """Forget positions [first[r], stop[r]) of cache rows r = 0 .. B-1 (stop - first <= width; first, stop int64
    [B]) in every latent-KV and indexer-key buffer, and the index slot's writer. Branchless scatters of zeros (rows
    outside the range go to the trash row), no host sync."""
    offsets = torch.arange(width, device=first.device)
    positions = first.unsqueeze(1) + offsets
    positions = torch.where(positions < stop.unsqueeze(1), positions, -1)
    slots = cache_slots(positions, cache.max_context)
    for buffer in (*cache.kv.values(), *cache.index_k.values()):
        write_rows(buffer, slots, buffer.new_zeros(first.shape[0], width, buffer.shape[-1]))
    cache.index_slot.begin()
