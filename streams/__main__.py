"""`python -m agentstream.streams worker [FLAGS]` (also `agentstream streams`): run a streams worker until SIGTERM.

Workers of one app id split the partitions between them: start another to scale out (up to the
partition count), stop one and the others take its partitions and state over.
"""

from __future__ import annotations

import asyncio
import sys

import faust
import uvloop

from agentstream.schemas import collector
from agentstream.schemas.flags import parse, refuse
from agentstream.schemas.kafka import ensure_topics, partitions_of, with_replicas
from agentstream.schemas.topics import topic_specs
from agentstream.streams.app import changelog_specs, create_app
from agentstream.streams.rewards import RewardError, load
from agentstream.streams.settings import StreamsSettings

USAGE = "usage: python -m agentstream.streams worker [--help] [FLAGS]"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(f"{USAGE}\n\nRun a streams worker: trajectory assembly and windowed analytics. "
              "`python -m agentstream.streams worker --help` lists the flags.")
        return 0 if args else 2
    if args[0] != "worker":
        print(f"error: unknown command {args[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    settings = parse(StreamsSettings, args[1:])
    try:
        load(settings.reward_policy)  # a policy that cannot be loaded stops the worker now, not at a session's end
    except RewardError as exc:
        refuse(f"--reward-policy = {settings.reward_policy!r}: {exc}")
    loop = uvloop.new_event_loop()  # less CPU per event than asyncio's loop
    asyncio.set_event_loop(loop)
    try:
        partitions = loop.run_until_complete(prepare_topics(settings))
        # Faust creates topics of its own (its leader topic) with these: replicated as the cluster allows
        settings = loop.run_until_complete(with_replicas(settings))
    except Exception as exc:
        print(f"error: cannot prepare the topics on {settings.bootstrap_servers} ({type(exc).__name__}: {exc}); "
              "start the local broker with `agentstream kafka start`, or set KAFKA_BOOTSTRAP_SERVERS", file=sys.stderr)
        return 1
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    app = create_app(settings, partitions)
    loop.run_until_complete(ensure_topics(settings, changelog_specs(app, settings)))
    collector.relax()  # the modules, app and loop live as long as the process
    worker = faust.Worker(app, loop=loop, loglevel=settings.log_level.upper(), quiet=True, redirect_stdouts=False)
    worker.spinner = None  # its log handler puts the root logger at DEBUG: a record per Kafka request
    worker.execute_from_commandline()  # exits the process when the worker stops
    return 0


async def prepare_topics(settings: StreamsSettings) -> int:
    """Create what is missing; the partition count of the rollout-scoped topics as they are."""
    await ensure_topics(settings, topic_specs(settings.partitions))
    return len(await partitions_of(settings, settings.topics.rollouts))


if __name__ == "__main__":
    sys.exit(main())
