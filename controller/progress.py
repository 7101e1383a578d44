"""The live progress display: one bar for the run and the counts beside it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from agentstream.controller.controller import Controller


def status_line(controller: Controller) -> str:
    counts = controller.counts
    parts = [f"{counts.queued} queued", f"[cyan]{counts.running} running[/cyan]", f"[green]{counts.done} done[/green]",
             f"[red]{counts.failed} failed[/red]"]
    if counts.retries:
        parts.append(f"{counts.retries} retried")
    parts.append(f"{controller.rate_per_min:.1f}/min")
    version = controller.weights.version if controller.weights else None
    parts.append(f"weights v{version}" if version is not None else "base weights")
    pacer = controller.pacer
    if pacer and pacer.waiting:
        parts.append(f"[yellow]held: {pacer.admitted} train rollouts launched, trainer at v{pacer.current}[/yellow]")
    return " · ".join(parts)


@asynccontextmanager
async def live_progress(controller: Controller, console: Console, enabled: bool = True,
                        every_s: float = 30.0) -> AsyncIterator[None]:
    """Show the display while the body runs; where the output is no terminal (CI, a log file),
    print the status line every `every_s` seconds instead."""
    if not enabled:
        yield
        return
    if not console.is_terminal:
        async def report() -> None:
            while True:
                await asyncio.sleep(every_s)
                console.print(status_line(controller))

        reporter = asyncio.create_task(report())
        try:
            yield
        finally:
            reporter.cancel()
            await asyncio.gather(reporter, return_exceptions=True)
        return
    progress = Progress(
        TextColumn(f"[bold]{controller.run_id}[/bold]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"), console=console, transient=False,
    )
    bar = progress.add_task("rollouts", total=controller.counts.total, status="starting…")

    async def refresh() -> None:
        while True:
            counts = controller.counts
            progress.update(bar, completed=counts.done + counts.failed, status=status_line(controller))
            await asyncio.sleep(0.25)

    with progress:
        updater = asyncio.create_task(refresh())
        try:
            yield
        finally:
            updater.cancel()
            await asyncio.gather(updater, return_exceptions=True)
            counts = controller.counts
            progress.update(bar, completed=counts.done + counts.failed, status=status_line(controller))
