"""The package version, in a module of its own so that the writer can stamp files without importing the package."""

from __future__ import annotations

__all__ = ["__version__", "install_hint"]

__version__ = "0.1.0"


def install_hint(extra: str | None = None) -> str:
    """How to install the package (with ``extra``), worded for as long as it is not on PyPI."""
    spec = f"[{extra}]" if extra else ""
    return (
        f"pip install -e '.{spec}' in a clone of the nvcomp-checkpoint repository "
        f"(it is not on PyPI yet; once it is: pip install 'nvcomp-checkpoint{spec}')"
    )
