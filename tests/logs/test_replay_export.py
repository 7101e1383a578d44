"""`replay export --from <trajectories topic>` read in columns gives what pydantic row by row gave.

The reference here is the export as it was (each record decoded with pydantic, repeats dropped, the
selection applied, the event's bytes or `dataset.rows` written), over a topic of odd but valid
trajectories (ints where floats are due, unicode and escapes, empty turns, keys left out for their
defaults, formatted JSON) and bad or doubtful records (NaN and infinity, a key the model lacks, a
wrong type, a newer schema version, not JSON, an empty record, a repeated key, a lone surrogate).
"""

from __future__ import annotations

import math
import re
import uuid
from collections import Counter

import orjson
import polars as pl
import pytest

import agentstream.schemas as s
from agentstream.logs.replay import Job, Options, Selection, columnar, dataset, parse_versions, replay
from agentstream.schemas.codec import DecodeError, decode, encode
from agentstream.schemas.kafka import KafkaSettings, ensure_topics
from agentstream.schemas.scan import Record
from agentstream.streams.assembly import Timing
from samples.assembly import assemble
from tests.support.streams import Rollout

pytestmark = pytest.mark.timeout(120)


def base(rollout_id: str, version: int = 1) -> dict:
    (trajectory,) = assemble(Rollout(rollout_id, version=version).two_turns(merged=False, reward=0.25),
                             Timing(settle_ms=0))
    return orjson.loads(encode(trajectory))


def variant(rollout_id: str, version: int = 1, **data: object) -> dict:
    event = base(rollout_id, version)
    event["data"].update(data)
    return event


def odd_but_valid() -> list[bytes]:
    """Trajectories pydantic takes as they are, each a little unusual."""
    plain = base("r-plain")
    ints = variant("r-ints", reward=1)  # an int where a float is due: 1.0 in a row
    for part in (*ints["data"]["turns"], *ints["data"]["sequences"]):
        part["logprobs"] = [0, -1, *part["logprobs"][2:]]
    unicode = variant("r-ünï-😀", model="模型", task_id="tâche 🚀", group_id="g\n\t\"q\"")
    empty = variant("r-empty", turns=[], sequences=[], reward=None, reward_missing=True, lineage=[])
    no_turns = variant("r-seq-no-turns")
    for sequence in no_turns["data"]["sequences"]:
        sequence["turns"] = []
    defaults = base("r-defaults", version=2)
    defaults["schema_version"] = 1
    for key in ("split", "epoch", "sample_index", "reward_missing", "rewards", "merge_mismatches", "superseded"):
        defaults["data"].pop(key)
    extremes = variant("r-extremes", epoch=2**63 - 1, sample_index=-(2**63), reward=5e-324)
    for part in (*extremes["data"]["turns"], *extremes["data"]["sequences"]):
        part["logprobs"] = [-0.0, -0.8444218515250481, -1.2345678901234567e-300, *part["logprobs"][3:]]
    for sequence in extremes["data"]["sequences"]:
        sequence["weight_versions"] = [None] * len(sequence["weight_versions"])
    negative_turn = variant("r-last-turn")  # a sequence's turn counted from the end, as Python indexes
    negative_turn["data"]["sequences"][0]["turns"] = [-1]
    values = [orjson.dumps(e) for e in (plain, ints, unicode, empty, no_turns, defaults, extremes, negative_turn)]
    escaped = orjson.dumps(variant("r-escaped", model="e")).replace(b'"model":"e"', b'"model":"\\u00e9\\ud83d\\ude00"')
    formatted = orjson.dumps(base("r-formatted"), option=orjson.OPT_INDENT_2)
    return [*values, escaped, formatted]


def bad_or_doubtful() -> list[bytes | None]:
    """Records pydantic refuses, or takes though the native check does not (they go row by row)."""
    nan = orjson.dumps(variant("r-nan", reward=0.5)).replace(b'"reward":0.5', b'"reward":NaN')
    inf = orjson.dumps(variant("r-inf", reward=0.5)).replace(b'"reward":0.5', b'"reward":-Infinity')
    repeated_key = orjson.dumps(variant("r-repeated-key", model="a")).replace(b'"model":"a"', b'"model":"a","model":"b"')
    surrogate = orjson.dumps(variant("r-surrogate", model="a")).replace(b'"model":"a"', b'"model":"\\ud800"')
    newer = base("r-newer")
    newer["schema_version"] = s.SCHEMA_VERSION + 1
    unversioned = base("r-unversioned")
    del unversioned["schema_version"]
    return [nan, inf, repeated_key, surrogate, orjson.dumps(newer), orjson.dumps(unversioned),
            orjson.dumps(variant("r-extra", colour="red")), orjson.dumps(variant("r-null", status=None)),
            orjson.dumps({**base("r-call"), "type": "call"}), orjson.dumps(variant("r-float-int", epoch=1.0)),
            b"not json", b"", None, b"[1, 2]"]


async def topic_of(kafka_bootstrap: str, values: list[bytes | None]) -> KafkaSettings:
    """A topic `trajectories` of one partition (records in a known order) holding `values`."""
    from confluent_kafka import Producer

    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}.", partitions=1)
    assert (await ensure_topics(kafka)).ok
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    for value in values:
        producer.produce(kafka.topics.trajectories, value, b"k")
    assert producer.flush(30) == 0
    return kafka


def reference(values: list[bytes | None], sink: str, selection: Selection = Selection()) -> tuple[object, Counter]:
    """The export as it was: pydantic row by row."""
    counts: Counter[str] = Counter()
    seen: set[str] = set()
    lines, rows = [], []
    for value in values:
        try:
            trajectory = decode(value, expect=s.TrajectoryEvent)
        except DecodeError:
            counts["undecodable"] += 1
            continue
        if trajectory.id in seen:
            counts["repeats"] += 1
            continue
        seen.add(trajectory.id)
        if not selection.wants(trajectory):
            counts["not_selected"] += 1
            continue
        if sink == "events":
            lines.append(value)
        elif sink == "chat":
            lines += [orjson.dumps(row) for row in dataset.rows(trajectory, {})]
        else:
            rows += dataset.rows(trajectory, {}, messages_as_json=True)
    if sink == "parquet":
        return pl.DataFrame(rows, schema=dataset.SCHEMA), counts
    return b"".join(line + b"\n" for line in lines), counts


async def export(kafka: KafkaSettings, sink: str, tmp_path, batch_size: int, **selection: object):
    out = tmp_path / f"{sink}-{batch_size}-{uuid.uuid4().hex[:6]}"
    summary = await replay(kafka, Job("trajectories", sink, str(out), **selection),
                           Options(tmp_path / f"{out.name}.state", batch_size=batch_size))
    written = pl.read_parquet(out) if sink == "parquet" else out.read_bytes()
    return written, Counter({k: v for k, v in summary.counts.items() if v})


def test_the_odd_trajectories_fit_the_columns_and_the_bad_ones_do_not():
    good = odd_but_valid()
    records = [Record("t", 0, i, 0, None, value) for i, value in enumerate(good)]
    assert columnar.columns(records, rows=True).height == len(good)  # no Misfit: read in columns
    for value in bad_or_doubtful():
        with pytest.raises(columnar.Misfit):
            columnar.columns([Record("t", 0, 0, 0, None, value)], rows=False)


@pytest.mark.parametrize("sink", ["events", "chat", "parquet"])
async def test_export_of_stored_trajectories_equals_the_row_by_row_export(kafka_bootstrap, tmp_path, sink):
    good, bad = odd_but_valid(), bad_or_doubtful()
    mixed = [*good[:3], bad[0], *good[3:], good[1], *bad[1:], good[0], good[5]]  # repeats of good ones, too
    for values, batch_size in ((good, 5000), (mixed, 5000), (mixed, 3)):
        kafka = await topic_of(kafka_bootstrap, values)
        written, counts = await export(kafka, sink, tmp_path, batch_size)
        expected, expected_counts = reference(values, sink)
        if sink == "parquet":
            assert written.schema == expected.schema and written.height == expected.height
            assert written.to_dicts() == expected.to_dicts() or _same_with_nan(written, expected)
        else:
            assert written == expected
        assert counts == expected_counts


def _same_with_nan(a: pl.DataFrame, b: pl.DataFrame) -> bool:
    """Row for row equal, NaN equal to NaN (a NaN reward is taken row by row, as before)."""
    def key(row: dict) -> dict:
        return {k: "nan" if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}
    return [key(r) for r in a.to_dicts()] == [key(r) for r in b.to_dicts()]


async def test_export_selects_rollouts_and_versions_as_before(kafka_bootstrap, tmp_path):
    values = [orjson.dumps(base(f"r-{i}", version=i % 3)) for i in range(9)] + odd_but_valid()
    kafka = await topic_of(kafka_bootstrap, values)
    for selection in ({"rollouts": frozenset({"r-1", "r-4", "r-ints", "r-nope"})},
                      {"versions": parse_versions("1-2")}, {"versions": parse_versions("0")}):
        for sink in ("events", "chat"):
            written, counts = await export(kafka, sink, tmp_path, 4, **selection)
            expected, expected_counts = reference(values, sink, Selection(**selection))
            assert written == expected and counts == expected_counts, selection


# --- top -------------------------------------------------------------------------------------------


def top_records() -> list[bytes | None]:
    """Metrics and pool events as the streams worker and the gateway write them, odd ones, and bad ones."""
    def metrics(start: int, version: int, **values: float) -> s.MetricsEvent:
        return s.MetricsEvent(source="streams", data=s.Metrics(window_s=10, window_start=start, values=values,
                                                               group={"model": "tïny", "weight_version": str(version)}))

    pool = s.PoolUpdateEvent(source="gateway", data=s.PoolUpdate(
        model="tiny", version=2, server="http://vllm-a", status="ok", pause_ms=123.4, applied_by="gw-1"))
    good = [metrics(10_000, 1, calls=4, reward_sum=0.5), metrics(10_000, 1, calls=5, reward_sum=1.5),
            metrics(20_000, 2, calls=1), pool]
    values: list[bytes | None] = [encode(e) for e in good]
    ints = orjson.loads(values[2])
    ints["data"]["values"] = {"calls": 3, "latency_b10": 2}  # ints where floats are due
    failed = orjson.loads(values[3])
    failed["data"].update(status="failed", error="load failed", pause_ms=7, load_ms=None)
    failed["id"] = s.new_id()
    ungrouped = orjson.loads(encode(metrics(30_000, 3, calls=1)))
    del ungrouped["data"]["group"]  # its default
    untyped = orjson.loads(encode(metrics(40_000, 1, calls=9)))
    del untyped["type"]  # any event is told by its type: refused
    nan = encode(metrics(50_000, 1, calls=2.5)).replace(b"2.5", b"NaN")
    call = s.CallEvent(source="gateway", data=s.Call(api="completions", model="m", request={}, status=200,
                                                     started_at=1, latency_ms=1.0))
    return [*values, orjson.dumps(ints), orjson.dumps(failed), orjson.dumps(ungrouped), values[0], orjson.dumps(untyped),
            nan, encode(call), values[1].replace(b'"values"', b'"colour":1,"values"'), b"{", None]


def test_top_reads_a_batch_as_it_read_each_record():
    from agentstream.logs.top import TopView

    records = top_records()
    one_by_one, batched = TopView(), TopView()
    for value in records:
        one_by_one.add(value)
    batched.add_all(records)
    assert repr(batched.windows) == repr(one_by_one.windows)  # (repr: a NaN value, taken by pydantic, equals itself)
    assert batched.last_event_ms == one_by_one.last_event_ms
    assert [(at, u.model_dump()) for at, u in batched.pool] == [(at, u.model_dump()) for at, u in one_by_one.pool]
    assert all(type(v) is float for values in batched.windows.values() for v in values.values())
    assert len(batched.windows) == 4 and len(batched.pool) == 2


def test_top_reads_a_batch_of_metrics_in_columns_as_it_read_each_record():
    """Windows published again and again (the latest counts), one group written with its keys in two
    orders, a group left out, ints for floats, a repeated id; over two batches, the second updating
    windows of the first: the same windows, in the same order (the merges add in it), as one by one."""
    from agentstream.logs.top import TopView

    def event(start: int, group: dict, **values: float) -> dict:
        return orjson.loads(encode(s.MetricsEvent(source="streams", data=s.Metrics(
            window_s=10, window_start=start, group=group, values=values))))

    a, b = {"model": "m", "weight_version": "1"}, {"weight_version": "1", "model": "m"}
    events = [event(20_000, a, calls=1), event(10_000, b, calls=2.5), event(10_000, a, calls=3),
              event(30_000, {"model": "ü"}, calls=4), event(20_000, a, calls=5)]
    ungrouped = event(40_000, {}, calls=6)
    del ungrouped["data"]["group"]
    ints = event(30_000, {"model": "ü"}, calls=0)
    ints["data"]["values"] = {"calls": 7, "errors": 1}
    batches = [[orjson.dumps(e) for e in events], [orjson.dumps(e) for e in (ungrouped, ints, events[2], event(10_000, a))]]
    one_by_one, batched = TopView(), TopView()
    for batch in batches:
        for value in batch:
            one_by_one.add(value)
        batched.add_all(batch)
    assert list(batched.windows.items()) == list(one_by_one.windows.items())
    assert batched.last_event_ms == one_by_one.last_event_ms
    assert all(type(v) is float for values in batched.windows.values() for v in values.values())
    assert batched.windows[10, 10_000, (("model", "m"), ("weight_version", "1"))] == {}


def test_polars_writes_json_lines_as_orjson_does():
    """The chat rows made from columns are written by polars (`JsonlSink`): the same bytes as orjson's
    for every kind of value a row holds (floats of every exponent, subnormals; ints to 64 bits; text of
    every code point to U+3000, astral ones, escapes; lists with nulls, empty lists, nulls, booleans)."""
    import io
    import random
    import struct

    rng = random.Random(0)
    floats = [struct.unpack("d", struct.pack("Q", rng.getrandbits(64)))[0] for _ in range(50_000)]
    floats = [f for f in floats if math.isfinite(f)] + [rng.uniform(-30, 0) for _ in range(20_000)]
    floats += [2.0**k for k in range(-1074, 1024)] + [-0.0, 0.0, 1.0, 1e16, 1e-7, 123456789.123]
    ints = [0, -1, 2**63 - 1, -(2**63)] + [rng.randrange(-(2**63), 2**63) for _ in range(5_000)]
    texts = [chr(c) for c in range(0x3000) if not 0xD800 <= c < 0xE000] + ["\U0001F600", "\U0010FFFF", "\uffff", "a\\\\b\"c"]
    frames = [pl.DataFrame({"f": floats}), pl.DataFrame({"i": ints}), pl.DataFrame({"s": texts}),
              pl.DataFrame({"l": [[1, None], [], None], "b": [True, False, None], "x": [[0.5], [], [None]]})]
    for frame in frames:
        written = io.BytesIO()
        frame.write_ndjson(written)
        assert written.getvalue() == b"".join(orjson.dumps(row) + b"\n" for row in frame.iter_rows(named=True))


@pytest.mark.parametrize("sink", ["events", "chat"])
async def test_export_from_the_archive_and_its_tail_equals_the_row_by_row_export(kafka_bootstrap, tmp_path, sink):
    """Stored trajectories read back from the Parquet archive (records, not fetches), then the tail after
    it from Kafka: the same output and counts."""
    from confluent_kafka import Producer

    from agentstream.archive import Archiver
    from agentstream.schemas.scan import Origin

    good, bad = odd_but_valid(), bad_or_doubtful()
    first, later = [*good[:6], bad[2], good[0]], [*good[6:], bad[6], good[1]]
    kafka = await topic_of(kafka_bootstrap, first)
    await Archiver(kafka, tmp_path / "archive", tables=("trajectories",), say=lambda _: None).cycle()
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    for value in later:
        producer.produce(kafka.topics.trajectories, value, b"k")
    assert producer.flush(30) == 0
    out = tmp_path / f"{sink}.jsonl"
    summary = await replay(kafka, Job("trajectories", sink, str(out)),
                           Options(tmp_path / "state", batch_size=3, origin=Origin("auto", tmp_path / "archive")))
    expected, expected_counts = reference(first + later, sink)
    assert out.read_bytes() == expected
    assert Counter({k: v for k, v in summary.counts.items() if v}) == expected_counts


def test_every_event_type_has_a_shape_and_a_fitting_record_is_one_pydantic_takes_as_it_is():
    """Never looser than pydantic: records changed at random (a byte replaced, dropped or doubled, a
    value swapped for another kind) that still fit the trajectory's shape decode with pydantic, to the
    same id and rollout id the check takes."""
    import random

    from agentstream.schemas.shapes import shape

    for cls in s.EVENT_TYPES:
        shape(cls)
        shape(cls, tagged=True)
    rng = random.Random(0)
    sources = [value for value in odd_but_valid()]
    swaps = [b"null", b"1", b"1.5", b"-1", b"true", b'"x"', b"[]", b"{}", b"NaN", b"1e400", b'"\\ud800"']
    changed = []
    for _ in range(3000):
        value = bytearray(rng.choice(sources))
        at = rng.randrange(len(value))
        kind = rng.randrange(4)
        if kind == 0:
            value[at] = rng.randrange(256)
        elif kind == 1:
            del value[at]
        elif kind == 2:
            value[at:at] = value[at:at + rng.randrange(1, 8)]
        else:  # a value (after a key's colon, up to the next comma or brace) swapped for another kind
            at = rng.choice([match.end() for match in re.finditer(rb'":', value)])
            end = re.compile(rb"[,}]").search(value, at)
            value[at:end.start() if end else at] = rng.choice(swaps)
        changed.append(bytes(value))
    checked = shape(s.TrajectoryEvent, take=("id", "rollout_id"))
    misfits, (ids, rollout_ids) = checked.check(changed)
    fitting = set(range(len(changed))) - set(misfits)
    assert len(fitting) > 100 and len(misfits) > 100  # both kinds met
    assert len({changed[i] for i in fitting} - set(sources)) > 100  # changed, and still fitting
    for i in fitting:
        event = decode(changed[i], expect=s.TrajectoryEvent)  # DecodeError here: the check was looser
        assert (event.id, event.rollout_id) == (ids[i], rollout_ids[i])


def test_a_model_with_a_constraint_or_a_validator_has_no_shape():
    """A shape checks types only: a model that pydantic checks further cannot have one (it would be looser)."""
    from pydantic import BaseModel, Field, field_validator

    from agentstream.schemas.shapes import shape

    class Bounded(s.RolloutStartedEvent):
        retries: int = Field(0, ge=0)

    class Checked(s.RolloutStartedEvent):
        @field_validator("rollout_id")
        @classmethod
        def known(cls, value: str) -> str:
            return value

    class Inner(BaseModel):
        name: str = Field(max_length=3)

    class Nesting(s.RolloutStartedEvent):
        inner: Inner | None = None

    for model, complaint in ((Bounded, "is constrained"), (Checked, "has validators"), (Nesting, "is constrained")):
        with pytest.raises(TypeError, match=complaint):
            shape(model)
