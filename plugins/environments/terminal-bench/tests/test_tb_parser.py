"""The pytest output parser, on real output from this venv's pytest and on hand-written edge cases."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from miles_env_terminal_bench.parser import parse_pytest_output

SUITE = """\
import pytest

def test_pass_one(): assert True
def test_pass_two(): assert True
def test_fail(): assert 1 == 2, "one is not two"
@pytest.mark.skip(reason="later")
def test_skip(): pass
@pytest.mark.xfail(reason="known")
def test_xfail(): assert False
@pytest.mark.xfail(reason="surprise")
def test_xpass(): assert True
@pytest.fixture
def broken(): raise RuntimeError("fixture boom")
def test_error(broken): pass
"""


CASES = {
    "mixed-rA": (SUITE, ("-rA",)),
    "mixed-default": (SUITE, ()),
    "all-pass-rA": ("def test_a(): pass\ndef test_b(): pass\n", ("-rA",)),
    "all-pass-quiet": ("def test_a(): pass\ndef test_b(): pass\n", ("-q",)),
    "collect-error": ("import not_a_module_xyz\ndef test_a(): pass\n", ("-rA",)),
    "empty": ("x = 1\n", ("-rA",)),
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Real console output of this venv's pytest, one run per case (run concurrently)."""
    root = tmp_path_factory.mktemp("pytest-real")
    procs = {}
    for name, (source, args) in CASES.items():
        d = root / name
        d.mkdir()
        (d / "test_outputs.py").write_text(textwrap.dedent(source))
        (d / "pytest.ini").write_text("[pytest]\n")
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args, "test_outputs.py"],
            cwd=d, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
    return {name: proc.communicate(timeout=120)[0] for name, proc in procs.items()}


def test_real_rA_output_uses_the_short_summary(outputs):
    s = parse_pytest_output(outputs["mixed-rA"])
    assert s is not None and s.source == "short-summary"
    assert s.tests == {
        "test_outputs.py::test_pass_one": "PASSED", "test_outputs.py::test_pass_two": "PASSED",
        "test_outputs.py::test_fail": "FAILED", "test_outputs.py::test_xfail": "XFAIL",
        "test_outputs.py::test_xpass": "XPASS", "test_outputs.py::test_error": "ERROR",
        **{k: "SKIPPED" for k in s.tests if k.startswith("[1] test_outputs.py")},
    }
    # terminal-bench: PASSED, XFAIL, SKIPPED pass; FAILED, XPASS, ERROR fail
    assert (s.passed, s.failed, s.resolved) == (4, 3, False)
    assert s.pass_fraction == pytest.approx(4 / 7)


def test_real_output_without_rA_falls_back_to_the_final_line(outputs):
    s = parse_pytest_output(outputs["mixed-default"])
    assert s is not None and s.source == "final-line" and (s.passed, s.failed) == (4, 3)


def test_real_all_passing(outputs):
    for name in ("all-pass-rA", "all-pass-quiet"):
        s = parse_pytest_output(outputs[name])
        assert s is not None and (s.passed, s.failed, s.resolved) == (2, 0, True), name
    assert parse_pytest_output(outputs["all-pass-rA"]).source == "short-summary"
    assert parse_pytest_output(outputs["all-pass-quiet"]).source == "final-line"


def test_real_collection_error_fails(outputs):
    s = parse_pytest_output(outputs["collect-error"])
    assert s is not None and s.failed >= 1 and not s.resolved


def test_real_no_tests_is_parseable_but_not_resolved(outputs):
    s = parse_pytest_output(outputs["empty"])
    assert s is not None and (s.passed, s.failed, s.resolved, s.pass_fraction) == (0, 0, False, 0.0)


def test_unparseable_output():
    assert parse_pytest_output("") is None
    assert parse_pytest_output("bash: pytest: command not found\n") is None
    assert parse_pytest_output("I passed 3 tests, trust me\n") is None


def test_two_pytest_runs_are_summed():
    out = ("== short test summary info ==\nPASSED a.py::t1\n== 1 passed in 0.01s ==\n"
           "== short test summary info ==\nFAILED b.py::t2 - boom\nPASSED b.py::t3\n== 1 failed, 1 passed in 0.01s ==\n")
    s = parse_pytest_output(out)
    assert (s.source, s.passed, s.failed) == ("short-summary", 2, 1)


def test_ansi_colour_and_crlf_are_tolerated():
    out = "\x1b[32m== short test summary info ==\x1b[0m\r\nPASSED t.py::a\r\n\x1b[32m== 1 passed in 0.01s ==\x1b[0m\r\n"
    s = parse_pytest_output(out)
    assert (s.passed, s.failed, s.source) == (1, 0, "short-summary")


def test_failed_lines_with_message_dashes_keep_the_test_id():
    s = parse_pytest_output("== short test summary info ==\nFAILED t.py::test_x[a-b] - assert 'a - b' == 1\n")
    assert s.tests == {"t.py::test_x[a-b]": "FAILED"}
