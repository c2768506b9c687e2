"""The sparse MLA backward rows of the dispatch table (`dispatch.py`) and the optional cuDNN-Frontend backward.

CPU: the environment variable, the capability rule with cuDNN-Frontend faked present or hidden (the import is
replaced, the device capability too), that without it the backward and its results are dsaflow's with no warning,
and that the autograd Function hands a call to the cuDNN adapter exactly when the rule says so (with `probs_into`,
followed by the target pass of `triton_probs.py`).
GPU (`gpu`, skipped unless cuDNN-Frontend imports and the GPU is one it runs on): dq and dkv through `sparse_mla`
with requires_grad against the naive fp32 reference, outputs NaN-poisoned; with `probs_into`, the target against
dsaflow's backward's; CUDA-graph replay against eager.
"""

from __future__ import annotations

import logging
import sys
import warnings

import pytest
import torch
from ops_helpers import sparse_mla_kernels

from dsaflow.errors import PlanError
from dsaflow.ops.sparse_mla import cudnn_backward as cb
from dsaflow.ops.sparse_mla import deterministic, function, sparse_mla, sparse_mla_naive
from dsaflow.ops.sparse_mla import dispatch as bd

ENV = bd.ENV_BACKWARD


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    """Every test reads the variable and the import afresh and logs as if first in its process."""
    monkeypatch.delenv(ENV, raising=False)
    bd.forced_backward.cache_clear()
    cb.cudnn_import_error.cache_clear()
    function._LOGGED.clear()
    yield
    monkeypatch.undo()  # first: the caches below must forget what a faked import answered
    bd.forced_backward.cache_clear()
    cb.cudnn_import_error.cache_clear()
    function._LOGGED.clear()


def _setting(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    bd.forced_backward.cache_clear()


def _hidden(monkeypatch):
    """cuDNN-Frontend not installed: its import raises ImportError."""
    monkeypatch.setitem(sys.modules, "cudnn", None)
    cb.cudnn_import_error.cache_clear()


def _present(monkeypatch, cap=(9, 0)):
    monkeypatch.setattr(cb, "cudnn_import_error", lambda: None)
    monkeypatch.setattr(bd, "device_capability", lambda t: cap)


def _mla(B=1, T=4, H=128, d_qk=576, S=64, K=16, dtype=torch.bfloat16, device="meta"):
    q = torch.empty(B, T, H, d_qk, dtype=dtype, device=device)
    kv = torch.empty(B, S, d_qk, dtype=dtype, device=device)
    return q, kv, torch.empty(B, T, K, dtype=torch.int32, device=device)


def _explain(*args, **kw):
    return bd.explain_sparse_mla(*args, backward=True, **kw)


# ---- the environment variable ----


@pytest.mark.parametrize(
    "value,allowed",
    [("auto", None), ("", None), ("dsaflow", {"hopper", "triton"}), ("CUDNN", {"cudnn"}), ("hopper", {"hopper"})],
)
def test_env_values(monkeypatch, value, allowed):
    _setting(monkeypatch, value)
    setting, got = bd.forced_backward()
    assert setting == (value.lower() or "auto")
    assert got == (None if allowed is None else frozenset(allowed))


def test_env_bad_value_names_variable_and_choices(monkeypatch):
    _setting(monkeypatch, "fast")
    with pytest.raises(PlanError, match=rf"{ENV}='fast'.*auto, dsaflow, cudnn"):
        bd.forced_backward()


# ---- the rule ----


def test_rule_with_cudnn_present(monkeypatch):
    _present(monkeypatch)
    q, kv, idx = _mla()
    assert _explain(q, kv, idx, 512, deterministic=False).kernel == "cudnn"
    assert _explain(*_mla(H=16), 512, deterministic=False).kernel == "cudnn"  # sm_90 takes any H >= 2
    assert _explain(*_mla(d_qk=512), 512, deterministic=False).kernel == "cudnn"
    assert _explain(q, kv, idx, 512, probs_into=True, deterministic=False).kernel == "cudnn"  # + the target pass
    refused = {
        "receives a gradient": _explain(q, kv, idx, 512, lse_grad=True, deterministic=False),
        "deterministic": _explain(q, kv, idx, 512, deterministic=True),
        "dtypes": _explain(*_mla(dtype=torch.float32), 512, deterministic=False),
        "d_qk=192": _explain(*_mla(d_qk=192), 128, deterministic=False),
        "d_v=256": _explain(q, kv, idx, 256, deterministic=False),
        "H=1": _explain(*_mla(H=1), 512, deterministic=False),
        "2^31": _explain(*_mla(T=32768), 512, deterministic=False),  # 32768 * 128 * 576 elements of q
    }
    for reason, choice in refused.items():
        assert choice.kernel == "triton" and reason in choice.reasons(), (reason, str(choice))
    choice = _explain(q, kv, idx, 512, lse_grad=True, probs_into=True, deterministic=False)
    assert choice.kernel == "triton" and "receives a gradient" in choice.reasons()  # dsaflow's adds the target


def test_rule_per_gpu_generation(monkeypatch):
    q, kv, idx = _mla()
    _present(monkeypatch, cap=(8, 0))
    assert "sm_80" in _explain(q, kv, idx, 512, deterministic=False).reasons()
    _present(monkeypatch, cap=(12, 0))
    assert "sm_120" in _explain(q, kv, idx, 512, deterministic=False).reasons()
    _present(monkeypatch, cap=(10, 0))  # sm_100: fixed head counts, and a deterministic mode of its own
    assert _explain(q, kv, idx, 512, deterministic=True).kernel == "cudnn"
    assert "H=8" in _explain(*_mla(H=8), 512, deterministic=False).reasons()
    monkeypatch.setattr(bd, "device_capability", lambda t: None)
    assert "device meta" in _explain(q, kv, idx, 512, deterministic=False).reasons()


def test_forcing_picks_among_the_backwards_that_take_the_call(monkeypatch):
    _present(monkeypatch)
    q, kv, idx = _mla(S=32768, K=2048)
    _setting(monkeypatch, "cudnn")
    assert _explain(q, kv, idx, 512, deterministic=False).kernel == "cudnn"
    _setting(monkeypatch, "dsaflow")
    choice = _explain(q, kv, idx, 512, deterministic=False)
    assert choice.kernel == "triton" and f"{ENV}=dsaflow" in dict(choice.refused)["cudnn"]
    assert "device meta" in dict(choice.refused)["hopper"]


def test_forced_cudnn_on_a_call_it_cannot_take_raises(monkeypatch):
    _present(monkeypatch)
    _setting(monkeypatch, "cudnn")
    q, kv, idx = _mla()
    with pytest.raises(PlanError, match=rf"{ENV}=cudnn.*receives a gradient.*{ENV}=auto"):
        function.backward_kernel(q, kv, idx, 512, lse_grad=True, probs_into=True, deterministic=False)
    assert function.backward_kernel(q, kv, idx, 512, lse_grad=False, probs_into=True, deterministic=False) == "cudnn"


# ---- without the extra ----


def _tiny(seed=0, dtype=torch.float32, H=2, d_qk=40):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 3, H, d_qk, generator=g).to(dtype).requires_grad_(True)
    kv = torch.randn(1, 9, d_qk, generator=g).to(dtype).requires_grad_(True)
    idx = torch.randint(0, 9, (1, 3, 8), generator=g, dtype=torch.int32)
    idx[0, 1, 5:] = -1
    return q, kv, idx


def test_not_installed_changes_nothing_and_warns_nothing(monkeypatch, caplog):
    _hidden(monkeypatch)
    monkeypatch.setattr(bd, "device_capability", lambda t: (9, 0))  # as on an H100 without the extra
    assert "not installed" in cb.cudnn_import_error() and "dsaflow[peers]" in cb.cudnn_import_error()
    choice = _explain(*_mla(), 512, deterministic=False)
    assert choice.kernel == "triton" and "not installed" in choice.reasons()
    q, kv, idx = _tiny()
    caplog.set_level(logging.DEBUG)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = sparse_mla_kernels(q, kv, idx, 0.2, 32)
        dq, dkv = torch.autograd.grad(out.sum(), (q, kv))
    ref_out, _ = sparse_mla_naive(q, kv, idx, 0.2, 32)
    ref_dq, ref_dkv = torch.autograd.grad(ref_out.sum(), (q, kv))
    torch.testing.assert_close(dq, ref_dq, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dkv, ref_dkv, rtol=1e-4, atol=1e-4)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_forced_cudnn_without_it_fails_at_the_forward(monkeypatch):
    _hidden(monkeypatch)
    _setting(monkeypatch, "cudnn")
    q, kv, idx = _tiny()
    with pytest.raises(PlanError, match=rf"{ENV}=cudnn.*not installed.*dsaflow\[peers\].*{ENV}=auto"):
        sparse_mla_kernels(q, kv, idx, 0.2, 32)


# ---- the autograd Function consults the table ----


def test_function_hands_cudnn_calls_to_the_adapter_and_logs_once(monkeypatch, caplog):
    """Faked present on sm_90: a loss of out alone goes to the adapter (n_keys and the non-deterministic mode passed
    on); a loss that uses lse, or deterministic mode, runs dsaflow's backward. One log line per backward."""
    _present(monkeypatch)
    calls = []

    def adapter(q, kv, indices, out, lse, d_out, sm_scale, d_v, n_keys, det):
        calls.append((n_keys.tolist(), det, sm_scale, d_v))
        return torch.zeros_like(q), torch.zeros_like(kv)

    monkeypatch.setattr(cb, "sparse_mla_bwd_cudnn", adapter)
    q, kv, idx = _tiny(dtype=torch.bfloat16, H=2, d_qk=576)
    caplog.set_level(logging.INFO, logger="dsaflow.ops.sparse_mla")
    for _ in range(2):
        out, lse = sparse_mla_kernels(q, kv, idx, 0.2, 512)
        dq, _ = torch.autograd.grad(out.float().sum(), (q, kv))
        assert dq.abs().sum() == 0  # the adapter's answer
    assert calls == [([[8, 5, 8]], False, 0.2, 512)] * 2
    out, lse = sparse_mla_kernels(q, kv, idx, 0.2, 512)
    dq, _ = torch.autograd.grad(out.float().sum() + lse.sum(), (q, kv))
    assert len(calls) == 2 and dq.abs().sum() > 0
    with deterministic():
        out, lse = sparse_mla_kernels(q, kv, idx, 0.2, 512)
        torch.autograd.grad(out.float().sum(), (q, kv))
    assert len(calls) == 2
    lines = [r.getMessage() for r in caplog.records if "sparse_mla backward" in r.getMessage()]
    assert len(lines) == 2 and lines[0].startswith("sparse_mla backward: cudnn") and "triton" in lines[1]


def test_function_adds_the_target_after_cudnn(monkeypatch, caplog):
    """Faked present on sm_90, a loss of out alone with probs_into: the adapter gives dq and dkv, then the probs pass
    adds the target (fp16 through the interpreter) into the prefilled buffer, what dsaflow's backward adds to
    rounding; the log names the target pass."""
    from dsaflow.ops.indexer_loss import attention_target_naive

    _present(monkeypatch)
    calls = []
    monkeypatch.setattr(
        cb, "sparse_mla_bwd_cudnn", lambda q, kv, *a: calls.append(1) or (torch.zeros_like(q), torch.zeros_like(kv))
    )
    q, kv, idx = _tiny(dtype=torch.float16, H=3, d_qk=576)
    before = torch.rand(1, 3, 8, generator=torch.Generator().manual_seed(4))
    caplog.set_level(logging.INFO, logger="dsaflow.ops.sparse_mla")
    targets = []
    for setting in ("auto", "dsaflow"):
        _setting(monkeypatch, setting)
        target = before.clone()
        out, lse = sparse_mla_kernels(q, kv, idx, 0.2, 512, probs_into=(target, 0.5))
        assert torch.equal(target, before)  # filled by the backward
        torch.autograd.grad(out.float().sum(), (q, kv))
        targets.append(target)
    assert calls == [1]  # auto ran the adapter, dsaflow its own backward
    torch.testing.assert_close(targets[0], targets[1], rtol=1e-5, atol=1e-6)
    ref = attention_target_naive(q.detach().float(), kv.detach().float(), idx, lse.detach(), 0.2, before.clone(), 0.5)
    assert ((targets[0] - ref).norm() / ref.norm()).item() < 1e-3
    lines = [r.getMessage() for r in caplog.records if "sparse_mla backward" in r.getMessage()]
    assert lines[0].startswith("sparse_mla backward: cudnn + target pass (triton_probs)"), lines


# ---- GPU: the real cuDNN-Frontend ----


def _cudnn_runs_here() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    cap = torch.cuda.get_device_capability()
    if cap[0] != 9 and cap not in cb.SM100_CAPABILITIES:
        return f"cuDNN-Frontend's DSA backward does not run on sm_{cap[0]}{cap[1]}"
    return cb.cudnn_import_error()


def _gpu_inputs(B, T, H, S, K, seed):
    """bf16 q [B,T,H,576], kv [B,S,576], indices with -1 padding, >= S entries and one query with no key."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, H, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(B, S, 576, device="cuda", generator=g).bfloat16()
    idx = torch.randint(0, S, (B, T, K), device="cuda", generator=g, dtype=torch.int32)
    idx[torch.rand(B, T, K, device="cuda", generator=g) < 0.1] = -1
    idx[torch.rand(B, T, K, device="cuda", generator=g) < 0.05] = S + 7
    idx[0, 1] = -1
    idx[-1, -1, K // 2 :] = -1  # a short key extent
    return q, kv, idx


def _rel(x, ref):
    assert not torch.isnan(x).any(), "NaN: an output element was not written"
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,S,K", [(1, 128, 128, 4096, 2048), (2, 33, 16, 300, 64)])
def test_gpu_cudnn_backward_through_sparse_mla(monkeypatch, B, T, H, S, K):
    if (why := _cudnn_runs_here()) is not None:
        pytest.skip(why)
    monkeypatch.setattr(cb, "_empty", lambda *a, **k: torch.empty(*a, **k).fill_(float("nan")))
    ran = []
    real = cb.sparse_mla_bwd_cudnn
    monkeypatch.setattr(cb, "sparse_mla_bwd_cudnn", lambda *a, **k: ran.append(1) or real(*a, **k))
    q, kv, idx = _gpu_inputs(B, T, H, S, K, seed=B * 100 + H)
    q.requires_grad_(True)
    kv.requires_grad_(True)
    scale = 576**-0.5
    assert bd.explain_sparse_mla(q, kv, idx, 512, backward=True, deterministic=False).kernel == "cudnn"
    out, _ = sparse_mla(q, kv, idx, scale, 512)
    g_out = torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    dq, dkv = torch.autograd.grad((out.float() * g_out).sum(), (q, kv))
    assert ran == [1], "the backward did not go through cuDNN-Frontend"
    ref_out, _ = sparse_mla_naive(q.float(), kv.float(), idx, scale, 512)
    ref_dq, ref_dkv = torch.autograd.grad((ref_out * g_out).sum(), (q, kv))
    assert dq.dtype == q.dtype and dkv.dtype == kv.dtype
    assert _rel(dq, ref_dq) < 1e-2 and _rel(dkv, ref_dkv) < 1e-2
    assert (dq[0, 1] == 0).all(), "a query with no key has no gradient"
    unused = torch.ones(B, S, dtype=torch.bool, device="cuda")
    for b in range(B):
        sel = idx[b][(idx[b] >= 0) & (idx[b] < S)].long()
        unused[b, sel] = False
    assert (dkv[unused] == 0).all(), "rows no query selects have no gradient"


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,S,K", [(1, 128, 128, 4096, 2048), (2, 33, 16, 300, 64)])
def test_gpu_cudnn_with_probs_into_through_sparse_mla(monkeypatch, B, T, H, S, K):
    """With probs_into, cuDNN-Frontend's backward gives dq and dkv and the probs pass adds the target: the target
    matches the one dsaflow's backward adds on the same forward outputs (and the fp32 reference), dq and dkv match
    dsaflow's; cuDNN's outputs and the probs pass's partial sums are NaN-poisoned."""
    if (why := _cudnn_runs_here()) is not None:
        pytest.skip(why)
    from dsaflow.ops.indexer_loss import attention_target_naive
    from dsaflow.ops.sparse_mla import triton_probs
    from dsaflow.ops.sparse_mla.triton_backward import sparse_mla_bwd_triton

    poison = lambda *a, **k: torch.empty(*a, **k).fill_(float("nan"))  # noqa: E731
    monkeypatch.setattr(cb, "_empty", poison)
    monkeypatch.setattr(triton_probs, "_empty", poison)
    ran = []
    real_bwd, real_probs = cb.sparse_mla_bwd_cudnn, function.sparse_mla_probs_triton
    monkeypatch.setattr(cb, "sparse_mla_bwd_cudnn", lambda *a, **k: ran.append("cudnn") or real_bwd(*a, **k))
    monkeypatch.setattr(function, "sparse_mla_probs_triton", lambda *a, **k: ran.append("probs") or real_probs(*a, **k))
    q, kv, idx = _gpu_inputs(B, T, H, S, K, seed=B * 100 + H + 1)
    q.requires_grad_(True)
    kv.requires_grad_(True)
    scale = 576**-0.5
    assert bd.explain_sparse_mla(q, kv, idx, 512, backward=True, probs_into=True, deterministic=False).kernel == "cudnn"
    before = torch.rand(B, T, K, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    target = before.clone()
    out, lse = sparse_mla(q, kv, idx, scale, 512, probs_into=(target, 0.5))
    assert torch.equal(target, before), "the target is filled by the backward"
    g_out = torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    dq, dkv = torch.autograd.grad((out.float() * g_out).sum(), (q, kv))
    assert ran == ["cudnn", "probs"], ran
    ours = before.clone()
    q0, kv0, out0 = q.detach(), kv.detach(), out.detach()
    dq_o, dkv_o = sparse_mla_bwd_triton(
        q0, kv0, idx, out0, lse.detach(), g_out.to(out.dtype), None, scale, 512, probs_into=(ours, 0.5)
    )
    assert _rel(target - before, ours - before) < 1e-5
    ref = attention_target_naive(q0.float(), kv0.float(), idx, lse.detach(), scale, before.clone(), 0.5)
    assert _rel(target - before, ref - before) < 1e-3
    assert torch.equal(target[0, 1], before[0, 1]), "a query with no key adds nothing"
    assert _rel(dq, dq_o) < 1e-2 and _rel(dkv, dkv_o) < 1e-2


@pytest.mark.gpu
def test_gpu_cudnn_backward_graph_replay_matches_eager():
    """After one eager call (it compiles the kernels), the adapter captures into a CUDA graph; replays agree with
    eager up to the order of fp32 atomics (its dkv is summed with them on sm_90), with every output written."""
    if (why := _cudnn_runs_here()) is not None:
        pytest.skip(why)
    from dsaflow.ops.sparse_mla.triton_prefill import key_extent, sparse_mla_fwd_triton

    q, kv, idx = _gpu_inputs(1, 64, 128, 4096, 2048, seed=7)  # the kernels compiled for the first test above
    scale = 576**-0.5
    n_keys = key_extent(idx, kv.shape[1])
    out, lse = sparse_mla_fwd_triton(q, kv, idx, scale, 512, n_keys=n_keys)
    d_out = torch.randn_like(out)
    run = lambda: cb.sparse_mla_bwd_cudnn(q, kv, idx, out, lse, d_out, scale, 512, n_keys)  # noqa: E731
    eager = run()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(captured[0], eager[0]) < 1e-3 and _rel(captured[1], eager[1]) < 1e-3
