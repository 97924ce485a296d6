"""The opt-in progress bar of a long save (``save(..., progress=True)``): bytes, speed and time left
on stderr, shown only when stderr is a terminal, and gone once the save ends."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

__all__ = ["progress_bar", "byte_columns", "tensor_bytes"]


def tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors of a state tree (dicts, lists, tuples; a shared tensor once): a save's total."""
    import torch  # here: the CLI imports this module for its columns, and `nvckpt --help` imports no torch

    seen: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if id(item) not in seen:
                seen.add(id(item))
                total += item.numel() * item.element_size()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def byte_columns() -> tuple[Any, ...]:
    """The columns of a bar over bytes: what, the bar, bytes done of the total, speed, time left (the CLI's too)."""
    from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    return (
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )


@contextlib.contextmanager
def progress_bar(description: str, total: int | None) -> Iterator[Callable[[int], None]]:
    """A bar of ``total`` bytes on stderr while the block runs; yields the function that advances it.

    The function may be called from several threads at once (rich's ``Progress`` holds a lock).
    """
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    with Progress(*byte_columns(), console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)
