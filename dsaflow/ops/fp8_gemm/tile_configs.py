"""Tile configurations of the Triton FP8 GEMMs: one small explicit table per kernel, keyed by a row bucket, so a
launch is chosen from shapes only (serving graphs capture it; nothing autotunes at run time).

Each table is a tuple of rows (largest bucket value, largest N, config), walked in order: the first row whose
bounds hold (None: no bound) is the launch, and the last row has none. The dense table is keyed by M, the grouped
one by the mean rows per expert (M // E: what sets the ragged tiles' waste).
`CANDIDATES` lists, per kernel and bucket, what `scripts/bench_fp8.py --sweep` times on a GPU; the sweep prints
the winners as rows of these tables, ready to paste. The rows for M <= 16, <= 64 and <= 256 (dense) and for
M // E <= 4, <= 16 and the last row (grouped) are the winners of that sweep on an H200 (docs/kernels.md, "Tile configs
and the sweep"); the 32-row buckets were not swept and keep their earlier hand-picked launches.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class FP8TileConfig:
    """One launch of an FP8 GEMM kernel.

    block_m x block_n: the output tile of one program (BLOCK_K is always 128, the scales' block).
    num_warps, num_stages: Triton's; num_stages is the depth of the software-pipelined K loop (shared-memory ring).
    group_m: row tiles (the grouped kernel: tile slots) walked together across all column tiles, so the programs
        running together share activation and weight tiles in L2.
    split_k_programs: dense only; 0 = no split. Otherwise K's blocks are split over enough programs that the grid
        has at least this many (fp32 partials, summed by a second kernel): for few rows, where the output tiles
        alone leave SMs idle while the weight streams.
    fuse_quant: dense only; the GEMM quantizes its activation tile itself (bit-equal to `triton_act_quant`)
        instead of a separate quantization launch: for few rows, where that launch and its round trip are a
        noticeable part of the call.
    prefetch_scales: the K loop loads each block's fp32 scales two blocks ahead and forms their product one block
        ahead, instead of loading them in the iteration that applies them, where the MMA's issue waits on that
        global load (bit-identical results). Tiles at most 128 columns wide (one weight scale per K block); not
        with fuse_quant (that loop computes its activation scales itself).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    split_k_programs: int = 0
    fuse_quant: bool = False
    prefetch_scales: bool = False

    def __post_init__(self):
        if self.prefetch_scales and (128 % self.block_n or self.fuse_quant):
            raise ValueError(f"prefetch_scales needs block_n dividing 128 and no fuse_quant: {self}")

    def name(self) -> str:
        """A short label: 64x128 w4 s3 g8 [splitk>=264] [fused] [prefetch]."""
        label = f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages} g{self.group_m}"
        if self.split_k_programs:
            label += f" splitk>={self.split_k_programs}"
        return label + (" fused" if self.fuse_quant else "") + (" prefetch" if self.prefetch_scales else "")


C = FP8TileConfig
SM_FILL = 264  # 2 programs per SM on a 132-SM H100 (H200 has 132 too): split K until the grid is this big

# dense (`triton_fp8_gemm`), by M. Decode rows read the weight once and are bound by its bytes: narrow column tiles
# give more programs to stream it. Many rows are bound by the tensor cores.
DENSE_TABLE: tuple = (
    (16, None, C(16, 64, 4, 4, split_k_programs=SM_FILL)),
    (32, 8191, C(32, 32, 4, 5)),
    (32, None, C(32, 64, 4, 5)),
    (64, None, C(64, 64, 4, 4, split_k_programs=SM_FILL)),
    (256, None, C(128, 64, 4, 4, prefetch_scales=True)),
    (None, None, C(128, 128, 8, 4)),
)

# grouped (`triton_fp8_grouped`), by mean rows per expert; block_m is also the tile table's row block, so tiles
# near the mean waste less on each expert's ragged last tile.
GROUPED_TABLE: tuple = (
    (4, None, C(16, 64, 4, 5)),
    (16, None, C(16, 256, 4, 3)),
    (32, None, C(32, 128, 4, 4)),
    (64, None, C(64, 128, 4, 4)),
    (None, None, C(64, 128, 4, 4, group_m=16, prefetch_scales=True)),
)


def lookup(table: tuple, value: int, N: int) -> FP8TileConfig:
    """The config of the first row whose bounds hold for (value, N)."""
    for bound, n_bound, config in table:
        if (bound is None or value <= bound) and (n_bound is None or N <= n_bound):
            return config
    raise ValueError(f"tile table has no unbounded last row: {table}")


def dense_config(M: int, N: int) -> FP8TileConfig:
    """The dense kernel's launch for M rows times an [N, K] weight."""
    return lookup(DENSE_TABLE, M, N)


def grouped_config(M: int, E: int, N: int) -> FP8TileConfig:
    """The grouped kernel's launch for M rows over E experts of [N, K] weights."""
    return lookup(GROUPED_TABLE, max(1, M // max(1, E)), N)


# ---- what the sweep times, per kernel: (the bucket's bound as a table row takes it, the value it is timed at,
# candidates); the timed value is M for the dense kernel, M // E for the grouped one ----


_DECODE = (
    C(16, 64, 4, 5),
    C(16, 32, 4, 5),
    C(16, 32, 4, 6),
    C(16, 128, 4, 4),
    C(16, 64, 4, 4, split_k_programs=SM_FILL),
    C(16, 128, 4, 4, split_k_programs=SM_FILL),
    C(16, 64, 4, 5, fuse_quant=True),
    C(16, 64, 4, 4, split_k_programs=SM_FILL, fuse_quant=True),
    C(16, 128, 4, 4, split_k_programs=2 * SM_FILL, fuse_quant=True),
)


def _rows(block_m: int, configs: tuple) -> tuple:
    return tuple(replace(c, block_m=block_m) for c in configs)


DENSE_CANDIDATES: tuple = (
    (16, 16, _rows(16, _DECODE)),
    (64, 64, _rows(64, _DECODE)),
    (256, 256, (
        C(64, 64, 4, 5), C(64, 128, 4, 4), C(128, 64, 4, 4), C(64, 128, 4, 3, group_m=16),
        C(128, 128, 8, 4), C(64, 64, 4, 4, split_k_programs=SM_FILL), C(64, 128, 4, 4, split_k_programs=SM_FILL),
        C(64, 64, 4, 5, fuse_quant=True), C(128, 64, 4, 4, prefetch_scales=True),
    )),
)  # fmt: skip

# the ceiling-bound buckets: the per-K-block scaling waits for each MMA, so hiding it takes a second program on the
# SM (4 warps, 64-row tiles, shallower rings) or more MMA per wait (128 x 256); prefetch_scales takes the scales'
# global loads off the path to each MMA
GROUPED_CANDIDATES: tuple = (
    # decode: 64 rows x 8 experts over 256 is 2 rows per expert; every expert a row picks is read whole
    (4, 2, (C(16, 256, 4, 3), C(16, 128, 4, 4), C(16, 64, 4, 5), C(16, 128, 8, 4))),
    (16, 16, (C(16, 128, 4, 4), C(16, 64, 4, 5), C(16, 128, 4, 3), C(16, 256, 4, 3), C(16, 128, 8, 4))),
    (None, 128, (
        C(128, 128, 8, 4), C(128, 128, 8, 3), C(64, 128, 4, 4), C(64, 128, 4, 3), C(64, 128, 4, 5),
        C(64, 256, 8, 3), C(128, 256, 8, 3), C(128, 64, 4, 4), C(64, 64, 4, 4),
        C(64, 128, 4, 4, group_m=16), C(128, 128, 8, 4, group_m=4),
        C(64, 128, 4, 4, prefetch_scales=True), C(64, 128, 4, 4, group_m=16, prefetch_scales=True),
        C(128, 128, 8, 4, prefetch_scales=True),
    )),
)  # fmt: skip
