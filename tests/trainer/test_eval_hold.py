"""`--hold-for-eval` against a real broker: no version is trained past one the eval has not measured, so an eval's
attempts are all served by the version it counts them for."""

from __future__ import annotations

import asyncio

import agentstream.schemas as s
from agentstream.trainer.eval_hold import EvalHold
from agentstream.trainer.service import Trainer
from tests.support.trainer import arithmetic_groups, publish, read_all, trainer_settings
from tests.support.wait import wait_for_async


def measured(version: int, run: str = "eval", model: str = "tiny") -> s.EvalEvent:
    return s.EvalEvent(source="eval", data=s.Eval(
        model=model, weight_version=version, run_id=f"{run}-{model}-v{version}-1", tasks=1, k=1, samples=1,
        pass_at_1=0.0, pass_at_k=0.0, solved_tasks=0))


async def test_only_the_validation_eval_of_the_model_and_version_releases_the_hold(kafka):
    # a probe of the train tasks, another model's eval and a later version's are not v0's measurement
    await publish(kafka, [measured(0, run="probe"), measured(0, model="other"), measured(3)])
    hold = EvalHold(kafka, "tiny")
    await hold.start()
    try:
        async def read_them() -> bool:
            await hold.holds(0)
            return 3 in hold.measured

        await wait_for_async(read_them, timeout=30, what="the hold reading the metrics topic")
        assert await hold.holds(0) and hold.measured == {3}
        await publish(kafka, [measured(0)])

        async def released() -> bool:
            return not await hold.holds(0)

        await wait_for_async(released, timeout=30, what="v0's eval event releasing the hold")
    finally:
        await hold.stop()


async def test_the_trainer_publishes_each_version_only_after_the_one_before_was_measured(kafka, tiny_model_dirs,
                                                                                           tmp_path):
    base = tiny_model_dirs[0]
    # two batches' worth of samples, there from the start: only the hold keeps v2 from following v1 at once
    await publish(kafka, [*arithmetic_groups(base, groups=4, group_size=4), measured(0)])
    trainer = Trainer(trainer_settings(kafka, tmp_path / "ckpt", base, max_versions=2, hold_for_eval=True))
    run = asyncio.create_task(trainer.run())
    try:
        await wait_for_async(lambda: len(trainer.published) == 1 or run.done(), timeout=120,
                             what="v1, trained after v0's eval event")
        assert trainer.hold is not None and len(trainer.published) == 1

        hold = trainer.hold
        await wait_for_async(lambda: hold.waiting_for == 1, timeout=30, what="the trainer holding at v1")
        assert len(trainer.published) == 1, "v2 came before v1 was measured"
        (written,) = await publish(kafka, [measured(1)])
        published = await asyncio.wait_for(run, timeout=120)
    finally:
        run.cancel()
    assert [event.data.version for event in published] == [1, 2]
    on_topic = {event.data.version: event for event in await read_all(kafka, kafka.topics.weights)}
    assert on_topic[2].time >= written.timestamp, "v2 was announced before v1's eval event was written"
