"""The FP8 kernels compiled ahead of time for sm_90 with the installed Triton (no GPU needed): what the interpreter
cannot check. Each kernel lowers (fp8 MMA: mma.sync for the narrowest tiles, wgmma otherwise), the quantizer's
arithmetic survives compilation, and every GEMM launch of the tile tables and the sweep's candidates keeps its K
loop software-pipelined: cp.async copies into a shared-memory ring with a leading stage dimension.

The arguments carry the specialization Triton's launcher gives them at run time for DeepSeek-V3.2's shapes
(pointers 16-byte aligned, K, N and the strides multiples of 16: `tt.divisibility`). Without it the fp8 loads
cannot be vectorized to cp.async's 4+ bytes and no loop is pipelined, which is what an unhinted ahead-of-time
compile shows and not what runs.

In the K loop, Triton waits for each block's MMA before scaling it (`wgmma.wait_group 0`: a dot whose product is
read in the loop gets no later wait), and the launches with prefetch_scales issue no MMA behind a scale load of
their own iteration.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ALIGNED = 16
POINTERS = {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "b_ptr": "*fp8e4nv", "b_scale_ptr": "*fp32", "c_ptr": "*bf16"}
GROUPED_POINTERS = {**POINTERS, "tile_expert_ptr": "*i32", "tile_row0_ptr": "*i32", "tile_rowend_ptr": "*i32"}
UNALIGNED = {"M", "kb_per_split"}  # a row count and a block count need not be multiples of 16


def compile_for_sm90(kernel, pointers: dict, constexprs: dict, num_warps: int, num_stages: int = 3) -> dict:
    """The TTGIR and PTX of `kernel` for sm_90: pointer arguments typed by `pointers`, the other runtime ones i32 (an
    expert stride i64), all but UNALIGNED specialized divisible by 16 as the launcher does for V3.2's shapes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        sig[name] = "constexpr" if name in constexprs else pointers.get(name, "i64" if name == "s_be" else "i32")
        if name not in constexprs and name not in UNALIGNED:
            attrs[(i,)] = [["tt.divisibility", ALIGNED]]
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm


def k_loop(ptx: str) -> str:
    """The PTX body of the K loop: the innermost loop (LLVM's "Inner Loop Header" label to its back-branch) that
    holds the MMA."""
    for m in re.finditer(r"\n(\$L__BB\d+_\d+):\s*// [^\n]*Inner Loop Header", ptx):
        end = re.search(rf"bra(?:\.uni)?\s+{re.escape(m.group(1))};", ptx[m.end() :])
        body = ptx[m.end() : m.end() + end.start()] if end else ""
        if "mma" in body:
            return body
    return ""


def scale_loads_used_in_their_iteration(loop: str) -> int:
    """How many of the K loop's global loads (the scales: the tiles come by cp.async) are computed with in the
    iteration that issues them; a load only moved into a loop-carried register is used one iteration later."""
    lines = loop.splitlines()
    used = 0
    for i, line in enumerate(lines):
        load = re.search(r"ld\.global\S*\s+\{?\s*(%r\d+)", line)
        if load:
            reg = re.compile(re.escape(load.group(1)) + r"\b")
            used += any(reg.search(later) and not later.strip().startswith("mov.") for later in lines[i + 1 :])
    return used


def pipelining(asm: dict) -> dict:
    """What shows the K loop multi-buffered: the async copies in the TTGIR, the stage count of the shared-memory
    rings (the leading dim of a 3-d local_alloc), and the PTX's cp.async / wgmma; and, in the K loop, the wgmma
    waits (`wgmma.wait_group N`: N groups left in flight) and the scale loads used in their own iteration."""
    ttgir, ptx = asm["ttgir"], asm["ptx"]
    rings = [int(d) for d in re.findall(r"ttg\.local_alloc[^\n]*memdesc<(\d+)x\d+x\d+x", ttgir)]
    loop = k_loop(ptx)
    return {
        "async_copies": ttgir.count("ttg.async_copy_global_to_local"),
        "ring_stages": max(rings, default=0),
        "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
        "wgmma": ptx.count("wgmma.mma_async"),
        "mma_sync": ptx.count("mma.sync"),
        "loop_wgmma_waits": [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", loop)],
        "loop_scale_loads_used_at_once": scale_loads_used_in_their_iteration(loop),
    }


def dense_facts(config, even_k: bool = True) -> dict:
    from dsaflow.ops.fp8_gemm import triton_fp8_gemm

    pointers = {**POINTERS, "a_ptr": "*bf16"} if config.fuse_quant else POINTERS
    consts = {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": 128, "GROUP_M": config.group_m,
              "EVEN_K": even_k, "FUSE_QUANT": config.fuse_quant, "UE8M0": False, "INV_MAX": 1.0 / 448.0,
              "PREFETCH_SCALES": config.prefetch_scales}  # fmt: skip
    kernel = triton_fp8_gemm._fp8_gemm_kernel
    facts = pipelining(compile_for_sm90(kernel, pointers, consts, config.num_warps, config.num_stages))
    return {**facts, "prefetch_scales": config.prefetch_scales}


def grouped_facts(config, even_k: bool = True) -> dict:
    from dsaflow.ops.fp8_gemm import triton_fp8_grouped

    consts = {"E": 8, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": 128, "EVEN_K": even_k,
              "GROUP_M": config.group_m, "PREFETCH_SCALES": config.prefetch_scales}  # fmt: skip
    kernel = triton_fp8_grouped._fp8_grouped_kernel
    facts = pipelining(compile_for_sm90(kernel, GROUPED_POINTERS, consts, config.num_warps, config.num_stages))
    return {**facts, "prefetch_scales": config.prefetch_scales}


def hopper_facts() -> dict:
    """{what: facts} for the quantizer and every GEMM launch (run without the interpreter: a compiled kernel is a
    JITFunction)."""
    from dsaflow.ops.fp8_gemm import tile_configs, triton_act_quant

    quant = compile_for_sm90(
        triton_act_quant._act_quant_kernel,
        {"x_ptr": "*bf16", "x8_ptr": "*fp8e4nv", "scale_ptr": "*fp32"},
        {"INV_MAX": 1.0 / 448.0, "UE8M0": True, "BLOCK_ROWS": 32, "BLOCK_K": 128},
        num_warps=4,
    )["ptx"]
    facts = {
        "quantizer": {
            "divides with IEEE rounding": "div.rn.f32" in quant and "div.full" not in quant,
            "keeps its subnormal rounding (x + 24576) - 24576": "0fC6C00000" in quant,
        }
    }
    dense = [row[-1] for row in tile_configs.DENSE_TABLE]
    dense += [c for _, _, cands in tile_configs.DENSE_CANDIDATES for c in cands]
    for config in dict.fromkeys(dense):
        facts[f"dense {config.name()}"] = dense_facts(config)
    facts["dense 128x128 w8 s4 g8, K % 128 != 0"] = dense_facts(tile_configs.DENSE_TABLE[-1][-1], even_k=False)
    prefetch = tile_configs.FP8TileConfig(64, 128, 4, 4, prefetch_scales=True)
    facts["grouped 64x128 w4 s4 g8 prefetch, K % 128 != 0"] = grouped_facts(prefetch, even_k=False)
    grouped = [row[-1] for row in tile_configs.GROUPED_TABLE]
    grouped += [c for _, _, cands in tile_configs.GROUPED_CANDIDATES for c in cands]
    for config in dict.fromkeys(grouped):
        facts[f"grouped {config.name()}"] = grouped_facts(config)
    return facts


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile them for the GPU at hand")
def test_the_kernels_compile_for_hopper_with_pipelined_k_loops():
    """In a subprocess without TRITON_INTERPRET, which conftest.py sets for this one."""
    tests = Path(__file__).parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tests.parent), str(tests)])
    code = "import json, test_fp8_gemm_compile as t; print(json.dumps(t.hopper_facts()))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tests)
    assert r.returncode == 0, r.stderr[-3000:]
    facts = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(facts.pop("quantizer").values())
    for what, f in facts.items():
        assert f["wgmma"] or f["mma_sync"], f"{what}: no fp8 MMA: {f}"
        assert f["async_copies"] and f["cp_async"], f"{what}: K loop not pipelined (no cp.async): {f}"
        assert f["ring_stages"] >= 2, f"{what}: no multi-buffered shared-memory ring: {f}"
        if f["prefetch_scales"]:  # the point of the option: no MMA issue waits on a scale load of its iteration
            assert f["loop_scale_loads_used_at_once"] == 0, f"{what}: scales not prefetched: {f}"
        elif f["wgmma"]:  # without it (the check above sees it): the loop computes with the loads it issues
            assert f["loop_scale_loads_used_at_once"] > 0, f"{what}: the check no longer sees the scale loads: {f}"
        # Either way Triton waits for each K block's MMA before scaling it (the product is read in the loop)
        assert not f["wgmma"] or f["loop_wgmma_waits"] == [0], f"{what}: MMA wait changed (docs/kernels.md): {f}"
