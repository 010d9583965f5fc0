"""flashlite._direct_launch: argument order as Triton's launcher takes it, and when a replay is refused."""
from __future__ import annotations

import types

import pytest
import torch

from flashlite import _direct_launch
from flashlite.kernels import attention_fwd


def test_bound_values_follow_the_kernel_signature_with_heuristics_and_defaults():
    # The real forward kernel (interpreted here): EVEN_M comes from its heuristic, BH_PER_PROGRAM from its default.
    kernel = attention_fwd.attn_fwd_fixed
    names = _direct_launch._jit_function(kernel).arg_names
    positional = [f"arg{i}" for i in range(names.index("SEQ_K_BUCKET") + 2)]
    seq_q = 100
    positional[names.index("seq_q")] = seq_q
    meta = dict(HEAD_DIM=64, BLOCK_D=64, CAUSAL=1, KEY_MASK="none", DOT="fp16", FLAT_GRID=False, BLOCK_M=32,
                BLOCK_N=16, num_warps=4, num_stages=2)
    values = _direct_launch._bound_values(kernel, positional, meta)
    by_name = dict(zip(names, values))
    assert len(values) == len(names)
    assert values[:len(positional)] == positional
    assert by_name["EVEN_M"] is False  # 100 rows are not a multiple of BLOCK_M = 32
    assert by_name["BH_PER_PROGRAM"] == 1
    assert by_name["BLOCK_N"] == 16 and "num_warps" not in by_name


class _FakeCompiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self) -> None:
        self.launches: list[tuple] = []

    def run(self, *args) -> None:
        self.launches.append(args)


class _FakeDriver:
    def __init__(self, device: int) -> None:
        self.device = device

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device: int) -> str:
        return f"stream{device}"


class _AlignedTensor:
    """Stands in for a CUDA tensor: a replay reads only the address."""

    def __init__(self, address: int) -> None:
        self.address = address

    def data_ptr(self) -> int:
        return self.address


def _recorded(device: int = 0, hooks=None) -> tuple[_direct_launch.RecordedLaunch, _FakeCompiled]:
    compiled = _FakeCompiled()
    hooks = hooks or types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    recorded = _direct_launch.RecordedLaunch(compiled, (3, 2, 1), ["old_a", "old_b", 7, "C"], n_tensors=2,
                                             device_index=0, driver=_FakeDriver(device), hooks=hooks)
    return recorded, compiled


def test_a_replay_passes_new_tensors_then_the_recorded_arguments():
    recorded, compiled = _recorded()
    a, b = _AlignedTensor(4096), _AlignedTensor(8192)
    assert recorded.launch(a, b)
    # Triton's own default: chains of launch hooks with nothing in them, which a replay may skip.
    from triton import knobs
    recorded, compiled = _recorded(hooks=knobs.runtime)
    a, b = _AlignedTensor(4096), _AlignedTensor(8192)
    assert recorded.launch(a, b)
    assert compiled.launches == [(3, 2, 1, "stream0", "function", "metadata", None, None, None, a, b, 7, "C")]


def test_a_replay_is_refused_for_unaligned_tensors_another_device_or_a_launch_hook():
    recorded, compiled = _recorded()
    assert not recorded.launch(_AlignedTensor(4096), _AlignedTensor(8194))  # 2 bytes past alignment
    recorded, compiled = _recorded(device=1)
    assert not recorded.launch(_AlignedTensor(4096), _AlignedTensor(8192))
    hooks = types.SimpleNamespace(launch_enter_hook=print, launch_exit_hook=None)
    recorded, compiled = _recorded(hooks=hooks)
    assert not recorded.launch(_AlignedTensor(4096), _AlignedTensor(8192))
    chain_with_a_hook = types.SimpleNamespace(calls=[print])
    recorded, compiled = _recorded(hooks=types.SimpleNamespace(launch_enter_hook=types.SimpleNamespace(calls=[]),
                                                               launch_exit_hook=chain_with_a_hook))
    assert not recorded.launch(_AlignedTensor(4096), _AlignedTensor(8192))
    assert compiled.launches == []
    with pytest.raises(TypeError, match="expected 2 tensors"):
        recorded.launch(_AlignedTensor(4096))


def test_record_launches_and_declines_cpu_tensors():
    launched = []

    class Kernel:
        arg_names = ["x", "n", "BLOCK"]

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((grid, args, kwargs))

    x = torch.randn(8)
    assert _direct_launch.record(Kernel(), (1,), (x, 8), {"BLOCK": 16}, n_tensors=1) is None
    assert launched == [((1,), (x, 8), {"BLOCK": 16})]
