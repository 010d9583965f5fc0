"""flashlite._direct_launch: argument order as Triton's launcher takes it, and when a replay is refused."""
from __future__ import annotations

import types

import pytest
import torch

from flashlite import _direct_launch, _native
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
    """Stands in for a CUDA tensor: a replay reads only the address and the device index (-1: the CPU)."""

    def __init__(self, address: int, device: int = 0) -> None:
        self.address, self.device = address, device

    def data_ptr(self) -> int:
        return self.address

    def get_device(self) -> int:
        return self.device


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
    # The tensors' addresses, as integers, then the recorded non-tensor arguments.
    assert compiled.launches == [(3, 2, 1, "stream0", "function", "metadata", None, None, None, 4096, 8192, 7, "C")]


class _CountingTensor(_AlignedTensor):
    """An _AlignedTensor that counts how often a replay reads its address."""

    def __init__(self, address: int, device: int = 0) -> None:
        super().__init__(address, device)
        self.reads = 0

    def data_ptr(self) -> int:
        self.reads += 1
        return self.address


def test_a_replay_reads_a_repeated_tensor_once_and_passes_its_address_in_every_slot():
    # The launchers' convention: unused slots repeat the first tensor (q), and lse may be out itself.
    compiled = _FakeCompiled()
    hooks = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    recorded = _direct_launch.RecordedLaunch(compiled, (1, 1, 1), [None] * 7 + [5], n_tensors=7, device_index=0,
                                             driver=_FakeDriver(0), hooks=hooks)
    q, k, out = _CountingTensor(4096), _CountingTensor(8192), _CountingTensor(12288)
    assert recorded.launch(q, k, out, out, q, k, q)
    assert compiled.launches[-1][9:] == (4096, 8192, 12288, 12288, 4096, 8192, 4096, 5)
    assert (q.reads, out.reads) == (1, 1) and k.reads == 2  # k's repeat is neither first nor just before
    # A repeat is never a way around the checks: an unaligned or misplaced tensor anywhere refuses the replay.
    assert not recorded.launch(q, k, out, out, q, _AlignedTensor(8200), q)
    assert not recorded.launch(_AlignedTensor(4100), k, out, out, q, k, q)
    assert not recorded.launch(q, k, out, out, q, k, _AlignedTensor(4096, device=-1))
    assert len(compiled.launches) == 1


def _replays_of(tensor_sets: list[tuple], device_index: int) -> list:
    """What each replay passes to the compiled kernel's launcher (None where it was refused)."""
    compiled = _FakeCompiled()
    hooks = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    recorded = _direct_launch.RecordedLaunch(compiled, (2, 3, 1), [None] * 5 + [7, "C"], n_tensors=5,
                                             device_index=device_index, driver=_FakeDriver(device_index), hooks=hooks)
    outcomes = []
    for tensors in tensor_sets:
        launches = len(compiled.launches)
        outcomes.append(compiled.launches[-1] if recorded.launch(*tensors) else None)
        assert len(compiled.launches) == launches + (outcomes[-1] is not None)
    return outcomes


@pytest.mark.skipif(_native.launch_recorded is None, reason=f"no C++ helpers: {_native.build_error}")
def test_the_cpp_replay_passes_and_refuses_what_the_python_replay_does(monkeypatch):
    # Real (CPU) tensors, device index -1: fresh random sets with repeats, unaligned views and other devices.
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    base = [torch.randn(7, 9, generator=generator) for _ in range(3)]
    pool = base + [base[0][0, 1:], torch.randn(4, device="meta"), torch.randn(5, dtype=torch.float16)[1:]]
    tensor_sets = []
    for _ in range(40):
        picks = torch.randint(0, len(pool), (5,), generator=generator).tolist()
        tensor_sets.append(tuple(pool[i] for i in picks))
    tensor_sets.append((base[0], base[1], base[2], base[2], base[0]))  # the launchers' repeats, all aligned
    native = _replays_of(tensor_sets, device_index=-1)
    monkeypatch.setattr(_native, "launch_recorded", None)
    python = _replays_of(tensor_sets, device_index=-1)
    assert native == python
    assert native[-1] is not None and native[-1][9:] == (*(t.data_ptr() for t in tensor_sets[-1]), 7, "C")
    assert any(outcome is None for outcome in native)  # the draws included refusals


@pytest.mark.skipif(_native.launch_recorded is None, reason=f"no C++ helpers: {_native.build_error}")
def test_the_cpp_replay_refuses_tensors_of_another_device_and_passes_the_launchers_error_on():
    tensors = tuple(torch.randn(8, 8) for _ in range(5))
    assert _replays_of([tensors], device_index=0) == [None]  # CPU tensors, a recording on GPU 0
    # The refusal is the C++ helper's own (False), not a hand-over to the Python loop (None).
    assert _native.launch_recorded(lambda *args: None, (1, 1, 1), "stream", "function", "metadata", tensors, 0,
                                   (7,)) is False

    def failing_run(*args):
        raise RuntimeError("launcher failed")

    with pytest.raises(RuntimeError, match="launcher failed"):
        _native.launch_recorded(failing_run, (1, 1, 1), "stream", "function", "metadata", tensors, -1, (7,))


def test_a_replay_is_refused_for_unaligned_tensors_another_device_or_a_launch_hook():
    recorded, compiled = _recorded()
    assert not recorded.launch(_AlignedTensor(4096), _AlignedTensor(8194))  # 2 bytes past alignment
    recorded, compiled = _recorded(device=1)
    assert not recorded.launch(_AlignedTensor(4096), _AlignedTensor(8192))
    recorded, compiled = _recorded()
    assert not recorded.launch(_AlignedTensor(4096), _AlignedTensor(8192, device=1))  # a tensor on another GPU
    assert not recorded.launch(_AlignedTensor(4096, device=-1), _AlignedTensor(8192))  # a CPU tensor
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


class _FakeTensor:
    """Stands in for a CUDA tensor: launches read the address, the device and the dtype."""

    def __init__(self, address: int, dtype=torch.float16, device: int = 0) -> None:
        self.address, self.dtype, self.device = address, dtype, device

    def data_ptr(self) -> int:
        return self.address

    def get_device(self) -> int:
        return self.device


class _FakeKernel:
    def __init__(self) -> None:
        self.ordinary: list[tuple] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.ordinary.append((grid, args, kwargs))


class _FakeRecording:
    def __init__(self, accept: bool = True) -> None:
        self.accept = accept
        self.replayed: list[tuple] = []

    def launch(self, *tensors) -> bool:
        if self.accept:
            self.replayed.append(tensors)
        return self.accept


@pytest.fixture
def recordings(monkeypatch):
    """Every launch a plan records: an ordinary launch plus a fake recording of it."""
    made = []

    def fake_record(kernel, grid, args, kwargs, n_tensors):
        kernel[grid](*args, **kwargs)
        made.append(_FakeRecording())
        return made[-1]

    monkeypatch.setattr(_direct_launch, "record", fake_record)
    return made


def _plan(record=True):
    from flashlite.attn.plan import Plan
    return Plan(None, None, record=record)  # record=True: as a kept plan on CUDA


def _launch_and_replay(plan, kernel, site, tensors, scalars=(7,)):
    """What every launch site of the attention launchers does: replay the plan's recording, else launch."""
    from flashlite.attn import triton as launch
    if not launch._replayed(plan, site, tensors):
        launch._launch(kernel, site, plan, (4, 2), tensors, scalars, {"BLOCK": 64})


def test_a_plan_records_each_launch_site_once_and_replays_it_with_new_tensors(recordings):
    plan, kernel = _plan(), _FakeKernel()
    x, y = _FakeTensor(4096), _FakeTensor(8192)
    _launch_and_replay(plan, kernel, "delta", (x, y))  # recorded (launched once, the ordinary way)
    x2, y2 = _FakeTensor(12288), _FakeTensor(16384)
    _launch_and_replay(plan, kernel, "delta", (x2, y2))  # replayed with new tensors
    assert len(recordings) == 1 and recordings[0].replayed == [(x2, y2)] and len(kernel.ordinary) == 1
    assert kernel.ordinary[0] == ((4, 2), (x, y, 7), {"BLOCK": 64})
    _launch_and_replay(plan, kernel, ("delta", "another layout"), (x, y))  # another site: its own recording
    assert len(recordings) == 2 and set(plan.recorded) == {"delta", ("delta", "another layout")}


def test_refused_unrecordable_and_unkept_launches_go_the_ordinary_way(recordings, monkeypatch):
    plan, kernel = _plan(), _FakeKernel()
    x, y = _FakeTensor(4096), _FakeTensor(8192)
    _launch_and_replay(plan, kernel, "delta", (x, y))
    recordings[0].accept = False  # a recording that refuses (unaligned tensors, another device, a launch hook)
    _launch_and_replay(plan, kernel, "delta", (x, y))
    assert len(kernel.ordinary) == 2 and len(recordings) == 1
    # A launch that cannot be recorded at all is remembered as such and launched the ordinary way after.
    monkeypatch.setattr(_direct_launch, "record", lambda kernel, grid, args, kwargs, n: kernel[grid](*args) or None)
    _launch_and_replay(plan, kernel, "dq", (x, y))
    _launch_and_replay(plan, kernel, "dq", (x, y))
    assert plan.recorded["dq"] is None and len(kernel.ordinary) == 4
    # A plan that is not kept (forced configs, the plan cache full) or lives off CUDA records nothing.
    unkept = _plan(record=False)
    _launch_and_replay(unkept, kernel, "delta", (x, y))
    _launch_and_replay(unkept, kernel, "delta", (x, y))
    assert unkept.recorded == {} and len(kernel.ordinary) == 6


def test_attention_grids():
    from flashlite.attn.triton import _Grid
    assert _Grid(1000, "BLOCK_M", 32)({"BLOCK_M": 128}) == (8, 32)
    assert _Grid(1000, "BLOCK_M", 32)({"BLOCK_M": 128, "BH_PER_PROGRAM": 4}) == (8, 8)
    assert _Grid(100, "BLOCK_N", 70_000)({"BLOCK_N": 64}) == (2 * 70_000,)  # past axis 1's limit: flattened


class _FakeDescriptor:
    """Stands in for a host-side TMA descriptor (Triton's TensorDescriptor): a replay reads only its base."""

    def __init__(self, base) -> None:
        self.base = base


def test_a_replay_passes_tma_descriptors_as_they_are_after_checking_what_they_describe():
    compiled = _FakeCompiled()
    hooks = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    recorded = _direct_launch.RecordedLaunch(compiled, (5, 1, 1), ["old_desc", "old_lse", 16, "C"], n_tensors=2,
                                             device_index=0, driver=_FakeDriver(0), hooks=hooks, descriptors=(0,))
    descriptor, lse = _FakeDescriptor(_AlignedTensor(4096)), _AlignedTensor(8192)
    assert recorded.launch(descriptor, lse)
    # The descriptor itself (the launcher encodes it, as in an ordinary launch), the tensor as its address.
    assert compiled.launches == [(5, 1, 1, "stream0", "function", "metadata", None, None, None, descriptor, 8192,
                                  16, "C")]
    assert not recorded.launch(_FakeDescriptor(_AlignedTensor(4098)), lse)  # the described tensor unaligned
    assert not recorded.launch(_FakeDescriptor(_AlignedTensor(4096, device=1)), lse)  # on another GPU
    assert len(compiled.launches) == 1


def test_record_declines_a_descriptor_of_a_cpu_tensor_and_still_launches():
    launched = []

    class Kernel:
        arg_names = ["desc", "n"]

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(args) or object()

    descriptor = _FakeDescriptor(torch.randn(8))
    assert _direct_launch.record(Kernel(), (1,), (descriptor, 8), {}, n_tensors=1) is None
    assert launched == [(descriptor, 8)]
