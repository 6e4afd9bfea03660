"""What every command prints through: the two consoles, the exit codes and the `error:` lines."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

# Commands print through `console.out` and `console.err` looked up at each call, so a test may swap either.
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

EXIT_OK, EXIT_JOB_FAILED, EXIT_USAGE = 0, 1, 2


def print_error(line: str) -> None:
    err.print(f"[red]error:[/red] {escape(line)}", markup=True, highlight=False)


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    print_error(message)
    raise typer.Exit(code)
