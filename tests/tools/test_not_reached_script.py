"""tools/not_reached.py, which names the tests a GPU pass stopped by its time limit never ran: against the JUnit XML
pytest itself writes, for tests in classes, parametrized tests and nested folders."""
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(SCRIPTS))
import not_reached  # noqa: E402

SUITE = {
    "pkg/test_alpha.py": '''
import pytest

def test_first():
    assert 1 + 1 == 2

@pytest.mark.parametrize("n, label", [(3, "a-b"), (5, "c")])
def test_odd(n, label):
    assert n % 2 == 1 and label

class TestGroup:
    def test_inside(self):
        assert [1, 2][::-1] == [2, 1]

    @pytest.mark.parametrize("x", [0.5, 7], ids=["half", "a::b"])  # an id may hold "::"
    def test_inside_param(self, x):
        assert x > 0
''',
    "pkg/deeper/test_beta.py": '''
def test_skipped():
    import pytest
    pytest.skip("a skip counts as reached")

def test_failing():
    assert 2 + 2 == 5

def test_last():
    assert "x" * 3 == "xxx"
''',
}


def _write_suite(root: Path) -> None:
    for relative, text in SUITE.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_junit_key_names_classes_parameters_and_folders():
    assert not_reached.junit_key("tests/a/test_x.py::test_y") == ("tests.a.test_x", "test_y")
    assert not_reached.junit_key("tests/a/test_x.py::TestC::test_y[1-b::c]") == ("tests.a.test_x.TestC",
                                                                                  "test_y[1-b::c]")
    assert not_reached.junit_key("t/test_x.py::TestC::Inner::test_y[p]") == ("t.test_x.TestC.Inner", "test_y[p]")
    with pytest.raises(ValueError, match="node id"):
        not_reached.junit_key("tests/a/test_x.py")


def test_lists_exactly_the_tests_the_pass_did_not_run(tmp_path, monkeypatch, capsys):
    _write_suite(tmp_path)
    monkeypatch.chdir(tmp_path)
    xml = tmp_path / "pass.xml"
    # The "pass": a subset of the suite, as a run stopped part way leaves; a failure and a skip among what ran.
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                          "pkg", "-k", "first or (odd and a-b) or inside_param or skipped or failing"],
                         capture_output=True, text=True)
    assert ran.returncode == 1, ran.stdout  # the failing test failed
    out = tmp_path / "missing.txt"
    assert not_reached.main([str(xml), str(out), "--", "pkg"]) == 0
    missing = out.read_text().splitlines()
    assert sorted(missing) == ["pkg/deeper/test_beta.py::test_last", "pkg/test_alpha.py::TestGroup::test_inside",
                               "pkg/test_alpha.py::test_odd[5-c]"]
    assert ("pkg.test_alpha.TestGroup", "test_inside_param[a::b]") in not_reached.ran_tests(xml.read_text())
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "3 of 9 selected tests not reached"
    assert printed[1].split() == ["2", "pkg/test_alpha.py"] and printed[2].split() == ["1", "pkg/deeper/test_beta.py"]

    # The same selection options as the pass: nothing is left.
    assert not_reached.main([str(xml), str(out), "--", "pkg", "-k",
                             "first or (odd and a-b) or inside_param or skipped or failing"]) == 0
    assert out.read_text() == ""
    assert capsys.readouterr().out.splitlines()[0] == "0 of 6 selected tests not reached"


def test_a_pass_killed_before_writing_its_xml_counts_every_selected_test_as_not_reached(tmp_path, monkeypatch,
                                                                                        capsys):
    # A pass killed after its SIGINT grace writes no JUnit XML: the script said nothing but a FileNotFoundError.
    _write_suite(tmp_path)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "missing.txt"
    assert not_reached.main([str(tmp_path / "never_written.xml"), str(out), "--", "pkg"]) == 0
    assert len(out.read_text().splitlines()) == 9
    printed = capsys.readouterr().out.splitlines()[0]
    assert printed.startswith("9 of 9 selected tests not reached (no JUnit XML") and "killed" in printed


def test_refuses_a_selection_that_collects_nothing_or_fails(tmp_path, monkeypatch):
    _write_suite(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="collecting"):
        not_reached.collect(["pkg/no_such_file.py"])
    with pytest.raises(RuntimeError, match="collecting"):
        not_reached.collect(["pkg", "-k", "no_test_has_this_name"])


def test_usage_error_without_the_separator(capsys):
    assert not_reached.main(["a.xml", "b.txt", "pkg"]) == 2
    assert "usage" in capsys.readouterr().err
