"""`python -m agentstream.controller --tasks FILE --agent CMD …` (also `agentstream run …`)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from aiokafka.errors import KafkaConnectionError
from rich.console import Console
from rich.logging import RichHandler

from agentstream.controller.controller import Controller
from agentstream.controller.progress import live_progress
from agentstream.controller.settings import ControllerSettings
from agentstream.controller.tasks import TaskFileError
from agentstream.schemas.errors import AgentstreamError
from agentstream.schemas.flags import parse


async def run(settings: ControllerSettings, console: Console) -> int:
    controller = Controller(settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, controller.shutdown)
    console.print(f"run [bold]{controller.run_id}[/bold]: {len(controller.plan)} rollouts, "
                  f"agent `{settings.agent}` on {settings.backend}, concurrency {settings.concurrency}; "
                  f"attempt logs in {settings.logs_dir / controller.run_id}")
    async with live_progress(controller, console, enabled=settings.progress):
        summary = await controller.run()
    console.print(f"{summary.done} of {summary.total} rollouts finished, {summary.failed} given up"
                  + (" — stopped early; run the same command again to resume" if summary.stopped_early else ""))
    return summary.exit_code


FAILED = 3
"""the exit code of a run an error stopped (Kafka stopped acknowledging, …): not 1, which says every rollout
ended and some were given up, so that no reader (the eval) takes a broken run for a finished one"""


def main(argv: list[str] | None = None) -> int:
    console = Console(stderr=True, soft_wrap=True)  # messages whole, for logs and greps
    settings = parse(ControllerSettings, argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s",
                        handlers=[RichHandler(console=console, show_path=False)])
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    try:
        return asyncio.run(run(settings, console))
    except TaskFileError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    except Exception as exc:  # the workers' task group wraps what went wrong in a group
        for cause in _leaves(exc):  # ours name the fix themselves; others need their kind to be understood
            console.print(f"[red]error:[/red] {cause}" if isinstance(cause, AgentstreamError)
                          else f"[red]error:[/red] {type(cause).__name__}: {cause}")
            if isinstance(cause, KafkaConnectionError):
                console.print(f"  Kafka at {settings.bootstrap_servers} is unreachable: start the local broker with "
                              "`agentstream kafka start`, or set KAFKA_BOOTSTRAP_SERVERS")
        return FAILED


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


if __name__ == "__main__":
    sys.exit(main())
