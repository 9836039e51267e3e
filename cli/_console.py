"""What `kvhandoff demo` and `kvhandoff bench` say while they work, on stderr.

Three ways, picked from where stderr goes:

- a terminal: rich's live display, a spinner with the elapsed time while a
  step runs (starting Ray, launching the ranks: 10-30 s on a small machine)
  and a bar while the requests run; then one line per finished step;
- anything else (a pipe, a file, a CI log): plain lines, no escape sequences:
  one when a step starts ("launching ...") and one when it ends ("ranks
  ready (12.3 s)"), and one per tenth of the requests;
- quiet (`--json`): nothing, so stderr carries only errors.

A step that raises prints no "done" line: the caller reports the error, in
one line.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

__all__ = ["Reporter", "is_terminal"]


def is_terminal(stream: TextIO) -> bool:
    """Whether `stream` is an interactive terminal that can redraw a line."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and os.environ.get("TERM") != "dumb"


class Reporter:
    """Progress of one command (`command` prefixes the plain lines)."""

    def __init__(self, command: str, *, quiet: bool, stream: TextIO | None = None) -> None:
        self.command = command
        self.stream = sys.stderr if stream is None else stream
        self.quiet = quiet
        self.live = not quiet and is_terminal(self.stream)
        self._console: Any = None
        if self.live:
            from rich.console import Console

            self._console = Console(file=self.stream, highlight=False)
        self._spinner: Any = None  # the live display of the steps under way
        self._bar: Any = None
        self._task: Any = None
        self._total = 0
        self._done = 0
        self._every = 1
        self._started = 0.0
        self._outcomes: collections.Counter[str] = collections.Counter()

    def line(self, text: str) -> None:
        """One line of progress."""
        if self.quiet:
            return
        if self.live:
            self._console.print(text, markup=False)
        else:
            self.stream.write(f"{self.command}: {text}\n")
            self.stream.flush()

    @contextlib.contextmanager
    def step(self, doing: str, done: str) -> Iterator[None]:
        """A step that takes a while: `doing` while it runs, then "`done` (N s)"."""
        start = time.perf_counter()
        if self.live and self._spinner is not None:
            # A step inside a step (a launch inside a bench section): one more
            # line in the live display that is up (rich runs one at a time).
            task = self._spinner.add_task(doing, total=None)
            try:
                yield
            finally:
                self._spinner.remove_task(task)
        elif self.live:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
            with Progress(*columns, console=self._console, transient=True) as spinner:
                self._spinner = spinner
                try:
                    spinner.add_task(doing, total=None)
                    yield
                finally:
                    self._spinner = None
        else:
            self.line(f"{doing}...")
            yield
        self.line(f"{done} ({time.perf_counter() - start:.1f} s)")

    # -- requests -----------------------------------------------------------------------------

    def start_requests(self, total: int, what: str) -> None:
        """`total` requests start (`what` says how they run)."""
        self._total, self._done, self._started = total, 0, time.perf_counter()
        self._every = max(1, math.ceil(total / 10))
        self._outcomes.clear()
        if self.quiet:
            return
        if self.live and self._spinner is None:  # (inside a step: plain lines)
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._bar = Progress(
                TextColumn("requests"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[outcomes]}"),
                console=self._console,
            )
            self._bar.start()
            self._task = self._bar.add_task("requests", total=total, outcomes=what)
        else:
            self.line(f"{what}...")

    def request_done(self, outcome: str) -> None:
        """One request ended with `outcome`."""
        self._done += 1
        self._outcomes[outcome] += 1
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.update(self._task, advance=1, outcomes=self._tally())
        elif self._done % self._every == 0 or self._done == self._total:
            elapsed = time.perf_counter() - self._started
            self.line(f"requests {self._done}/{self._total}: {self._tally()} ({elapsed:.1f} s)")

    def end_requests(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def _tally(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(self._outcomes.items()))
