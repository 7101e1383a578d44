"""Crash tests' faults, injected from outside the product: run a module as `python -m` would, after
patching one of its functions to SIGKILL the process at a chosen point.

    python tests/support/faults.py FAULT MODULE ARGS…      e.g.  python tests/support/faults.py replay.after_output:3 agentstream replay …

FAULT is `part.point` or `part.point:N` (the Nth time the point is reached), or a fault that kills nothing; several
faults are separated by commas:
- trainer.after_checkpoint   a version's checkpoint is written, its weights event not yet published
- trainer.after_publish      a weights event is acknowledged, the offsets not yet committed
- replay.after_output:N      the Nth checkpoint that wrote output made it durable, its state not yet saved
- replay.after_state:N       the state of the Nth checkpoint that wrote output is saved
- archive.after_files:N      the files of the Nth commit are written, its manifest not yet
- gateway.after_reload       a server loaded new weights, not yet labelled nor resumed
- gateway.after_label        a server loaded and labelled new weights, not yet resumed
  (gateway faults fire in one process only when several run them: the first to create the file named by
  AGENTSTREAM_FAULT_ONCE, if set)
- gateway.late_weights:N     every live `weights` event reaches the replica's follower (its hold) N seconds late;
                             kills nothing
- gateway.slow_reload:N      a server's reload by this replica takes N seconds longer (as a large model's does);
                             kills nothing
- streams.drop_calls:N       a streams worker is handed none of the records of the calls partition of the Nth calls
                             record it fetched, from that one on, the first time each is fetched (faust-streaming
                             0.15.3 drops records around a restart): that partition stalls unless read again
"""

from __future__ import annotations

import functools
import logging
import os
import runpy
import signal
import sys


def kill() -> None:
    logging.shutdown()
    os.kill(os.getpid(), signal.SIGKILL)


class Countdown:
    def __init__(self, times: int):
        self.left = times

    def tick(self) -> None:
        self.left -= 1
        if self.left == 0:
            kill()


def trainer_after_checkpoint(countdown: Countdown) -> None:
    from agentstream.trainer.checkpoint import CheckpointStore

    write = CheckpointStore.write

    @functools.wraps(write)
    def killing(self, *args, **kwargs):
        written = write(self, *args, **kwargs)
        countdown.tick()
        return written

    CheckpointStore.write = killing


def trainer_after_publish(countdown: Countdown) -> None:
    from agentstream.schemas.events import WeightsEvent
    from agentstream.schemas.kafka import Publisher

    publish = Publisher.publish

    @functools.wraps(publish)
    async def killing(self, event):
        acked = await publish(self, event)
        if isinstance(event, WeightsEvent):
            countdown.tick()
        return acked

    Publisher.publish = killing


def replay_after_output(countdown: Countdown) -> None:
    from agentstream.logs.replay import sinks

    for sink in (sinks.TopicSink, sinks.JsonlSink, sinks.ParquetSink):
        _after_commit(sink, countdown)


def _after_commit(sink: type, countdown: Countdown) -> None:
    commit = sink.commit

    @functools.wraps(commit)
    async def killing(self):
        before = getattr(self, "_fault_committed", 0)
        position = await commit(self)
        self._fault_committed = position["written"]
        if position["written"] > before:
            countdown.tick()
        return position

    sink.commit = killing


def replay_after_state(countdown: Countdown) -> None:
    from agentstream.logs.replay.state import ReplayState

    save = ReplayState.save
    saved = {"written": 0}

    @functools.wraps(save)
    def killing(self, path):
        save(self, path)
        written = (self.sink or {}).get("written", 0)
        if written > saved["written"]:
            saved["written"] = written
            countdown.tick()

    ReplayState.save = killing


def archive_after_files(countdown: Countdown) -> None:
    from agentstream.schemas.scan import Manifest

    save = Manifest.save

    @functools.wraps(save)
    def killing(self):
        if self.commits >= countdown.left:  # the commit's files are written; the manifest naming them is next
            kill()
        save(self)

    Manifest.save = killing


def _gateway_after(path: str, countdown: Countdown) -> None:
    from agentstream.gateway.pool_sync import PoolSync

    post = PoolSync._post

    @functools.wraps(post)
    async def killing(self, server, step, *args, **kwargs):
        answer = await post(self, server, step, *args, **kwargs)
        if step == path and _first_here():
            countdown.tick()
        return answer

    PoolSync._post = killing


def _first_here() -> bool:
    once = os.environ.get("AGENTSTREAM_FAULT_ONCE")
    if not once:
        return True
    try:
        os.close(os.open(once, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def gateway_after_reload(countdown: Countdown) -> None:
    _gateway_after("/collective_rpc", countdown)


def gateway_after_label(countdown: Countdown) -> None:
    _gateway_after("/update_weight_version", countdown)


def gateway_late_weights(countdown: Countdown) -> None:
    import asyncio

    from aiokafka import TopicPartition

    from agentstream.gateway.pool_sync import PoolSync

    observe = PoolSync.observe
    delay_s = countdown.left

    @functools.wraps(observe)
    def late(self, record):
        live = record.offset >= self._history.get(TopicPartition(record.topic, record.partition), 0)
        if record.topic == self.settings.topics.weights and live:
            asyncio.get_running_loop().call_later(delay_s, observe, self, record)
        else:
            observe(self, record)

    PoolSync.observe = late


def gateway_slow_reload(countdown: Countdown) -> None:
    import asyncio

    from agentstream.gateway.pool_sync import PoolSync

    post = PoolSync._post
    delay_s = countdown.left

    @functools.wraps(post)
    async def slow(self, server, step, *args, **kwargs):
        answer = await post(self, server, step, *args, **kwargs)
        if step == "/collective_rpc":
            await asyncio.sleep(delay_s)
        return answer

    PoolSync._post = slow


def streams_drop_calls(countdown: Countdown) -> None:
    from agentstream.streams.transport import Inbox

    put = Inbox.put
    stalled: list[tuple[str, int]] = []
    dropped: set[int] = set()

    @functools.wraps(put)
    def dropping(self, message):
        where = (message.topic, message.partition)
        if message.topic.rpartition(".")[2] == "calls" and not stalled:
            countdown.left -= 1
            if countdown.left == 0:
                stalled.append(where)
        if stalled and where == stalled[0] and message.offset not in dropped:
            dropped.add(message.offset)
            return None
        return put(self, message)

    Inbox.put = dropping


FAULTS = {
    "trainer.after_checkpoint": trainer_after_checkpoint,
    "trainer.after_publish": trainer_after_publish,
    "replay.after_output": replay_after_output,
    "replay.after_state": replay_after_state,
    "archive.after_files": archive_after_files,
    "gateway.after_reload": gateway_after_reload,
    "gateway.after_label": gateway_after_label,
    "gateway.late_weights": gateway_late_weights,
    "gateway.slow_reload": gateway_slow_reload,
    "streams.drop_calls": streams_drop_calls,
}


def main() -> None:
    faults, module, *args = sys.argv[1:]
    sys.path[0] = os.getcwd()  # as `python -m` has it, not this file's folder
    for fault in faults.split(","):
        name, _, times = fault.partition(":")
        if name not in FAULTS:
            raise SystemExit(f"unknown fault {name!r}: use one of {', '.join(FAULTS)}")
        FAULTS[name](Countdown(int(times or 1)))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def command(fault: str, module: str, *args: str) -> list[str]:
    """The command line running `python -m module args` with `fault` injected."""
    return [sys.executable, __file__, fault, module, *args]


if __name__ == "__main__":
    main()
