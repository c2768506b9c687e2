"""Context parallelism for sparse attention (training): each of `size` ranks holds a zigzag shard of every sequence
and gathers only the compact keys.

Sharding: a sequence of T tokens is cut into 2*cp chunks of T / (2 cp); rank r holds chunks r and 2cp-1-r, in that
order (`zigzag_shard`), so every rank gets the same causal work (an early chunk's few keys plus a late one's many).
Positions stay global (`ContextParallel.positions`): RoPE and causality see the true token positions.

Keys: per layer, the latent rows [B, T/cp, C + R] (and on F layers the indexer keys [B, T/cp, D_I]) are all-gathered
over the cp group into global order ([B, T, ...], key s = the token at position s), so the indexer's causal test
`s <= position` and the attention's key indices are global. Queries and the hidden state stay sharded; each rank
scores its own queries against every key and takes its own top-k. S layers reuse their source's indices (global key
indices): nothing is gathered for them but the latent rows.

Backward: `_GatherKeys` reduce-scatters the keys' gradient (each rank gets the sum over ranks of the gradient of its
own rows). The gathered keys are not kept for the backward: `keys_regathered` packs every tensor that autograd saves
from the gathered storage as the rank's own shard, and the backward gathers it again when it needs it, so what a
rank keeps per layer is its 1/cp share. Under `train.recompute=block` the block's recomputation gathers again by
itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, List

import torch


def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2*cp) rank `rank` holds."""
    return rank, 2 * cp - 1 - rank


def zigzag_shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s shard of x along `dim` (length T, divisible by 2*cp): chunks r and 2cp-1-r concatenated,
    [.., T / cp, ..]. cp == 1: x itself."""
    if cp == 1:
        return x
    if x.shape[dim] % (2 * cp):
        raise ValueError(f"length {x.shape[dim]} does not split into 2 * cp = {2 * cp} chunks")
    chunks = x.chunk(2 * cp, dim=dim)
    a, b = zigzag_chunks(cp, rank)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def zigzag_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """int64 [seq_len / cp]: the global positions of rank `rank`'s tokens."""
    return zigzag_shard(torch.arange(seq_len, device=device), cp, rank, dim=0)


def unzigzag(shards: List[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Every rank's shard (in rank order) -> the whole sequence in global order along `dim`."""
    cp = len(shards)
    halves = [s.chunk(2, dim=dim) for s in shards]
    order = [halves[c][0] if c < cp else halves[2 * cp - 1 - c][1] for c in range(2 * cp)]
    return torch.cat(order, dim=dim)


@dataclass
class ContextParallel:
    """This rank's place in its cp group: its rank in it, the group's size, and `comm`, the collectives over it
    (the model knows nothing of torch.distributed: dsaflow.train.cp_comm.GroupComm implements them):
      comm.all_gather(local) -> every rank's tensor, in rank order;
      comm.reduce_scatter(parts) -> the sum over ranks of parts[this rank] (parts: one tensor per rank)."""

    rank: int
    size: int
    comm: Any

    def positions(self, batch: int, local_len: int, device) -> torch.Tensor:
        """int64 [batch, local_len]: the global positions of this rank's tokens of sequences of size*local_len."""
        return zigzag_positions(local_len * self.size, self.size, self.rank, device).expand(batch, local_len)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """local [B, t, D] (this rank's rows) -> [B, t * size, D] every rank's rows in global order. Differentiable:
        the backward reduce-scatters the gradient."""
        return _GatherKeys.apply(local, self)

    def gather_values(self, local: torch.Tensor) -> torch.Tensor:
        """`gather` without autograd (what the backward's re-gather runs)."""
        return unzigzag(self.comm.all_gather(local.contiguous()), dim=1)

    def scatter_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """grad [B, T, D] of the gathered rows -> [B, T / size, D]: the sum over ranks of this rank's rows."""
        return self.comm.reduce_scatter([zigzag_shard(grad, self.size, r).contiguous() for r in range(self.size)])


class _GatherKeys(torch.autograd.Function):
    """All-gather of key rows over the cp group; backward: reduce-scatter of their gradient. Saves nothing."""

    @staticmethod
    def forward(ctx, local, cp: ContextParallel):
        ctx.cp = cp
        return cp.gather_values(local)

    @staticmethod
    def backward(ctx, grad):
        return ctx.cp.scatter_grad(grad), None


class _Regather:
    """What autograd keeps instead of a tensor saved from the gathered keys: the rank's own rows, and how to rebuild
    the saved view of the gathered storage from them."""

    def __init__(self, local: torch.Tensor, cp: ContextParallel, like: torch.Tensor):
        self.local, self.cp = local, cp
        self.shape, self.stride, self.offset = like.shape, like.stride(), like.storage_offset()
        self.requires_grad = like.requires_grad

    def rebuild(self) -> torch.Tensor:
        whole = self.cp.gather_values(self.local)
        return whole.as_strided(self.shape, self.stride, self.offset)


class GatheredKeys:
    """Gathers key rows for one layer and remembers which storages are gathered ones (see `keys_regathered`). The
    gathered tensors stay referenced until the block ends, so no other tensor can take their storage meanwhile."""

    def __init__(self, cp: ContextParallel):
        self.cp = cp
        self.gathered: dict = {}  # storage data_ptr -> (the gathered tensor, the rank's rows detached)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        whole = self.cp.gather(local)
        self.gathered[whole.untyped_storage().data_ptr()] = (whole, local.detach())
        return whole

    def pack(self, t: torch.Tensor):
        hit = self.gathered.get(t.untyped_storage().data_ptr()) if t.numel() else None
        return t if hit is None else _Regather(hit[1], self.cp, t)

    @staticmethod
    def unpack(packed):
        return packed.rebuild() if isinstance(packed, _Regather) else packed


@contextlib.contextmanager
def keys_regathered(cp: ContextParallel, replaced: bool):
    """Yields a `GatheredKeys` for one layer's attention. replaced=True: inside the block, every tensor autograd
    saves that views a gathered storage is kept as this rank's rows and gathered again when the backward unpacks it.
    replaced=False (inside a recomputed block, whose checkpoint already drops what is saved, and whose own hooks
    must stay the innermost): gathers only."""
    keys = GatheredKeys(cp)
    try:
        if not replaced:
            yield keys
            return
        with torch.autograd.graph.saved_tensors_hooks(keys.pack, keys.unpack):
            yield keys
    finally:
        keys.gathered.clear()
