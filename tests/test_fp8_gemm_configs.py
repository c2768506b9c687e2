"""The FP8 GEMMs' tile tables (dsaflow/ops/fp8_gemm/tile_configs.py) and every launch they or the sweep's candidate
lists can make, in the Triton interpreter against the fp32 references: split K (the partials' sum kernel), the
fused activation quantization (bit-equal to the separate kernel, so equal to the reference's e4m3 values), tiles
wider than one weight-scale block, and K a multiple of 128 (the unmasked EVEN_K loop) or not."""

from __future__ import annotations

import pytest
import torch
from test_fp8_gemm import grouped_inputs, interpreter

from dsaflow.ops.fp8_gemm import fp8_grouped_mm_naive, fp8_linear_naive, quantize_blocks_128, tile_configs
from dsaflow.ops.fp8_gemm.tile_configs import FP8TileConfig, dense_config, grouped_config, lookup
from dsaflow.ops.fp8_gemm.triton_act_quant import quantize_rows_1x128_triton
from dsaflow.ops.fp8_gemm.triton_fp8_gemm import fp8_gemm_triton, fp8_linear_triton, k_splits
from dsaflow.ops.fp8_gemm.triton_fp8_grouped import fp8_grouped_mm_triton

C = FP8TileConfig


def all_dense_configs() -> list:
    configs = [row[-1] for row in tile_configs.DENSE_TABLE]
    configs += [c for _, _, candidates in tile_configs.DENSE_CANDIDATES for c in candidates]
    return list(dict.fromkeys(configs))


def all_grouped_configs() -> list:
    configs = [row[-1] for row in tile_configs.GROUPED_TABLE]
    configs += [c for _, _, candidates in tile_configs.GROUPED_CANDIDATES for c in candidates]
    return list(dict.fromkeys(configs))


def test_the_tables_end_unbounded_and_pick_by_rows_and_width():
    for table in (tile_configs.DENSE_TABLE, tile_configs.GROUPED_TABLE):
        assert table[-1][:2] == (None, None), "the last row must take every shape"
    assert dense_config(1, 24576).block_m == 16 and dense_config(64, 24576).block_n == 64
    assert dense_config(32, 7168).block_n == 32 and dense_config(32, 24576).block_n == 64
    assert dense_config(64, 7168).split_k_programs and dense_config(65, 7168).block_m == 128
    assert grouped_config(32768 * 8, 256, 4096).block_m == 64 and grouped_config(512, 256, 4096).block_m == 16
    with pytest.raises(ValueError, match="unbounded"):
        lookup(((16, None, C(16, 32, 4, 4)),), 17, 1)


def test_split_k_fills_the_grid_and_leaves_no_split_empty():
    decode = C(64, 64, 4, 4, split_k_programs=264)
    assert k_splits(decode, 64, 24576, 1536) == 1  # 384 column tiles already fill the grid
    assert k_splits(decode, 64, 7168, 16384) == 3  # 112 tiles: 3 splits of 43 K blocks (the last 42)
    assert k_splits(C(64, 64, 4, 4), 64, 7168, 16384) == 1
    for K in range(128, 20 * 128, 128):
        split = k_splits(decode, 16, 4096, K)
        per = -(-(K // 128) // split)
        assert (split - 1) * per < K // 128, f"K={K}: split {split} x {per} blocks leaves one empty"


def test_every_config_names_itself_distinctly():
    names = [c.name() for c in all_dense_configs() + all_grouped_configs()]
    assert len(set(names)) == len(set(all_dense_configs() + all_grouped_configs()))


@interpreter
@pytest.mark.slow
@pytest.mark.parametrize("config", all_dense_configs(), ids=lambda c: c.name())
def test_every_dense_launch_matches_the_reference(config):
    """Rows past one tile, a ragged last column tile, K both a multiple of 128 (3 blocks: split K has work for
    every split) and not; the fused quantization also with power-of-two scales."""
    g = torch.Generator().manual_seed(3)
    for M, N, K in [(19, 70, 384), (5, 200, 200)]:
        x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * 0.05
        w8, w_scale = quantize_blocks_128(w)
        for ue8m0 in (False, True) if config.fuse_quant else (False,):
            out = fp8_linear_triton(x, w8, w_scale, ue8m0, config)
            ref = fp8_linear_naive(x, w8, w_scale, ue8m0)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=f"{config.name()} M={M} N={N} K={K}")
        x8, x_scale_t = quantize_rows_1x128_triton(x)
        out = fp8_gemm_triton(x8, x_scale_t, w8, w_scale, M, torch.float32, config)
        torch.testing.assert_close(out, fp8_linear_naive(x, w8, w_scale), rtol=1e-5, atol=1e-5)


@interpreter
@pytest.mark.slow
@pytest.mark.parametrize("config", all_grouped_configs(), ids=lambda c: c.name())
def test_every_grouped_launch_matches_the_reference(config):
    """Empty experts, a tail past the last expert (written as zeros), K = 200 (masked) and 256 (EVEN_K)."""
    for K in (200, 256):
        a, w8, w_scale, offsets = grouped_inputs(N=130, K=K)
        x8, x_scale_t = quantize_rows_1x128_triton(a)
        out = fp8_grouped_mm_triton(x8, x_scale_t, w8, w_scale, offsets, a.shape[0], torch.float32, config)
        torch.testing.assert_close(out, fp8_grouped_mm_naive(a, w8, w_scale, offsets), rtol=1e-5, atol=1e-5)
        assert (out[33:] == 0).all()
