"""The plan cache's keys: the C++ forms of attention()'s key and of its key without the key length
(``flashlite._native``) tell calls apart exactly as the one Python key builder (``plan.key_of``) does, cover every
plain call, and leave what they do not cover to the Python key; the C++ replay (keys, lookups and the plan's call
in one) answers as the Python replay does; without a compiler flashlite still runs. Keys of other entries (the flat
launchers, the KV cache) never equal an attention() key, and the custom ops find the plan of the eager call they
stand for."""
import os
import random
import subprocess
import sys

import pytest
import torch

import flashlite.attn.api as api_module
import flashlite.attn.triton as launch_module
import flashlite.attn.plan as plans_module
from flashlite import _native
from flashlite.attention import attention

# Where the launchers run: a GPU, or this CPU through the Triton interpreter (they refuse CPU tensors otherwise).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

ARGUMENT_NAMES = ("q", "k", "v", "key_padding_mask", "key_lengths", "causal", "scale", "backend", "precision",
                  "window", "softcap", "alibi_slopes")


def _tensor(rng: random.Random, sizes: tuple, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Fresh random data; for 4-d sizes sometimes other strides: [B, S, H, D] storage seen as [B, H, S, D]."""
    if len(sizes) == 4 and rng.random() < 0.3:
        b, h, s, d = sizes
        return torch.randn(b, s, h, d, device=device).to(dtype).transpose(1, 2)
    return torch.randn(*sizes, device=device).to(dtype)


def _random_call(rng: random.Random) -> list:
    """Twelve plan-key arguments, each drawn from a few values."""
    batch, heads, kv_heads = rng.choice([1, 2]), rng.choice([2, 4]), rng.choice([1, 2])
    seq, seq_k, dim = rng.choice([5, 8]), rng.choice([5, 9]), rng.choice([16, 32])
    dtype, device = rng.choice([torch.float32, torch.float16]), rng.choice(["cpu", "meta"])
    return [_tensor(rng, (batch, heads, seq, dim), dtype, device),
            _tensor(rng, (batch, kv_heads, seq_k, dim), dtype, device),
            _tensor(rng, (batch, kv_heads, seq_k, dim), dtype, device),
            rng.choice([None, _tensor(rng, (batch, seq_k), torch.bool, device)]),
            rng.choice([None, torch.randint(1, seq_k + 1, (batch,), device=device)]),
            rng.choice([False, True, "lower_right"]), rng.choice([None, 0.25, 0.5]),
            rng.choice(["auto", "sdpa", "triton"]), rng.choice([None, "ieee"]),
            rng.choice([None, (3, 0), (4, 0), (-1, 2)]), rng.choice([None, 30.0, 5.5]),
            rng.choice([None, _tensor(rng, (heads,), torch.float32, device),
                        _tensor(rng, (batch, heads), torch.float32, device)])]


def _other_tensor(rng: random.Random, tensor) -> torch.Tensor:
    """A tensor that differs from ``tensor`` in exactly one of: strides, shape, dtype, device (or being given)."""
    if tensor is None:
        return torch.randn(3)
    change = rng.choice(["strides", "shape", "dtype", "device"])
    if change == "strides":
        wider = torch.randn(*tensor.shape[:-1], tensor.shape[-1] + 3, device=tensor.device).to(tensor.dtype)
        return wider[..., :tensor.shape[-1]]  # the same shape, a longer row stride
    if change == "shape":
        return torch.randn(*tensor.shape[:-1], tensor.shape[-1] + 1, device=tensor.device).to(tensor.dtype)
    if change == "dtype":
        return tensor.to(torch.float64 if tensor.dtype != torch.float64 else torch.float32)
    moved = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                device="cpu" if tensor.device.type == "meta" else "meta")
    return moved.copy_(torch.randn(tensor.shape).to(tensor.dtype)) if moved.device.type == "cpu" else moved


_SCALAR_CHOICES = {"causal": [False, True, "lower_right"], "scale": [None, 0.25, 0.5, 0.125],
                   "backend": ["auto", "sdpa", "triton"], "precision": [None, "ieee", "bf16"],
                   "window": [None, (3, 0), (4, 0), (-1, 2), (3, 1)], "softcap": [None, 30.0, 5.5]}


def _two_calls_changed_in(rng: random.Random, call: list, index: int) -> list[list]:
    """Two calls that differ from ``call`` and from each other in argument ``index`` alone."""
    name = ARGUMENT_NAMES[index]
    if name in _SCALAR_CHOICES:
        values = rng.sample([value for value in _SCALAR_CHOICES[name] if value != call[index]], 2)
    else:
        values = [_other_tensor(rng, call[index]), _other_tensor(rng, call[index])]
    return [call[:index] + [value] + call[index + 1:] for value in values]


needs_native = pytest.mark.skipif(_native.plan_key is None, reason=f"no C++ plan key: {_native.build_error}")


@needs_native
def test_the_cpp_key_tells_calls_apart_exactly_as_the_python_key_does():
    rng = random.Random()  # fresh draws every run; a failure prints the calls that disagree
    calls = []
    for _ in range(6):
        base = _random_call(rng)
        # The same signature with fresh data (equal keys), and two calls per argument that differ in it alone.
        calls += [base, [a.clone() if isinstance(a, torch.Tensor) else a for a in base]]
        calls += [changed for index in range(len(ARGUMENT_NAMES))
                  for changed in _two_calls_changed_in(rng, base, index)]
    native = [_native.plan_key(*call) for call in calls]
    python = [plans_module.key_of("attention", *call) for call in calls]
    assert all(isinstance(key, bytes) for key in native), "every plain call is covered by the C++ key"
    disagreements = [(i, j) for i in range(len(calls)) for j in range(i)
                     if (native[i] == native[j]) != (python[i] == python[j])]
    assert not disagreements, [[dict(zip(ARGUMENT_NAMES, calls[n])) for n in pair] for pair in disagreements[:2]]
    assert len(set(python)) == len(set(native)) > 6 * 13  # the draws really varied the signatures


class _SubTensor(torch.Tensor):
    pass


@needs_native
@pytest.mark.parametrize("field, value", [
    ("causal", 1),  # an int, which validation refuses although 1 == True
    ("scale", 1),  # an int scale
    ("scale", torch.tensor(0.5).numpy()[()]),  # a numpy float, not exactly a float
    ("window", (True, 0)),  # a bool side, which validation refuses although True == 1
    ("window", [3, 0]),
    ("softcap", 30),
    ("backend", None),
    ("q", "subclass"),
    ("key_lengths", "sparse"),
])
def test_what_the_cpp_key_does_not_cover_is_left_to_the_python_key(field, value):
    call = _random_call(random.Random())
    index = ARGUMENT_NAMES.index(field)
    if value == "subclass":
        value = call[index].as_subclass(_SubTensor)
    elif value == "sparse":
        value = torch.ones(call[0].shape[0], dtype=torch.int64).to_sparse()
    call[index] = value
    assert _native.plan_key(*call) is None


@needs_native
def test_attention_keys_its_plans_in_cpp_and_subclasses_in_python(monkeypatch):
    monkeypatch.setattr(plans_module, "_PLANS", {})
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    expected = attention(q, k, v, causal=True, backend="sdpa")
    (key,) = plans_module._PLANS
    assert isinstance(key, bytes)
    out = attention(*(t.as_subclass(_SubTensor) for t in (q, k, v)), causal=True, backend="sdpa")
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert sorted(type(key).__name__ for key in plans_module._PLANS) == ["PlanKey", "bytes"]


def test_a_window_side_given_as_a_bool_is_refused_after_its_int_twin_made_a_plan(monkeypatch):
    # The Python key once held the window's value and class but not its sides' classes: (True, 0) == (1, 0), so a
    # call that validation must refuse replayed the plan made for (1, 0).
    monkeypatch.setattr(plans_module, "_PLANS", {})
    _python_key_alone(monkeypatch)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    attention(q, k, v, causal=True, window=(1, 0), backend="sdpa")
    with pytest.raises(TypeError, match="window must be None or"):
        attention(q, k, v, causal=True, window=(True, 0), backend="sdpa")


def _python_key_alone(monkeypatch) -> None:
    """Key, keep and replay every plan with the Python key, as flashlite does without the extension."""
    monkeypatch.setattr(plans_module, "_packed_key", None)
    monkeypatch.setattr(plans_module, "_packed_any_length_key", None)
    monkeypatch.setattr(plans_module, "_packed_fields_key", None)
    monkeypatch.setattr(api_module, "_replay", plans_module._replay_in_python)


class _RecordingPlan:
    """A stand-in plan whose run returns a fresh tensor and records the arguments it was given."""

    def __init__(self) -> None:
        self.calls = []

    def run(self, *args):
        self.calls.append(args)
        return torch.randn(2)


@needs_native
def test_the_cpp_replay_runs_the_plan_the_python_replay_runs_with_the_same_arguments():
    rng = random.Random()
    for _ in range(20):
        call = _random_call(rng)
        native_plan, python_plan = _RecordingPlan(), _RecordingPlan()
        native_out = _native.replay({_native.plan_key(*call): native_plan}, plans_module.replay_by_python_key, *call)
        python_out = plans_module.replay_by_python_key({plans_module.key_of("attention", *call): python_plan}, *call)
        assert isinstance(native_out, torch.Tensor) and isinstance(python_out, torch.Tensor)
        (native_args,), (python_args,) = native_plan.calls, python_plan.calls
        # q, k, v, the key mask (key_lengths when given, else key_padding_mask), then the slopes when given; C++
        # leaves trailing Nones off.
        expected = call[:3] + [call[3] if call[4] is None else call[4]] + ([] if call[11] is None else [call[11]])
        assert len(python_args) == len(expected)
        assert all(a is b for a, b in zip(python_args, expected))
        trimmed = expected[:3] + [t for t in expected[3:] if t is not None] if call[11] is None else expected
        assert len(native_args) == len(trimmed) and all(a is b for a, b in zip(native_args, trimmed))


@needs_native
def test_the_cpp_replay_answers_none_without_a_plan_and_hands_uncovered_calls_to_the_fallback():
    call = _random_call(random.Random())
    other = [a.clone() if isinstance(a, torch.Tensor) else a for a in call]
    other[6] = 0.0625  # another scale: another key
    plans = {_native.plan_key(*other): _RecordingPlan()}
    assert _native.replay(plans, plans_module.replay_by_python_key, *call) is None
    call[6] = 1  # an int scale: the C++ key does not cover it, the fallback gets plans and the twelve arguments
    seen = []
    sentinel = torch.randn(3)
    assert _native.replay(plans, lambda *args: seen.append(args) or sentinel, *call) is sentinel
    (args,) = seen
    assert args[0] is plans and all(a is b for a, b in zip(args[1:], call)) and len(args) == 13
    with pytest.raises(TypeError, match="replay takes a dict"):
        _native.replay([], plans_module.replay_by_python_key, *call)


@needs_native
def test_an_error_in_the_plans_run_reaches_the_caller_through_the_cpp_replay():
    call = _random_call(random.Random())

    class _FailingPlan:
        def run(self, *args):
            raise RuntimeError("the plan's own error")

    with pytest.raises(RuntimeError, match="the plan's own error"):
        _native.replay({_native.plan_key(*call): _FailingPlan()}, plans_module.replay_by_python_key, *call)


def _without_key_length(call: list, seq_k: int) -> list:
    """``call`` with k, v (and key_padding_mask) cut to their first ``seq_k`` keys."""
    cut = list(call)
    cut[1], cut[2] = call[1][:, :, :seq_k], call[2][:, :, :seq_k]
    if call[3] is not None:
        cut[3] = call[3][:, :seq_k]
    return cut


@needs_native
def test_the_cpp_key_without_the_key_length_tells_calls_apart_as_the_python_one_does(monkeypatch):
    rng = random.Random()
    calls, pairs = [], []
    for _ in range(6):
        base = _random_call(rng)
        # Another key length (same bucket) must give the same key; every other change, another key.
        pairs.append(len(calls))
        calls += [base, _without_key_length(base, base[1].shape[2] - 1)]
        calls += [changed for index in range(len(ARGUMENT_NAMES)) for changed in _two_calls_changed_in(rng, base, index)
                  if changed[1].dim() == 4 and changed[1].shape == changed[2].shape
                  and (changed[3] is None or changed[3].shape[1:] == changed[1].shape[2:3])]
    native = [plans_module.any_length_key(*call) for call in calls]
    monkeypatch.setattr(plans_module, "_packed_any_length_key", None)
    python = [plans_module.any_length_key(*call) for call in calls]
    assert all(isinstance(key, bytes) for key in native) and not any(isinstance(key, bytes) for key in python)
    assert all(plans_module.entry_of(key) == "attention/any_key_length" for key in native + python)
    disagreements = [(i, j) for i in range(len(calls)) for j in range(i)
                     if (native[i] == native[j]) != (python[i] == python[j])]
    assert not disagreements, [[dict(zip(ARGUMENT_NAMES, calls[n])) for n in pair] for pair in disagreements[:2]]
    assert all(native[i] == native[i + 1] for i in pairs)


@needs_native
def test_the_cpp_replay_finds_a_plan_of_every_key_length_only_for_calls_whose_keys_agree():
    q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 40, 16)
    call = [q, k, k.clone(), None, None, "lower_right", None, "sdpa", None, None, None, None]
    plan = _RecordingPlan()
    plans = {plans_module.any_length_key(*call): plan}
    shorter = _without_key_length(call, 33)
    assert _native.replay(plans, plans_module.replay_by_python_key, *shorter) is not None
    assert [len(args) for args in plan.calls] == [3] and plan.calls[0][1] is shorter[1]
    mismatched = shorter[:2] + [call[2]] + shorter[3:]  # v of another key length than k: validation's to refuse
    assert _native.replay(plans, plans_module.replay_by_python_key, *mismatched) is None
    longer = [q, torch.randn(1, 2, 65, 16), torch.randn(1, 2, 65, 16)] + call[3:]  # another bucket of the table
    assert _native.replay(plans, plans_module.replay_by_python_key, *longer) is None


def test_an_attention_call_never_replays_a_launcher_plan(monkeypatch):
    # Launcher plans share the plan cache with attention()'s, under the "launcher" entry: they have no run, so an
    # attention() call that passes the launcher's values must never find one. It is validated and refused instead.
    monkeypatch.setattr(plans_module, "_PLANS", {})
    q, k, v = (torch.randn(1, 2, 8, 16, device=DEVICE) for _ in range(3))
    plan = launch_module._launcher_plan(q, k, v, None, None, 1, 0.25, "ieee", -1, -1, 0.0, None, {})
    (key,) = plans_module._PLANS
    assert plans_module.entry_of(key) == "launcher"
    fresh = (torch.randn(1, 2, 8, 16, device=DEVICE) for _ in range(3))
    assert launch_module._launcher_plan(*fresh, None, None, 1, 0.25, "ieee", -1, -1, 0.0, None, {}) is plan
    with pytest.raises(ValueError):
        attention(q, k, v, causal=True, scale=0.25, backend="launcher", precision="ieee", window=(-1, -1),
                  softcap=0.0)


def test_the_ops_run_the_plan_of_the_eager_call_they_stand_for(monkeypatch):
    # A compiled graph's op and the eager call with the same meaning share one plan: the op finds it under the
    # eager call's key (its flat defaults read as attention()'s), or makes it there for the eager call to find.
    monkeypatch.setattr(plans_module, "_PLANS", {})
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=gen).to(DEVICE) for _ in range(3))
    with torch.no_grad():
        expected = attention(q, k, v, causal=True, backend="triton", precision="ieee")
        (plan,) = plans_module._PLANS.values()
        out = torch.ops.flashlite.attention_inference(q, k, v, None, None, 1, 0.25, "ieee")
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        out, lse = torch.ops.flashlite.attention_forward(q, k, v, None, None, 1, 0.25, "ieee")
        assert list(plans_module._PLANS.values()) == [plan]
        monkeypatch.setattr(plans_module, "_PLANS", {})
        torch.ops.flashlite.attention_inference(q, k, v, None, None, 2, 0.5, "ieee", 3, -1, 30.0)
        (key,) = plans_module._PLANS
        assert key == plans_module.attention_key(q, k, v, None, None, "lower_right", 0.5, "triton", "ieee", (3, -1),
                                                 30.0, None)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_keys_of_two_entries_never_equal():
    q = torch.randn(1, 2, 4, 16)
    fields = (q, q, q, None, None, True, None, "auto", None, None, None, None)
    keys = [plans_module.key_of(entry, *fields) for entry in ("attention", "launcher", "kvcache", "varlen")]
    assert len(set(keys)) == 4 and [plans_module.entry_of(key) for key in keys] == [
        "attention", "launcher", "kvcache", "varlen"]


def test_attention_replays_with_the_python_key_alone_as_with_the_cpp_key(monkeypatch):
    q, k, v = (torch.randn(2, 4, 9, 16) for _ in range(3))
    lengths = torch.tensor([9, 5])
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=(torch.arange(9) < lengths[:, None])[:, None, None, :])
    for python_alone in (False, True):
        monkeypatch.setattr(plans_module, "_PLANS", {})
        if python_alone:
            _python_key_alone(monkeypatch)
        outs = [attention(q, k, v, key_lengths=lengths, backend="sdpa") for _ in range(3)]
        # The plan serves every key length, so it is kept by its key without the key length too.
        (key,) = (key for key in plans_module._PLANS if plans_module.entry_of(key) == "attention")
        assert isinstance(key, plans_module.PlanKey if python_alone or _native.plan_key is None else bytes)
        for out in outs:
            torch.testing.assert_close(out, expected)


def test_without_a_compiler_flashlite_keys_plans_in_python_and_says_why(tmp_path):
    script = (
        "import logging; logging.basicConfig(level=logging.WARNING)\n"
        "import torch\n"
        "from flashlite import _native\n"
        "from flashlite.attention import attention\n"
        "q = torch.randn(1, 2, 8, 16)\n"
        "out = attention(q, q, q, causal=True, backend='sdpa')\n"
        "ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)\n"
        "print(_native.plan_key is None, torch.equal(out, ref), _native.build_error)\n"
    )
    env = {**os.environ, "CXX": "/bin/false", "FLASHLITE_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("True True RuntimeError: /bin/false failed (1)"), done.stdout
    assert "the C++ plan key is not available, plans are keyed in Python" in done.stderr
    assert not list(tmp_path.glob("*.so"))  # nothing half-built is left to load


@needs_native
def test_key_of_packs_in_cpp_with_every_class_kept_and_python_keys_what_it_does_not_cover():
    # key_of's packed form must tell apart exactly what the Python key tells apart: 1, 1.0 and True (validation
    # refuses some of them), a tuple's items by class, two entries, two layouts; and leave to Python what it cannot
    # read (a torch.Size, a dtype object, a tensor subclass), never packing such a call by less than it needs.
    q = torch.randn(2, 3, 5, 7)
    variants = [1, 1.0, True, False, None, "1", (1, 0), (True, 0), (1.0, 0), ((1, 2), 3), -2 ** 63]
    packed = [plans_module.key_of("kvcache", q, value) for value in variants]
    python = [plans_module.python_key_of("kvcache", q, value) for value in variants]
    assert all(isinstance(key, bytes) for key in packed) and all(isinstance(k, plans_module.PlanKey) for k in python)
    assert len(set(packed)) == len(variants) == len(set(python))
    assert plans_module.key_of("kvcache", q, 1) == plans_module.key_of("kvcache", torch.randn(2, 3, 5, 7), 1)
    assert plans_module.key_of("kvcache", q, 1) != plans_module.key_of("kvcache", q.transpose(1, 2), 1)
    assert plans_module.key_of("kvcache", q, 1) != plans_module.key_of("varlen", q, 1)
    assert plans_module.key_of("kvcache", q, 1) != plans_module.key_of("kvcache", q.half(), 1)
    assert [plans_module.entry_of(plans_module.key_of(entry, q)) for entry in ("kvcache", "varlen", "launcher")] == [
        "kvcache", "varlen", "launcher"]
    for uncovered in (q.shape, torch.float32, q.as_subclass(_SubTensor), 2 ** 64, [1, 2]):
        key = plans_module.key_of("kvcache", q, uncovered)
        assert key is None or isinstance(key, plans_module.PlanKey), uncovered


@needs_native
def test_a_cache_call_is_keyed_in_cpp_and_replays_its_plan_with_new_lengths(monkeypatch):
    from flashlite.attention import attention_with_kvcache
    monkeypatch.setattr(plans_module, "_PLANS", {})
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 1, 16, generator=gen)
    k_cache, v_cache = (torch.randn(2, 2, 21, 16, generator=gen) for _ in range(2))
    outs = []
    for lengths in ([5, 21], [6, 1]):
        lengths = torch.tensor(lengths, dtype=torch.int32)
        outs.append(attention_with_kvcache(q, k_cache, v_cache, lengths, backend="sdpa"))
        hidden = torch.arange(21)[None, :] >= lengths[:, None]
        expected = torch.nn.functional.scaled_dot_product_attention(
            q.double(), k_cache.double(), v_cache.double(), attn_mask=~hidden[:, None, None, :], enable_gqa=True)
        torch.testing.assert_close(outs[-1], expected.float())
    (key,) = plans_module._PLANS
    assert isinstance(key, bytes) and plans_module.entry_of(key) == "kvcache"
