"""What every command prints with: one console, progress notes, and errors as one line naming the fix."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console

console = Console()


def fail(message: str) -> NoReturn:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(1)


def say(message: str) -> None:
    """A step of a long-running command, dimmed."""
    console.print(f"[dim]{message}[/dim]")
