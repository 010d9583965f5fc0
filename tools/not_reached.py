"""Which selected tests a pytest pass did not reach: its JUnit XML against the selection pytest collects.

A GPU stage runs under a time limit. When SIGINT stops pytest there, the log's counts say what passed and failed,
but not what never ran; a test that never ran is not a pass. This lists those tests' node ids and counts them per
file. The XML names each test that ran by a class name (its file's path with dots, then any test classes) and a
name (the function with its parameters), as pytest's junitxml plugin writes them; a collected node id is turned into
the same pair to compare.

Usage: python tools/not_reached.py RESULTS.xml OUT.txt -- PYTEST_ARGS...
  PYTEST_ARGS: the paths and selection options (-k, -m, --ignore, --deselect) the pass ran with, without its
  worker or output options. Written: OUT.txt, one node id a line. Printed: "N of M selected tests not reached",
  then a count per file, largest first.

Example:
    >>> junit_key("tests/flashlite/test_layer.py::TestCasts::test_cast[bf16-2]")
    ('tests.flashlite.test_layer.TestCasts', 'test_cast[bf16-2]')
"""
from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from typing import Iterable, Sequence

USAGE = "usage: python tools/not_reached.py RESULTS.xml OUT.txt -- PYTEST_ARGS..."


def junit_key(node_id: str) -> tuple[str, str]:
    """The (classname, name) pair pytest's JUnit XML gives the test with ``node_id``."""
    head, bracket, parameters = node_id.partition("[")  # parameter ids may hold "::" themselves
    path, *parts = head.split("::")
    if not parts:
        raise ValueError(f"not a test's node id (no '::'): {node_id!r}")
    module = path[:-3] if path.endswith(".py") else path
    return ".".join([module.replace("/", ".")] + parts[:-1]), parts[-1] + bracket + parameters


def ran_tests(xml_text: str) -> set[tuple[str, str]]:
    """Every (classname, name) the JUnit XML reports, whatever its outcome (passed, failed, errored, skipped)."""
    root = ET.fromstring(xml_text)
    return {(case.get("classname", ""), case.get("name", "")) for case in root.iter("testcase")}


def not_reached(selected: Iterable[str], ran: set[tuple[str, str]]) -> list[str]:
    """The node ids of ``selected`` that ``ran`` does not hold, in collection order.

    Example:
        >>> not_reached(["t/test_a.py::test_x", "t/test_a.py::test_y"], {("t.test_a", "test_x")})
        ['t/test_a.py::test_y']
    """
    return [node for node in selected if junit_key(node) not in ran]


def collect(pytest_args: Sequence[str]) -> list[str]:
    """The node ids ``pytest --collect-only`` selects with ``pytest_args``, in collection order."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *pytest_args], capture_output=True, text=True)
    nodes = [line.strip() for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if done.returncode not in (0, 5) or not nodes:  # 5: nothing collected
        raise RuntimeError(f"collecting {list(pytest_args)} failed (exit status {done.returncode}):\n"
                           f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return nodes


def per_file(nodes: Iterable[str]) -> list[tuple[str, int]]:
    """How many of ``nodes`` each file holds, the largest count first."""
    return Counter(node.split("::")[0] for node in nodes).most_common()


def main(argv: Sequence[str]) -> int:
    if "--" not in argv or argv.index("--") != 2:
        print(USAGE, file=sys.stderr)
        return 2
    xml_path, out_path, pytest_args = argv[0], argv[1], argv[3:]
    try:
        with open(xml_path, encoding="utf-8") as handle:
            ran, note = ran_tests(handle.read()), ""
    except FileNotFoundError:
        # pytest writes the XML when it finishes: a pass killed (SIGKILL after its SIGINT grace) leaves none, and
        # which tests it reached is then unknown here, so none counts as reached; its log's progress shows how far
        # it got.
        ran, note = set(), f" (no JUnit XML at {xml_path}: the pass was killed before writing it; none counted)"
    selected = collect(pytest_args)
    missing = not_reached(selected, ran)
    with open(out_path, "w", encoding="utf-8") as handle:
        handle.writelines(node + "\n" for node in missing)
    print(f"{len(missing)} of {len(selected)} selected tests not reached{note}")
    for path, count in per_file(missing):
        print(f"  {count:5d}  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
