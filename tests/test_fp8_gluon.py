"""The Gluon grouped FP8 GEMM (`gluon_fp8_grouped.py`) without a GPU: its capability rule on CPU tensors and faked
capabilities, and the kernel compiled ahead of time for sm_90 with the installed Triton, with the facts that make it
worth having: each consumer's K loop waits with one MMA group still in flight (`wgmma.wait_group 1`, where the Triton
kernel waits with 0), the operands come by TMA, and ptxas neither serializes the wgmmas nor spills.

`gluon_facts()` also runs under another Triton (for the one on the GPU machines):
    PYTHONPATH=/path/to/triton-3.6:tests .venv/bin/python -c "import test_fp8_gluon as t; print(t.gluon_facts())"
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from ops_helpers import FakeCuda

from dsaflow.ops.fp8_gemm import gluon_fp8_grouped as g
from dsaflow.ops.fp8_gemm.gluon_fp8_grouped import gluon_support_reason

FP8 = torch.float8_e4m3fn
POINTERS = {"a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32", "c_ptr": "*bf16", "tile_expert_ptr": "*i32",
            "tile_row0_ptr": "*i32", "tile_rowend_ptr": "*i32"}  # fmt: skip
UNALIGNED = {"s_bsk"}  # w_scale's K stride: a block count


def compile_gluon_for_sm90(config: dict | None = None, E: int = 16) -> tuple[dict, str]:
    """The kernel's asm (ttgir, ptx, cubin) for sm_90 at V3.2's prefill shapes, with the descriptors' types taken from
    host descriptors over CPU tensors (as the launcher would from CUDA ones), and the ptxas -v report of its PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    kernel = g._fp8_grouped_gluon_kernel
    x8 = torch.empty(256, 7168, dtype=FP8)
    w2 = torch.empty(2 * 4096, 7168, dtype=FP8)
    descs = {
        "a_desc": g.TensorDescriptor.from_tensor(
            x8, [g.HALF_M, 128], gl.NVMMASharedLayout.get_default_for([g.HALF_M, 128], gl.float8e4nv)
        ),
        "b_desc": g.TensorDescriptor.from_tensor(
            w2, [g.BLOCK_N, 128], gl.NVMMASharedLayout.get_default_for([g.BLOCK_N, 128], gl.float8e4nv)
        ),
    }
    knobs = g.kernel_config(g.GLUON_CFG, config, "test")
    consts = {"E": E, **{k: v for k, v in knobs.items() if k in kernel.arg_names}}  # less the host's knobs
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in descs:
            sig[name] = mangle_type(descs[name])
        else:
            sig[name] = POINTERS.get(name, "i32")
            if name not in UNALIGNED:  # the launcher's specialization at V3.2's shapes (pointers, N, K, strides)
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    asm = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm
    with tempfile.TemporaryDirectory() as d:
        ptx = Path(d) / "k.ptx"
        ptx.write_text(asm["ptx"])
        r = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(d) / "k.cubin")],
                           capture_output=True, text=True)  # fmt: skip
    return asm, r.stdout + r.stderr


def mma_loops(ptx: str) -> list[str]:
    """The PTX bodies of the innermost loops that issue wgmma: from a label LLVM marks "Inner Loop Header" (on its
    line or after its "Parent Loop" comment lines) to its back-branch."""
    out = []
    for m in re.finditer(r"\n(\$L__BB\d+_\d+):[^\n]*(?:\n\s*//[^\n]*)*?Inner Loop Header", ptx):
        end = re.search(rf"bra(?:\.uni)?\s+{re.escape(m.group(1))};", ptx[m.end() :])
        body = ptx[m.end() : m.end() + end.start()] if end else ""
        if "wgmma.mma_async" in body:
            out.append(body)
    return out


def gluon_facts(config: dict | None = None) -> dict:
    import triton

    asm, ptxas = compile_gluon_for_sm90(config)
    ptx = asm["ptx"]
    loops = mma_loops(ptx)
    spills = re.search(r"(\d+) bytes spill stores", ptxas)
    regs = re.search(r"Used (\d+) registers", ptxas)
    return {
        "triton": triton.__version__,
        "tma_loads": ptx.count("cp.async.bulk.tensor"),
        "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
        "wgmma": ptx.count("wgmma.mma_async"),
        "mma_loops": len(loops),
        "loop_wgmma": [loop.count("wgmma.mma_async") for loop in loops],
        "loop_wgmma_waits": [
            [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", lp)] for lp in loops
        ],
        "setmaxnreg": sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
        "ptxas_serializes_wgmma": "serialized" in ptxas,
        "ptxas_spill_bytes": int(spills.group(1)) if spills else None,
        "ptxas_registers": int(regs.group(1)) if regs else None,
        "ptxas_ok": "error" not in ptxas.lower(),
    }


def test_refuses_cpu_tensors_and_other_gpus(monkeypatch):
    x8, w8 = torch.zeros(256, 7168, dtype=FP8), torch.zeros(4, 512, 7168, dtype=FP8)
    assert "device cpu" in gluon_support_reason(x8, w8)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert "10.0" in gluon_support_reason(FakeCuda(x8), w8)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert "8.9" in gluon_support_reason(FakeCuda(x8), w8)


@pytest.mark.skipif(g.TMA_ERROR is not None, reason="this triton has no usable Gluon TMA")
def test_takes_v32_shapes_on_hopper_and_refuses_what_tma_cannot_read(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for N, K in [(4096, 7168), (7168, 2048), (576, 208)]:
        assert gluon_support_reason(FakeCuda(torch.zeros(300, K, dtype=FP8)), torch.zeros(8, N, K, dtype=FP8)) is None
    assert "multiple of 16" in gluon_support_reason(
        FakeCuda(torch.zeros(300, 200, dtype=FP8)), torch.zeros(8, 576, 200, dtype=FP8)
    )
    w8 = torch.zeros(8, 512, 2048, dtype=FP8)
    assert "contiguous" in gluon_support_reason(FakeCuda(torch.zeros(300, 2048, dtype=FP8)), w8.transpose(0, 1))
    x_strided = torch.zeros(300, 4096, dtype=FP8)[:, :2048]
    assert gluon_support_reason(FakeCuda(x_strided), w8) is None  # any 16-byte row pitch
    assert "unit K stride" in gluon_support_reason(FakeCuda(torch.zeros(2048, 300, dtype=FP8).t()), w8)
    assert "float8_e4m3fn" in gluon_support_reason(FakeCuda(torch.zeros(300, 2048)), w8)


def test_the_call_raises_with_the_reason():
    x8, w8 = torch.zeros(256, 512, dtype=FP8), torch.zeros(4, 256, 512, dtype=FP8)
    with pytest.raises(ValueError, match="fp8_grouped_mm_gluon: device cpu"):
        g.fp8_grouped_mm_gluon(x8, torch.ones(4, 256), w8, torch.ones(4, 2, 4), torch.zeros(4, dtype=torch.int32),
                               200, torch.bfloat16)  # fmt: skip
    with pytest.raises(ValueError, match="unknown config keys"):
        g.fp8_grouped_mm_gluon(x8, torch.ones(4, 256), w8, torch.ones(4, 2, 4), torch.zeros(4, dtype=torch.int32),
                               200, torch.bfloat16, config={"BLOCK_M": 64})  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile it for the GPU at hand")
@pytest.mark.skipif(g.TMA_ERROR is not None, reason="this triton has no usable Gluon TMA")
def test_the_kernel_compiles_for_hopper_with_one_mma_in_flight_while_scaling():
    """In a subprocess without TRITON_INTERPRET, which conftest.py sets."""
    tests = Path(__file__).parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tests.parent), str(tests)])
    code = "import json, test_fp8_gluon as t; print(json.dumps(t.gluon_facts()))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tests)
    assert r.returncode == 0, r.stderr[-3000:]
    f = json.loads(r.stdout.strip().splitlines()[-1])
    assert f["tma_loads"] == 3 and f["cp_async"] == 0, f  # A's two 64-row boxes and B's box, all by TMA
    assert f["mma_loops"] == 4, f  # per consumer warpgroup: a full tile's K loop and a half tile's
    # two K blocks an iteration, 4 wgmma (k = 32) each, and each block's product retired with the next in flight
    assert f["loop_wgmma"] == [8] * 4 and f["loop_wgmma_waits"] == [[1, 1]] * 4, f
    assert f["ptxas_ok"] and not f["ptxas_serializes_wgmma"], f
    assert f["ptxas_spill_bytes"] == 0, f
    assert 232 in f["setmaxnreg"], f  # the consumers' registers: accumulator + two products in flight
