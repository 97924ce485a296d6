"""The package version, in a module of its own so that the writer can stamp files without importing the package."""

from __future__ import annotations

__all__ = ["__version__", "install_hint"]

__version__ = "0.1.0"


def install_hint(extra: str | None = None) -> str:
    """How to install the package (with ``extra``): the one wording of every message that says what to install.

    Both forms work today (scripts/check_wheel.sh installs the wheel so; its name carries the platform,
    as it holds the compiled byte-plane kernel, hence the ``ls``); ``pip install
    nvcomp-checkpoint`` does not, as long as the package is not on PyPI.
    """
    spec = f"[{extra}]" if extra else ""
    return (
        f"pip install -e '.{spec}' in a clone of the nvcomp-checkpoint repository, or "
        f'pip install "$(ls dist/nvcomp_checkpoint-{__version__}-*.whl){spec}" with a wheel built there '
        "(python -m build; it is not on PyPI yet)"
    )
