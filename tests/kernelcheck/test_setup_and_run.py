"""tools/setup_and_run, the README's first command: the test files its --quick run names exist, so a move of a test
file cannot turn the quick run into "no tests ran" (it did once: exit 5 after tests/kernelcheck was split into
check/, speed/ and results/)."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_quick_run_names_test_files_that_exist():
    script = (ROOT / "tools" / "setup_and_run").read_text()
    quick = script[script.index("if (( quick )); then\n  #"):]
    named = re.findall(r"(tests/\S+\.py)", quick.split("fi\n", 1)[0])
    assert len(named) >= 3, named
    missing = [path for path in named if not (ROOT / path).is_file()]
    assert not missing, f"tools/setup_and_run --quick names test files that do not exist: {missing}"
