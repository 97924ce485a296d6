"""entrypoint/support.py: what each stack supports is declared once, checked in one place, and the
docs' table is generated from the declarations."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from nvcomp_checkpoint.entrypoint.support import OPTIONS, STACKS, check_options, support_matrix
from nvcomp_checkpoint.errors import UnsupportedOptionError

ROOT = Path(__file__).resolve().parent.parent


def test_the_docs_table_is_the_one_the_declarations_generate() -> None:
    text = (ROOT / "docs" / "orchestration.md").read_text(encoding="utf-8")
    found = re.search(r"<!-- support-matrix:start -->\n(.*?)<!-- support-matrix:end -->", text, re.S)
    assert found, "docs/orchestration.md: the support-matrix markers are missing"
    assert found.group(1) == support_matrix(), (
        "docs/orchestration.md's table differs from entrypoint/support.py: paste the output of "
        "`python -m nvcomp_checkpoint.entrypoint.support` between the markers"
    )


@pytest.mark.parametrize("stack", STACKS, ids=lambda s: s.name)
def test_each_option_is_refused_exactly_where_the_stack_declares_it(stack) -> None:
    refused = stack.refused()
    for option in OPTIONS:
        if option in refused:
            with pytest.raises(UnsupportedOptionError) as caught:
                check_options(stack.name, "entry", **{option: True})
            message = str(caught.value)
            assert f"entry({option}=...) with {stack.name}:" in message and "docs/orchestration.md" in message
            assert isinstance(caught.value, ValueError)  # the builtin contract callers already catch
        else:
            check_options(stack.name, "entry", **{option: True})
        check_options(stack.name, "entry", **{option: None})  # an option not set is never refused
        check_options(stack.name, "entry", **{option: False})


def test_several_refused_options_are_named_in_one_message() -> None:
    # The stack that refuses most (the cells filled so far leave several); its options in the matrix's order.
    stack = max(STACKS, key=lambda s: len(s.refused()))
    refused = [o for o in OPTIONS if o in stack.refused()]
    assert len(refused) >= 2, "no stack refuses two options any more: this test has nothing left to check"
    named = ", ".join(f"{o}=..." for o in refused)
    with pytest.raises(UnsupportedOptionError, match=re.escape(f"entry({named}) with {stack.name}:")):
        check_options(stack.name, "entry", **{o: True for o in reversed(refused)})


def test_an_unknown_stack_or_option_is_a_bug_named_at_once() -> None:
    with pytest.raises(KeyError, match="no stack 'Keras'"):
        check_options("Keras", "entry", async_save=True)
    with pytest.raises(ValueError, match="not an option"):
        check_options("Accelerate", "entry", asyncsave=True)


def _checked_stacks() -> dict[str, list[str]]:
    """The stack names each module of the package passes to check_options, read from its source."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "src" / "nvcomp_checkpoint").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "check_options":
                first = node.args[0] if node.args else None
                assert isinstance(first, ast.Constant), f"{path}:{node.lineno}: name the stack with a string literal"
                found.setdefault(first.value, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_entry_point_checks_a_declared_stack_and_every_refusing_stack_is_checked() -> None:
    checked = _checked_stacks()
    names = {s.name for s in STACKS}
    assert set(checked) <= names, {n: checked[n] for n in set(checked) - names}
    unchecked = [s.name for s in STACKS if s.refused() and s.name not in checked]
    assert not unchecked, f"stacks that declare refusals but no entry point checks: {unchecked}"
