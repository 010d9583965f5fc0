"""flashlite's on/off environment switches are read one way (flashlite._env.flag): "false", "off" and "no" turn a
switch off, a value it cannot read is refused by name, and TRITON_INTERPRET means to flashlite what it means to
Triton. Before, every switch tested for "not 0", so FLASHLITE_GLUON=false turned the Gluon kernel on, and
TRITON_INTERPRET=false made flashlite hand CPU tensors to compiled kernels."""
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashlite
from flashlite import _env, _native, _runtime
from flashlite.attn import decide, problem as validation, triton as launch
from flashlite.dispatch import Decision

SWITCH = "FLASHLITE_TEST_SWITCH"


@pytest.mark.parametrize("value, expected", [("1", True), ("true", True), ("YES", True), (" On ", True),
                                             ("0", False), ("false", False), ("No", False), ("OFF", False),
                                             ("", False), ("  ", False)])
def test_flag_reads_on_and_off_words(monkeypatch, value, expected):
    monkeypatch.setenv(SWITCH, value)
    assert _env.flag(SWITCH, not expected) is expected


@pytest.mark.parametrize("default", [True, False])
def test_flag_unset_takes_its_default(monkeypatch, default):
    monkeypatch.delenv(SWITCH, raising=False)
    assert _env.flag(SWITCH, default) is default


@pytest.mark.parametrize("value", ["2", "maybe", "enabled", "0.0", "truee"])
def test_flag_refuses_other_values_by_name(monkeypatch, value):
    monkeypatch.setenv(SWITCH, value)
    with pytest.raises(ValueError, match=f"{SWITCH}={value!r} is not an on/off value: use one of 1, true"):
        _env.flag(SWITCH, True)


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_import_time_switches_read_false_as_off():
    done = _run("from flashlite.attn import gluon as launch_gluon; print(launch_gluon.GLUON_ENABLED)",
                FLASHLITE_GLUON="false")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]


def test_flashlite_gluon_off_keeps_the_backward_off_the_gluon_kernels_too():
    # One switch for the Gluon kernels, forward and backward, read at import: a call the backward's rule takes
    # (bf16, D=128, causal, 4,096 queries and keys; gluon_supported stood in, since the kernels need an sm_90 GPU)
    # runs its backward on them with the switch unset and on the pointer kernels with FLASHLITE_GLUON=0.
    code = ("import torch\n"
            "from flashlite.attn import gluon, gluon_bwd\n"
            "from flashlite.attn.problem import validate\n"
            "gluon.gluon_supported = gluon_bwd.gluon_supported = lambda *a, **kw: None\n"
            "q = torch.empty(1, 2, 4096, 128, dtype=torch.bfloat16)\n"
            "problem = validate(q, q, q, True, None, None, None, 'triton', None)\n"
            "print(gluon_bwd.backward_on_gluon(problem, q, q, q))\n")
    unset = {name: value for name, value in os.environ.items() if name != "FLASHLITE_GLUON"}
    for value, on_gluon in ((None, "True"), ("0", "False"), ("off", "False")):
        env = unset if value is None else {**unset, "FLASHLITE_GLUON": value}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == [on_gluon], value


def test_every_switch_flashlite_reads_is_in_the_documented_table():
    # docs/flashlite.md's one table of switches names exactly the FLASHLITE_* variables the package reads.
    root = Path(flashlite.__file__).resolve().parents[1]
    read = set()
    for source in (root / "flashlite").rglob("*.py"):
        read |= set(re.findall(r'(?:_env\.flag|environ\.get)\(\s*"(FLASHLITE_[A-Z_]+)"', source.read_text()))
    documented = re.findall(r"^\| `(FLASHLITE_[A-Z_]+)` \|", (root / "docs" / "flashlite.md").read_text(), re.M)
    assert len(documented) == len(set(documented)), documented
    assert set(documented) == read
    assert read == {"FLASHLITE_AUTOTUNE", "FLASHLITE_CACHE_DIR", "FLASHLITE_CHECK_VALUES", "FLASHLITE_DEBUG_DISPATCH",
                    "FLASHLITE_GLUON", "FLASHLITE_NATIVE"}


def test_the_removed_gluon_backward_switch_is_not_ignored_without_a_word():
    # FLASHLITE_GLUON_BWD=0 once kept the backward off the Gluon kernels; set now, it warns and names the switch
    # that does.
    done = _run("import warnings\nwarnings.simplefilter('always')\nimport flashlite.attn.gluon_bwd",
                FLASHLITE_GLUON_BWD="0")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "FLASHLITE_GLUON_BWD is no longer read: FLASHLITE_GLUON turns" in done.stderr


def test_an_unreadable_import_time_switch_stops_the_import_by_name():
    done = _run("import flashlite", FLASHLITE_GLUON="maybe")
    assert done.returncode != 0
    assert "FLASHLITE_GLUON='maybe' is not an on/off value" in done.stderr


def test_check_values_switch(monkeypatch):
    on_a_device = torch.empty(2, device="meta")  # any tensor off the CPU asks the switch
    monkeypatch.setenv("FLASHLITE_CHECK_VALUES", "false")
    assert validation.value_checks_wanted(None, on_a_device) is False
    monkeypatch.setenv("FLASHLITE_CHECK_VALUES", "True")
    assert validation.value_checks_wanted(None, on_a_device) is True
    monkeypatch.setenv("FLASHLITE_CHECK_VALUES", "sometimes")
    with pytest.raises(ValueError, match="FLASHLITE_CHECK_VALUES"):
        validation.value_checks_wanted(None, on_a_device)


def test_autotune_switch(monkeypatch):
    monkeypatch.setattr(_runtime, "_INTERPRETING", False)  # interpreted kernels always take their one config
    monkeypatch.setenv("FLASHLITE_AUTOTUNE", "off")
    assert launch._autotuning() is False
    monkeypatch.setenv("FLASHLITE_AUTOTUNE", "1")
    assert launch._autotuning() is True


def test_debug_dispatch_switch(monkeypatch, caplog):
    q = torch.empty(1, 2, 3, 4)
    caplog.set_level(logging.DEBUG, logger="flashlite.attention")
    monkeypatch.setenv("FLASHLITE_DEBUG_DISPATCH", "false")
    decide.log_decision(Decision("sdpa", "a reason"), q, q)
    assert not caplog.records
    monkeypatch.setenv("FLASHLITE_DEBUG_DISPATCH", "yes")
    decide.log_decision(Decision("sdpa", "a reason"), q, q)
    assert [r.getMessage().endswith("-> sdpa: a reason") for r in caplog.records] == [True]


def test_native_switch(monkeypatch):
    monkeypatch.setenv("FLASHLITE_NATIVE", "off")
    assert _native._build_or_none() == (None, "off: FLASHLITE_NATIVE='off'")


def test_flashlite_reads_triton_interpret_as_triton_does():
    knobs = pytest.importorskip("triton.knobs", reason="Triton before 3.4 has no knobs to compare with")
    del knobs
    code = ("import torch, flashlite\n"
            "from flashlite import _runtime\n"
            "from triton import knobs\n"
            "print(_runtime.interpreting(), knobs.runtime.interpret)\n"
            "q = torch.randn(1, 2, 8, 16)\n"
            "try:\n"
            "    flashlite.attention(q, q, q, causal=True, backend='triton')\n"
            "except ValueError as error:\n"
            "    print(error)\n")
    for value, interprets in (("false", False), ("off", False), ("true", True), ("1", True)):
        done = _run(code, TRITON_INTERPRET=value)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[0].split() == [str(interprets), str(interprets)], value
        if not interprets and not torch.cuda.is_available():
            # Not interpreted and no GPU: flashlite's own error, not a compiled launch on CPU tensors.
            assert "cannot run this call: tensors on cpu" in lines[1], done.stdout
