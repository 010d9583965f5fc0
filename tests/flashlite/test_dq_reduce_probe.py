"""The dQ-reduction probe (scripts/dq_reduce_probe.py) keeps computing the right gradients on the CPU, so that a GPU
session can time it as it is: its one backward kernel in its "atomic" and "none" modes under the interpreter against
float64 (the interpreter has no descriptor reductions; the "tma" mode is compiled for sm_90 by the probe's compile
command)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PROBE = Path(__file__).resolve().parents[2] / "scripts" / "dq_reduce_probe.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the probe's check runs every config (minutes)")
def test_probe_backward_matches_float64_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(PROBE), "check"], capture_output=True, text=True, env=env,
                          timeout=600, cwd=PROBE.parents[1])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "FAILED" not in done.stdout, done.stdout
    with_dq = re.findall(r"atomic: relative errors dq, dk, dv (\S+), (\S+), (\S+) ok", done.stdout)
    without_dq = re.findall(r"none: relative errors dk, dv (\S+), (\S+) ok", done.stdout)
    assert len(with_dq) == len(without_dq) == 2, done.stdout  # both shapes, both modes
    assert all(0 < float(e) < 2e-2 for row in with_dq + without_dq for e in row)
