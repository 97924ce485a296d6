"""The package version, in a module of its own so that the writer can stamp files without importing the package."""

from __future__ import annotations

__all__ = ["__version__", "install_hint"]

__version__ = "0.1.0"


def install_hint(extra: str | None = None) -> str:
    """How to install the package (with ``extra``): the one wording of every message that says what to install.

    Both forms work today (scripts/check_wheel.sh installs the wheel so); ``pip install
    nvcomp-checkpoint`` does not, as long as the package is not on PyPI.
    """
    spec = f"[{extra}]" if extra else ""
    return (
        f"pip install -e '.{spec}' in a clone of the nvcomp-checkpoint repository, or "
        f"pip install 'nvcomp_checkpoint-{__version__}-py3-none-any.whl{spec}' from a wheel built there "
        "(python -m build; it is not on PyPI yet)"
    )
