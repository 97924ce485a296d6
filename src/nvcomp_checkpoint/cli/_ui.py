"""Terminal output shared by the ``nvckpt`` commands: consoles, tables, progress and exit codes.

Results go to stdout, progress and errors to stderr, so ``nvckpt ... --json | jq`` always works.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from typing import Any, Iterable, Sequence

from rich.console import Console, ConsoleOptions, RenderResult
from rich.progress import (
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from nvcomp_checkpoint.errors import CheckpointError
from nvcomp_checkpoint.progressbar import byte_columns

__all__ = [
    "default_max_bytes",
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_ERROR",
    "EXIT_INTERNAL",
    "PROGRESS_DELAY_S",
    "stdout_console",
    "stderr_console",
    "print_json",
    "make_table",
    "Reporter",
    "gbps",
    "check_workers",
    "wrap_words",
]

#: Everything checked out.
EXIT_OK = 0
#: The command ran and found a problem (``verify`` found a corrupt tensor).
EXIT_FAILED = 1
#: The command could not run: a missing file, a wrong format, a bad option, an unusable codec.
EXIT_ERROR = 2
#: A bug in nvckpt (rerun with ``--debug`` for the traceback).
EXIT_INTERNAL = 3

#: Work shorter than this shows no progress bar; a bar that flashes for 100 ms is noise.
PROGRESS_DELAY_S = 1.0


def stdout_console() -> Console:
    """The console results are printed on; wide when piped so tables are not squeezed (unless
    ``COLUMNS`` says how wide)."""
    probe = Console()
    if probe.is_terminal:
        return probe
    columns = os.environ.get("COLUMNS", "")
    return Console(width=int(columns) if columns.isdigit() and int(columns) > 0 else 200, highlight=False, soft_wrap=True)


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def print_json(data: Any) -> None:
    """One JSON document on stdout (plain ``print``: rich would wrap long lines)."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def make_table(
    title: str | None, header: Sequence[str], rows: Iterable[Sequence[Any]], *, numeric_from: int = 1
) -> "FittedTable":
    """A table whose columns from ``numeric_from`` on are right-aligned figures.

    At any console width every figure is printed whole: text columns (names, paths) and headers
    wrap, and when even that does not fit, figure columns are left out from the right, the
    caption naming them.
    """
    return FittedTable(title, [str(h) for h in header], [[str(c) for c in row] for row in rows], numeric_from)


class FittedTable:
    """The renderable :func:`make_table` returns: the table is laid out for the width it is printed at."""

    #: Narrowest a text column is squeezed to before figure columns are left out.
    TEXT_MIN = 10

    def __init__(self, title: str | None, header: list[str], rows: list[list[str]], numeric_from: int) -> None:
        self.title = title
        self.header = header
        self.rows = rows
        self.numeric_from = max(0, numeric_from)

    def _figure_width(self, i: int, wrap_header: bool) -> int:
        cells = [len(r[i]) for r in self.rows if i < len(r)]
        header = max([len(w) for w in self.header[i].split()] or [1]) if wrap_header else len(self.header[i])
        return max([*cells, header, 1])

    def table(self, width: int) -> Table:
        """The rich table laid out for ``width`` columns of text."""
        shown = list(range(len(self.header)))
        figures = [i for i in shown if i >= self.numeric_from]

        def needed(cols: list[int], wrap_header: bool) -> int:
            inner = sum(self._figure_width(i, wrap_header) if i >= self.numeric_from else self.TEXT_MIN for i in cols)
            return inner + 3 * len(cols) + 1  # padding of 1 either side, one border per column and one more

        # Headers wrap only when whole ones do not fit; figure columns are dropped only when that is not enough.
        wrap_header = needed(shown, False) > width
        dropped: list[int] = []
        while figures and len(shown) > 1 and needed(shown, True) > width:
            dropped.insert(0, figures.pop())
            shown.remove(dropped[0])
        caption = None
        if dropped:
            names = ", ".join(self.header[i] or f"column {i + 1}" for i in dropped)
            caption = f"not shown at this width: {names} (a wider terminal shows them)"
        table = Table(title=self.title, title_justify="left", show_lines=False, caption=caption, caption_justify="left")
        texts = self._text_widths([i for i in shown if i < self.numeric_from], width - needed(shown, wrap_header))
        for i in shown:
            if i >= self.numeric_from:
                table.add_column(self.header[i], justify="right", width=self._figure_width(i, wrap_header), overflow="fold")
            elif i in texts:
                table.add_column(self.header[i], justify="left", overflow="fold", width=texts[i])
            else:
                table.add_column(
                    self.header[i],
                    justify="left",
                    overflow="fold",
                    min_width=min(
                        self.TEXT_MIN, max([len(self.header[i]), *(len(r[i]) for r in self.rows if i < len(r))], default=1)
                    ),
                )
        for row in self.rows:
            table.add_row(
                *(Text(wrap_words(row[i], texts[i]) if i in texts else row[i]) if i < len(row) else Text("") for i in shown)
            )
        return table

    def _text_widths(self, columns: list[int], spare: int) -> dict[int, int]:
        """Widths for the text ``columns`` when their cells do not fit whole (``{}``: they fit, rich lays them out).

        ``spare``: the width left beyond :data:`TEXT_MIN` each. The narrow columns get their full
        width, the rest share what remains equally; cells are then wrapped at word and name
        boundaries (:func:`wrap_words`), not cut mid-word as a fixed-width fold would.
        """
        natural = {i: max([len(self.header[i]), *(len(r[i]) for r in self.rows if i < len(r))], default=1) for i in columns}
        available = spare + self.TEXT_MIN * len(columns)
        if sum(natural.values()) <= available:
            return {}
        widths: dict[int, int] = {}
        left = sorted(columns, key=lambda i: natural[i])
        while left:
            share = max(1, available // len(left))
            i = left[0]
            if natural[i] <= share:
                widths[i] = natural[i]
                available -= natural[i]
                left.pop(0)
                continue
            for j in left:  # the wide ones share the rest
                widths[j] = max(self.TEXT_MIN, share)
            break
        return widths

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.table(options.max_width)


#: Where a name may be broken across lines: after a path, word or extension separator.
_BREAK_AFTER = re.compile(r"[^\s/_.\-]*(?:[\s/_.\-]+|$)")


def wrap_words(text: str, width: int) -> str:
    """``text`` broken into lines of at most ``width`` characters after spaces, ``/``, ``_``, ``.`` or ``-``.

    A file name in a narrow column reads ``a_rather_long_`` / ``file_name.pt`` rather than being cut
    at an arbitrary letter; a part longer than ``width`` is still cut (rich folds it).
    """
    if width < 1 or len(text) <= width:
        return text
    lines: list[str] = []
    line = ""
    for part in (p for p in _BREAK_AFTER.findall(text) if p):
        if line and len(line) + len(part.rstrip()) > width:
            lines.append(line.rstrip())
            line = ""
        line += part
    if line:
        lines.append(line.rstrip())
    return "\n".join(lines)


def gbps(value: float | None) -> str:
    """A throughput in GB/s (decimal, as storage is quoted), or ``-`` when unbounded."""
    if value is None:
        return "-"
    return f"{value:.3g}"


def check_workers(workers: int | None) -> None:
    """Refuse ``--workers`` below 1 before any work (``None``: every core).

    Raises:
        CheckpointError: ``workers`` is zero or negative.
    """
    if workers is not None and workers < 1:
        raise CheckpointError(
            f"--workers must be a positive integer (threads to use), got {workers}; leave it out to use every core"
        )


class Reporter:
    """Progress bars on stderr, silenced by ``--quiet`` and when stderr is not a terminal.

    A bar appears only once its work has run for :data:`PROGRESS_DELAY_S`, from a timer thread,
    so short commands print nothing but their result.

    Args:
        quiet: Print no progress (errors are still printed by ``main``).
    """

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.console = stderr_console()
        self._progress: Progress | None = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return not self.quiet and self.console.is_terminal

    def start(self, description: str, total: int | None = None) -> "_Task":
        """Begin a unit of work of ``total`` bytes (``None``: unknown, a spinner)."""
        self.stop()
        if total is None:
            columns: tuple[Any, ...] = (SpinnerColumn(), TextColumn("{task.description}", markup=False), TimeElapsedColumn())
        else:
            columns = byte_columns()
        progress = Progress(
            *columns,
            console=self.console,
            transient=True,
            disable=not self.enabled,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        task = progress.add_task(description, total=total)
        with self._lock:
            self._progress = progress
            if self.enabled:
                self._timer = threading.Timer(PROGRESS_DELAY_S, self._show, args=(progress,))
                self._timer.daemon = True
                self._timer.start()
        return _Task(progress, task)

    def _show(self, progress: Progress) -> None:
        with self._lock:
            if self._progress is progress:
                progress.start()

    def stop(self) -> None:
        """End the current bar (it disappears: the result is printed instead)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._progress is not None:
                self._progress.stop()
                self._progress = None

    def __enter__(self) -> "Reporter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class _Task:
    """Handle on one bar: ``advance(n)`` is cheap and thread-safe (rich locks internally)."""

    def __init__(self, progress: Progress, task: TaskID) -> None:
        self._progress = progress
        self._task = task

    def advance(self, n: int) -> None:
        self._progress.advance(self._task, n)

    def describe(self, description: str) -> None:
        self._progress.update(self._task, description=description)


def default_max_bytes() -> int:
    """The default of ``--max-bytes``: this machine's physical memory.

    A file that decodes to more cannot be loaded into this machine's memory, so refusing it
    loses nothing a load could have done here; and a forged file (a 135 KB index may declare
    gigabytes of zeros, a 1 GiB one petabytes) costs at most this much decoding time.
    """
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX: 64 GiB, a large training host
        return 64 << 30
