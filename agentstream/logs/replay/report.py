"""A replay on a terminal: a progress bar while it runs, then what it did and what it left out."""

from __future__ import annotations

import asyncio

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from agentstream.logs.replay.run import Job, Options, Summary, replay
from agentstream.schemas.kafka import KafkaSettings


def replay_with_progress(settings: KafkaSettings, job: Job, options: Options, console: Console) -> Summary:
    """Run the replay with a progress bar, then print its summary."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("records"),
               TextColumn("· {task.fields[written]:,} trajectories"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("Replaying", total=None, written=0)
        summary = asyncio.run(replay(settings, job, options, lambda p: bar.update(
            task, total=p.remaining, completed=p.read, written=p.written)))
    for line in describe(summary, options, job.target):
        console.print(line)
    return summary


def describe(summary: Summary, options: Options, target: str) -> list[str]:
    """The summary as lines of console markup."""
    if summary.already_done:
        return [f"This replay is already complete ({summary.written:,} trajectories; state {options.state}). "
                "Pass --restart to do it again."]
    rate = f", {summary.read / summary.seconds:,.0f} records/s" if summary.seconds else ""
    lines = [f"{'Resumed and finished' if summary.resumed else 'Done'}: {summary.written:,} trajectories in "
             f"{target} ({summary.read:,} records read this run{rate})."]
    left = {k: v for k, v in summary.counts.items() if v and k not in ("trajectories", "rewards_computed")}
    if left:
        lines.append("  " + ", ".join(f"{k.replace('_', ' ')}: {v:,}" for k, v in sorted(left.items())))
    running = summary.counts.get("open", 0) - summary.counts.get("open_ended", 0)
    if running:
        lines.append(f"  [yellow]{running:,} open[/yellow] attempt(s) had no ending by the end of the range: they "
                     "are left out; widen --until to include them once they end")
    lines += [f"  [dim]{reason}[/dim]" for reason in summary.reasons]
    return lines
