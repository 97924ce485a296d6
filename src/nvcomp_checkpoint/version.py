"""The package version, in a module of its own so that the writer can stamp files without importing the package."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
