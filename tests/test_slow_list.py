"""tests/slow_tests.txt names tests that exist: a renamed test or a moved README snippet would
otherwise drop out of the list silently, and run in the fast loop (``pytest -m "not slow"``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from conftest import _SLOW_TESTS, _is_slow

ROOT = Path(__file__).resolve().parent.parent


def _test_functions(module: Path) -> set[str]:
    tree = ast.parse(module.read_text(encoding="utf-8"))
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        names |= {f"{cls.name}::{n.name}" for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


@pytest.mark.parametrize("entry", sorted(_SLOW_TESTS))
def test_every_entry_names_a_test_module_and_function(entry: str) -> None:
    module, _, test = entry.partition("::")
    assert (ROOT / module).is_file(), f"tests/slow_tests.txt: {entry}: no such module"
    if test:
        function = test.split("[")[0]
        assert function in _test_functions(ROOT / module), f"tests/slow_tests.txt: {entry}: no test {function} in {module}"


def test_readme_snippets_are_slow_whatever_their_line() -> None:
    # A snippet runs in a fresh process (seconds): the README's line numbers are not in the list.
    assert _is_slow("tests/test_readme.py::test_snippet_runs[README.md:1-anything]")
    assert not any(re.search(r"test_snippet_runs\[", e) for e in _SLOW_TESTS)


def _real_process_entries() -> list[str]:
    lines = (ROOT / "tests" / "real_process_tests.txt").read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("entry", _real_process_entries())
def test_every_real_process_entry_names_a_test(entry: str) -> None:
    # scripts/test.sh runs these again with NVCKPT_TEST_PROCESSES=real: a stale id would run nothing.
    module, _, test = entry.partition("::")
    assert test, f"tests/real_process_tests.txt: {entry}: name a test, not a module (the list runs twice)"
    assert (ROOT / module).is_file(), f"tests/real_process_tests.txt: {entry}: no such module"
    assert test.split("[")[0] in _test_functions(ROOT / module), f"tests/real_process_tests.txt: {entry}: no such test"
