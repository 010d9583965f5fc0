"""Hypothesis settings profiles for the property-based sweeps (tests/**/test_properties_*.py).

Hypothesis is a well-kept library made for property-based testing: it draws inputs from strategies and shrinks a
failing one to a minimal example. Pick a profile with the environment variable HYPOTHESIS_PROFILE:

* ``ci`` (the default): few examples, derandomized (the same examples on every run, so CI is reproducible), no
  deadline (the Triton interpreter's time per call varies with the machine's load); both sweep files together take
  about three minutes on a shared 2-core machine.
* ``sweep``: ten times the examples, still derandomized, to hunt for defects by hand:
  ``HYPOTHESIS_PROFILE=sweep python -m pytest -q tests/flashlite/attn/test_properties_attention.py``.
* ``sweep-random``: as ``sweep`` with a fresh random seed each run, to explore beyond the fixed examples.

A test sets its own ``max_examples`` relative to the profile's through ``examples(n)`` below, since one example of
an interpreted kernel costs far more than one of a JSON file.
"""
from __future__ import annotations

import os

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # hypothesis is in the dev extras; without it the sweep modules skip and the rest runs
    settings = None

if settings is not None:
    # Health checks that misfire here: examples are slow by nature (the interpreter), and pytester / tmp_path are
    # function-scoped fixtures on purpose (every example writes into its own subfolder of them).
    _SUPPRESSED = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large]
    settings.register_profile("ci", derandomize=True, deadline=None, max_examples=10,
                              suppress_health_check=_SUPPRESSED, print_blob=True)
    settings.register_profile("sweep", derandomize=True, deadline=None, max_examples=100,
                              suppress_health_check=_SUPPRESSED, print_blob=True)
    settings.register_profile("sweep-random", derandomize=False, deadline=None, max_examples=100, database=None,
                              suppress_health_check=_SUPPRESSED, print_blob=True)
    settings.load_profile(PROFILE)


def examples(ci_count: int) -> "settings":
    """Settings of the loaded profile with ``ci_count`` examples under ``ci`` and ten times as many under the
    sweep profiles (their max_examples over ci's)."""
    factor = settings.default.max_examples / settings.get_profile("ci").max_examples
    return settings(settings.default, max_examples=max(1, round(ci_count * factor)))
