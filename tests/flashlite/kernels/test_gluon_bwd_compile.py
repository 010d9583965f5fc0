"""The Gluon backward (dK/dV and dQ) builds for sm_90 on any machine, within Hopper's resources; its launcher's
checks and the rule that routes ``flashlite.attention``'s backward to it.

As for the forward (test_gluon_compile.py): each compile runs in a fresh interpreter with TRITON_INTERPRET=0,
specialized as the launcher would (descriptors built by ``dkdv_kernel_arguments`` over CPU tensors, GQA with 4
query heads on 2 key/value heads). For each kernel (``KERNELS``: dK/dV single-partition, dQ warp-specialized), the
first config is compiled in bf16 in every causal mode and in fp16 top-left, the others in bf16 bottom-right; each
must fit the 227 KB of shared memory and 255 registers without spilling, and without ptxas serializing its wgmmas
(it notes that, and then waits out every wgmma of the kernel: the backward configs it happened to lost
0.61-0.91x), as ptxas reports them. The warp-specialized dQ kernel's PTX must also show the register split its
partitions asked for, a named barrier of its own for each consumer warpgroup, and no barrier of the whole block
inside the partitions.
"""
import importlib
import json
import math

import pytest
import torch

from flashlite.attn import gluon as launch_gluon, gluon_bwd as launch_gluon_bwd
from flashlite.attn.problem import validate
from tests.flashlite.sm90 import GLUON_COMPILER, run_script
from tests.flashlite.kernels.test_gluon_compile import HOPPER_SHARED_MEMORY, needs_gluon

_COMPILE = GLUON_COMPILER + r'''
import json
import torch
from flashlite.attn import gluon_bwd as launch_gluon_bwd

def compile_config(config, dtype, head_dim, causal):
    q = torch.empty(2, 4, 300, head_dim, dtype=dtype)
    k = torch.empty(2, 2, 300, head_dim, dtype=dtype)
    lse = torch.empty(2, 4, 300)
    if config.kernel == "dq":
        args, meta = launch_gluon_bwd.dq_kernel_arguments(q, k, k, q, q, lse, lse, causal, 0.125, config)
    else:
        args, meta = launch_gluon_bwd.dkdv_kernel_arguments(q, k, k, q, k, k, lse, lse, causal, 0.125, config)
    fn = launch_gluon_bwd.kernel_for(config)
    options = {"num_warps": config.num_warps}
    if "maxnreg" in meta:
        options["maxnreg"] = meta["maxnreg"]
    kernel, registers, spills, serialized = compile_gluon(fn, args, meta, options)
    ptx = kernel.asm["ptx"]
    return {"kernel": config.kernel, "shared": kernel.metadata.shared,
            "tiles": config.shared_bytes(head_dim), "registers": registers, "spill_bytes": spills,
            "wgmma_serialized": serialized,
            "setmaxnreg": sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))),
            "named_barriers": sorted(set(re.findall(r"\bbar\.sync\s+(\d+),\s*(\d+);", ptx))),
            "whole_cta_barriers": len(re.findall(r"\bbar\.sync\s+\d+;", ptx))}

jobs = []
for kind in launch_gluon_bwd.KERNELS:
    default, *others = launch_gluon_bwd.bwd_configs_for(HEAD_DIM, kind)
    jobs += [(default, torch.bfloat16, causal) for causal in (0, 1, 2)] + [(default, torch.float16, 1)]
    jobs += [(config, torch.bfloat16, 2) for config in others]
for config, dtype, causal in jobs:
    result = compile_config(config, dtype, HEAD_DIM, causal)
    print(json.dumps({"config": str(config), "dtype": str(dtype), "causal": causal, **result}))
'''


@needs_gluon
@pytest.mark.parametrize("head_dim", list(launch_gluon_bwd._kernels.HEAD_DIMS))
def test_every_backward_config_compiles_for_sm90_within_resources(head_dim, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    results = [json.loads(line) for line in run_script(f"HEAD_DIM = {head_dim}\n" + _COMPILE).splitlines()
               if line.startswith("{")]
    kernels = launch_gluon_bwd.KERNELS
    listed = sum(len(launch_gluon_bwd.bwd_configs_for(head_dim, kind)) for kind in kernels)
    assert len(results) == 4 * len(kernels) + listed - len(kernels), results
    assert {r["kernel"] for r in results} == set(kernels)
    consumer = str(launch_gluon_bwd._kernels.BWD_CONSUMER_REGS.value)
    producer = str(launch_gluon_bwd._kernels.PRODUCER_REGS.value)
    for r in results:
        where = f"D={head_dim} {r}"
        assert r["tiles"] <= r["shared"] <= HOPPER_SHARED_MEMORY, where
        assert r["shared"] < r["tiles"] + 1024, where  # the tiles and their barriers, nothing else
        assert r["registers"] and max(r["registers"]) <= 255, where  # no report would be a silent pass
        assert r["spill_bytes"] and not any(r["spill_bytes"]), where
        assert r["wgmma_serialized"] == [], where  # ptxas waits out every wgmma of a kernel it serializes
        if r["kernel"] == "dq":  # warp-specialized
            # Consumer 0 (the default partition) gives registers up down to 240, consumer 1 takes 240, the
            # producer's warpgroup goes down to 24: Triton emits none of them when the split does not fit.
            assert {("dec", consumer), ("inc", consumer), ("dec", producer)} <= set(map(tuple, r["setmaxnreg"])), where
            # Each consumer's barrier before it hands a slot back is a named barrier of its own 128 threads; one
            # id shared by both would let 128 threads of the two warpgroups together pass it.
            assert len({name for name, threads in r["named_barriers"] if threads == "128"}) >= 2, where
            assert r["whole_cta_barriers"] == 0, where  # it would wait for warps that never come to it


def _bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


def test_gluon_attention_dkdv_names_what_it_refuses():
    q = _bf16(1, 2, 16, 64)
    with pytest.raises(ValueError, match="the Gluon attention backward cannot run this call: tensors on cpu"):
        launch_gluon_bwd.gluon_attention_dkdv(q, q, q, q, q, torch.zeros(1, 2, 16))
    with pytest.raises(ValueError, match="head dim 96"):
        launch_gluon_bwd.gluon_attention_dkdv(*[_bf16(1, 2, 16, 96)] * 5, torch.zeros(1, 2, 16))


def test_the_gluon_backward_needs_the_switch_a_dense_call_and_one_the_kernel_can_run(monkeypatch):
    q = _bf16(2, 4, 64, 64)
    dense = validate(q, q, q, True, None, None, None, "triton", None)
    lengths = torch.full((2,), 40, dtype=torch.int32)
    masked = validate(q, q, q, True, None, None, lengths, "triton", None)
    windowed = validate(q, q, q, True, None, None, None, "triton", None, (16, 0))
    monkeypatch.setattr(launch_gluon, "GLUON_ENABLED", True)
    monkeypatch.setattr(launch_gluon_bwd, "measured_faster", lambda problem: True)  # the size rule stood in
    assert not launch_gluon_bwd.backward_on_gluon(dense, q, q, q)  # CPU tensors: gluon_supported refuses
    monkeypatch.setattr(launch_gluon_bwd, "gluon_supported", lambda *a, **kw: None)
    assert launch_gluon_bwd.backward_on_gluon(dense, q, q, q)
    assert not launch_gluon_bwd.backward_on_gluon(masked, q, q, q)
    assert not launch_gluon_bwd.backward_on_gluon(windowed, q, q, q)
    monkeypatch.setattr(launch_gluon, "GLUON_ENABLED", False)  # FLASHLITE_GLUON=0: forward and backward
    assert not launch_gluon_bwd.backward_on_gluon(dense, q, q, q)


def test_the_gluon_backward_runs_only_where_it_measured_faster(monkeypatch):
    # bf16 at head dim 128, causal, S_q == S_k >= 4,096, where an 8ca4529 run measured it (1.10-1.16x the pointer
    # backward there, 0.87-0.91x at D=64); the pointer backward elsewhere, and everywhere with FLASHLITE_GLUON=0.
    # gluon_supported is stood in (the kernels need an sm_90 GPU).
    monkeypatch.setattr(launch_gluon_bwd, "gluon_supported", lambda *a, **kw: None)
    monkeypatch.setattr(launch_gluon, "GLUON_ENABLED", True)

    def decided(S_q, S_k, D, causal, H_kv=4, dtype=torch.bfloat16):
        q = torch.empty(1, 4, S_q, D, dtype=dtype)
        k = v = torch.empty(1, H_kv, S_k, D, dtype=dtype)
        return launch_gluon_bwd.backward_on_gluon(validate(q, k, v, causal, None, None, None, "triton", None), q, k, v)
    assert decided(4096, 4096, 128, True) and decided(8200, 8200, 128, "lower_right")
    assert decided(4096, 4096, 128, True, H_kv=2)
    assert not decided(4095, 4095, 128, True)  # shorter: not measured
    assert not decided(4096, 8192, 128, True) and not decided(8192, 4096, 128, "lower_right")  # S_q != S_k: nor
    assert not decided(4096, 4096, 64, True)  # D=64: the pointer backward measured faster
    assert not decided(4096, 4096, 128, False)  # non-causal: not measured
    assert not decided(4096, 4096, 128, True, dtype=torch.float16)  # fp16: not measured
    monkeypatch.setattr(launch_gluon, "GLUON_ENABLED", False)  # FLASHLITE_GLUON=0
    assert not decided(4096, 4096, 128, True)


def test_explain_dispatch_names_the_backward_kernels(monkeypatch):
    # A Triton call whose gradient autograd computes: the reason says where its backward runs; calls without a
    # gradient, calls the rule leaves on the pointer kernels and calls with FLASHLITE_GLUON=0 say nothing of a
    # backward.
    from flashlite.attention import explain_dispatch
    monkeypatch.setattr(importlib.import_module("flashlite.attn.plan"), "_PLANS", {})
    monkeypatch.setattr(launch_gluon_bwd, "gluon_supported", lambda *a, **kw: None)
    monkeypatch.setattr(launch_gluon, "GLUON_ENABLED", True)
    q = torch.randn(1, 2, 4096, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        assert "backward" not in explain_dispatch(q, q, q, causal=True, backend="triton").reason
    leaf = q.clone().requires_grad_()
    reason = explain_dispatch(leaf, leaf, leaf, causal=True, backend="triton").reason
    assert ("backward: dK/dV on the Gluon kernel, dQ on the warp-specialized Gluon kernel" in reason
            and "measured faster than the pointer backward for bf16, D=128, causal, S_q == S_k >= 4096" in reason
            and "FLASHLITE_GLUON=0 turns it off" in reason), reason
    short = torch.randn(1, 2, 333, 128, dtype=torch.bfloat16, requires_grad=True)
    assert "backward" not in explain_dispatch(short, short, short, causal=True, backend="triton").reason
    monkeypatch.setattr(importlib.import_module("flashlite.attn.plan"), "_PLANS", {})
    monkeypatch.setattr(launch_gluon, "GLUON_ENABLED", False)
    assert "backward" not in explain_dispatch(leaf, leaf, leaf, causal=True, backend="triton").reason


def test_a_plan_decides_the_backward_kernels_when_it_is_made(monkeypatch):
    # The plan asks backward_on_gluon once, when it is made (here by the forward launcher call), and every backward
    # of its signature follows that choice; the Gluon launch is stood in. A fresh plan cache, so that no earlier
    # test's plan of the same signature has decided already.
    launch_module = importlib.import_module("flashlite.attn.triton")
    launch_bwd_module = importlib.import_module("flashlite.attn.triton_bwd")
    plans_module = importlib.import_module("flashlite.attn.plan")
    monkeypatch.setattr(plans_module, "_PLANS", {})
    calls, launched = [], []
    monkeypatch.setattr(launch_gluon_bwd, "backward_on_gluon", lambda *a: calls.append(1) or True)

    def fake_dkdv(q, k, v, grad_out, lse, delta, dk, dv, causal_mode, scale):
        launched.append(causal_mode)
        dk.fill_(3.0)
        dv.fill_(5.0)
    monkeypatch.setattr(launch_gluon_bwd, "launch_dkdv", fake_dkdv)

    def fake_dq(q, k, v, grad_out, lse, delta, dq, causal_mode, scale):
        launched.append("dq")
        dq.fill_(7.0)
    monkeypatch.setattr(launch_gluon_bwd, "launch_dq", fake_dq)
    if not launch_module._runtime.interpreting():
        pytest.skip("the pointer kernels' delta and dQ need the Triton interpreter (TRITON_INTERPRET=1) here")
    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    out, lse = launch_module.attention_forward(q, k, v, None, None, 1, 0.25, "ieee")
    assert calls == [1]  # decided when the plan was made
    grad_out = torch.randn_like(q)
    dq, dk, dv = launch_bwd_module.attention_backward(grad_out, q, k, v, out, lse, None, None, 1, 0.25, "ieee")
    assert launched == [1, "dq"] and calls == [1]
    assert torch.all(dq == 7.0) and torch.all(dk == 3.0) and torch.all(dv == 5.0)
    launch_bwd_module.attention_backward(grad_out, q, k, v, out, lse, None, None, 1, 0.25, "ieee")
    assert calls == [1]  # kept on the plan
    # The same signature at a base address 4 bytes past a 16-byte boundary: the plan's choice stands, but this
    # call takes the pointer kernel (TMA needs aligned bases).
    unaligned = torch.empty(q.numel() + 1)[1:].view(q.shape).copy_(q)
    _, dk_unaligned, _ = launch_bwd_module.attention_backward(grad_out, unaligned, k, v, out, lse, None, None, 1, 0.25,
                                                          "ieee")
    assert launched == [1, "dq"] * 2 and not torch.all(dk_unaligned == 3.0)
    # A plan made where the rule refuses the Gluon kernels runs the pointer backward.
    monkeypatch.setattr(plans_module, "_PLANS", {})
    monkeypatch.setattr(launch_gluon_bwd, "backward_on_gluon", lambda *a: calls.append(2) or False)
    _, dk_pointer, _ = launch_bwd_module.attention_backward(grad_out, q, k, v, out, lse, None, None, 1, 0.25, "ieee")
    assert calls == [1, 2] and not torch.all(dk_pointer == 3.0) and launched == [1, "dq"] * 2


class _RecordedLaunch:
    """Stands in for a Gluon kernel: ``kernel[grid](*args, **meta)`` records what a launch would have run."""

    def __init__(self, name, launches):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launches.append((self.name, grid, meta))


@needs_gluon
def test_each_kernel_launches_over_its_own_grid(monkeypatch):
    # A dQ program covers two consumers' rows, so its grid has half the programs of its rows per warpgroup, and it
    # launches with the register cap its partitions' split needs; a dK/dV program covers its own rows. Without a
    # config, the launchers take each kernel's first.
    launches = []
    kernels = launch_gluon_bwd._kernels
    for name in ("_attn_bwd_dkdv", "_attn_bwd_dq_ws"):
        monkeypatch.setattr(kernels, name, _RecordedLaunch(name, launches))
    q, k = _bf16(2, 4, 333, 64), _bf16(2, 2, 333, 64)
    lse = torch.zeros(2, 4, 333)
    dq_config = launch_gluon_bwd.bwd_configs_for(64, "dq")[0]
    assert dq_config.program_rows == 2 * dq_config.own_rows
    for config in launch_gluon_bwd.bwd_configs_for(64, "dq"):
        launch_gluon_bwd.launch_dq(q, k, k, q, lse, lse, torch.empty_like(q), 2, 0.125, config)
        name, grid, meta = launches.pop()
        assert (name, grid) == ("_attn_bwd_dq_ws", (math.ceil(333 / (2 * config.own_rows)), 8))
        assert meta["maxnreg"] == kernels.BWD_WS_MAXNREG and meta["BLOCK_M"] == config.own_rows
    launch_gluon_bwd.launch_dkdv(q, k, k, q, lse, lse, torch.empty_like(k), torch.empty_like(k), 1, 0.125)
    launch_gluon_bwd.launch_dq(q, k, k, q, lse, lse, torch.empty_like(q), 1, 0.125)
    assert [name for name, _, _ in launches] == ["_attn_bwd_dkdv", "_attn_bwd_dq_ws"]
    dkdv = launch_gluon_bwd.bwd_configs_for(64, "dkdv")[0]
    assert launches[0][1] == (math.ceil(333 / dkdv.own_rows), 4) and launches[0][2]["BLOCK_N"] == dkdv.own_rows
    assert "maxnreg" not in launches[0][2]
    assert launches[1][2]["BLOCK_M"] == dq_config.own_rows


@needs_gluon
def test_configs_are_listed_per_kernel_and_refused_across_kernels(monkeypatch):
    with pytest.raises(ValueError, match="kernel must be one of"):
        launch_gluon_bwd.bwd_configs_for(64, "dq_ws")
    dq_config = launch_gluon_bwd.bwd_configs_for(128, "dq")[0]
    # A config of the other kernel is refused by name (the call's own checks, which CPU tensors fail, stood in).
    q = _bf16(1, 2, 16, 128)
    monkeypatch.setattr(launch_gluon_bwd, "_checked", lambda grad_out, *a: (grad_out, None, 0.125))
    with pytest.raises(ValueError, match="is not listed for the dK/dV kernel at head dim 128"):
        launch_gluon_bwd.gluon_attention_dkdv(q, q, q, q, q, torch.zeros(1, 2, 16), config=dq_config)
    dkdv_config = launch_gluon_bwd.bwd_configs_for(128, "dkdv")[0]
    with pytest.raises(ValueError, match="is not listed for the dQ kernel at head dim 128"):
        launch_gluon_bwd.gluon_attention_dq(q, q, q, q, q, torch.zeros(1, 2, 16), config=dkdv_config)
