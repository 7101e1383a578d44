"""The fast decoding of records into table columns gives what the row-by-row decoding gives.

`agentstream.logs.query.decode` reads a batch with msgspec and polars; `_decode_rows` (one dict per record,
the way queries read before) is the reference: on every batch here both must make the same frame,
and the fast way must actually be taken where the records fit the models. No broker: records are
made in memory, as Kafka would hand them over.
"""

from __future__ import annotations

import json as _json
import random as _random

import orjson
import polars as pl
import pytest
from agentstream_native import take
from polars.testing import assert_frame_equal

import agentstream.schemas as s
from agentstream.logs.query import (
    TABLES,
    _columns,
    _decode_rows,
    _fields,
    _sub_records,
    decode_aligned,
    table_fields,
    table_schema,
)
from agentstream.schemas.codec import encode
from agentstream.schemas.scan import Record


def records(values: list[bytes | None]) -> list[Record]:
    return [Record("t", i % 3, 100 + i, 1_700_000_000_000 + i, None, v) for i, v in enumerate(values)]


def careful(batch: list[Record], table: str) -> pl.DataFrame:
    schema = table_schema(table)
    return _decode_rows(batch, schema, list(schema))


def fast_way_taken(batch: list[Record], table: str) -> bool:
    try:
        _columns(batch, ("id", "schema_version", "time", "source", "rollout_id", "attempt_id"), table_fields(table),
                 _sub_records(table))
    except ValueError:
        return False
    return True


def call(**overrides) -> s.CallEvent:
    data = dict(api="chat.completions", model="tiny", request={"messages": [{"role": "user", "content": "hi"}]},
                status=200, started_at=1, latency_ms=12.5)
    return s.CallEvent(source="test", rollout_id="r1", attempt_id="a", data=s.Call(**{**data, **overrides}))


CALLS = [
    call(),  # every optional field missing: no token lists, no usage, no upstream
    call(upstream="http://ü.example:8000", weight_version=3, streamed=True, session_id="séance",
         request={"messages": [{"role": "user", "content": "日本語 \"quoted\" \\ back\nslash 🎉"}], "n": 1.5e-7},
         response={"choices": [{"message": {"content": "ok"}}], "big": 2 ** 62, "neg": -0.0, "list": [1, "two", None]},
         prompt_token_ids=[0, 1, 151_643, 2 ** 40], completion_token_ids=[], logprobs=[],
         finish_reason="length", usage=s.Usage(prompt_tokens=4, completion_tokens=0, total_tokens=4),
         status=502, error="upstream: ∅", ttft_ms=3.25, retry_count=2),
    call(prompt_token_ids=[7], completion_token_ids=[8, 9, 10],
         logprobs=[-0.0, -5e-324, -1e-300, -123456.789012345678, 0.1],
         extra_choices=[s.ChoiceTokens(index=1, completion_token_ids=[4, 5], logprobs=[-0.5, -0.25],
                                       finish_reason="stop")],
         response=None, ttft_ms=None),
]


def test_calls_with_unicode_and_missing_fields_decode_the_same_either_way():
    batch = records([encode(e) for e in CALLS])
    assert fast_way_taken(batch, "calls")
    fast = decode_aligned(batch, "calls")
    assert_frame_equal(fast, careful(batch, "calls"))
    row = fast.row(1, named=True)
    assert orjson.loads(row["request"])["messages"][0]["content"] == "日本語 \"quoted\" \\ back\nslash 🎉"
    assert row["prompt_token_ids"] == [0, 1, 151_643, 2 ** 40] and row["completion_token_ids"] == []
    assert fast.row(0, named=True)["prompt_token_ids"] is None and fast.row(0, named=True)["usage_total_tokens"] is None
    assert fast.row(2, named=True)["logprobs"] == [-0.0, -5e-324, -1e-300, -123456.789012345678, 0.1]
    assert fast.row(2, named=True)["response"] is None


def test_records_that_are_not_events_keep_their_place_and_nothing_else():
    values = [encode(CALLS[1]), b"not json", None, b'{"type": "no.such.type", "data": {"status": 1}}',
              b"[1, 2]", encode(CALLS[2])]
    batch = records(values)
    fast = decode_aligned(batch, "calls")
    assert_frame_equal(fast, careful(batch, "calls"))
    assert fast["readable"].to_list() == [True, False, False, False, False, True]
    assert fast["kafka_offset"].to_list() == [100, 101, 102, 103, 104, 105]


@pytest.mark.parametrize("bad", [
    b'"prompt_token_ids": [1, 2.5]', b'"prompt_token_ids": [[1], [2]]', b'"prompt_token_ids": ["1"]',
    b'"logprobs": [true]', b'"status": "200"', b'"prompt_token_ids": [1,2 ]',
])
def test_a_field_off_its_type_sends_the_batch_the_careful_way(bad):
    """Strict, not silently coerced: the batch is read row by row, as before (same frame)."""
    good = encode(CALLS[1])
    value = good.replace(b'"retry_count":2', b'"retry_count":2,' + bad.replace(b": ", b":", 1))
    batch = records([good, value])
    assert not fast_way_taken(batch, "calls")
    assert_frame_equal(decode_aligned(batch, "calls"), careful(batch, "calls"))


def known_events() -> list[s.Event]:
    ids = dict(source="test", rollout_id="r1", attempt_id="a")
    return [
        s.RolloutQueuedEvent(**ids, data=s.RolloutQueued(
            task=s.Task(id="t-ü", input={"prompt": "2+2 = ?", "nested": {"k": [1, 2.5, None]}}, metadata={"a": 1}),
            group_id="g")),
        s.RolloutQueuedEvent(**ids, data=s.RolloutQueued(task=s.Task(id="t2", input="just text"), group_id="g")),
        s.RewardEvent(**ids, data=s.Reward(value=0.5, details={"passed": 3, "note": "ß"})),
        s.RolloutFinishedEvent(**ids, data=s.RolloutFinished(by="agent")),
        s.TrajectoryEvent(**ids, data=s.Trajectory(
            status="finished", reward=1.0, reward_missing=False, merged=True, weight_version_launch=2,
            finished_at=5, lineage=["c1"], turns=[s.Turn(call_id="c1", sequence=0, prompt_token_ids=[1, 2],
                                                          completion_token_ids=[3], logprobs=[-0.1])],
            sequences=[])),
    ]


@pytest.mark.parametrize("table", TABLES)
def test_every_table_decodes_the_same_either_way(table):
    events = [e for e in known_events() if e.topic == table]
    batch = records([encode(e) for e in events] + [b"{}"])
    assert_frame_equal(decode_aligned(batch, table), careful(batch, table))
    columns = frozenset({"id", "kafka_offset", *(f.column for f in table_fields(table)[:2])})
    schema = table_schema(table)
    chosen = [n for n in schema if n in columns]
    assert_frame_equal(decode_aligned(batch, table, columns), _decode_rows(batch, schema, chosen))


# --- the native decoder on what other writers (or attackers) put in the log ---------------------

REQUEST_TEXTS = [
    b'{ "messages" : [ ] ,\n "temperature" : 0.7 }',  # spaces and a float: orjson writes them again
    b'{"a":"\\u00e9\\/","b":"\\ud83c\\udf89"}',  # escapes orjson does not write
    b'{"a":1,"a":2}',  # a repeated key: orjson keeps the last
    b'{"u64":18446744073709551615,"beyond":18446744073709551616,"low":-9223372036854775809,"z":-0}',
    b'{"c":"\\u001F\\u001f\\u000b\\n\\t\\b\\f\\r\\"\\\\","d":"\x7f"}',  # control characters, upper- and lowercase
    b'{"f":1E2,"g":1.5e-7,"h":1e16,"i":0.1,"j":-0.0,"k":5e-324}',
    b'[1,[2,[3,{"k":null}]],true,false,"x"]',
    b'"just text"',
    b'{"messages":[{"role":"user","content":"plain, as orjson writes it"}],"n":2,"deep":{"x":[[],{}]}}',
]


@pytest.mark.parametrize("text", REQUEST_TEXTS)
def test_free_form_json_comes_out_as_orjson_writes_it(text):
    good = encode(CALLS[1])
    start = good.index(b'"request":') + len(b'"request":')
    end = good.index(b',"response":')
    batch = records([good[:start] + text + good[end:], good])
    assert fast_way_taken(batch, "calls")
    fast = decode_aligned(batch, "calls")
    assert_frame_equal(fast, careful(batch, "calls"))
    assert fast["request"][0] == orjson.dumps(orjson.loads(text)).decode()


def test_records_written_by_another_writer_decode_the_same():
    """Indented, ASCII-only with \\u escapes (Python's json), keys escaped: the same rows."""
    import json

    events = [orjson.loads(encode(e)) for e in CALLS]
    values = [json.dumps(events[1], indent=1).encode(), json.dumps(events[2], ensure_ascii=True).encode(),
              json.dumps(events[0]).replace('"type"', '"ty\\u0070e"').encode()]
    batch = records(values)
    assert fast_way_taken(batch, "calls")
    fast = decode_aligned(batch, "calls")
    assert_frame_equal(fast, careful(batch, "calls"))
    assert fast["readable"].all() and fast["session_id"][0] == "séance"
    assert assert_frame_equal(fast.drop("kafka_offset", "kafka_partition", "kafka_timestamp"),
                              decode_aligned(records([encode(CALLS[1]), encode(CALLS[2]), encode(CALLS[0])]), "calls")
                              .drop("kafka_offset", "kafka_partition", "kafka_timestamp")) is None


@pytest.mark.parametrize("field, text, expected", [
    ("latency_ms", b"12", 12.0), ("latency_ms", b"1E2", 100.0), ("latency_ms", b"-0.0", -0.0),
    ("latency_ms", b"12345678901234567890123", 1.2345678901234568e22), ("latency_ms", b"2.2250738585072014e-308", 2.2250738585072014e-308),
    ("status", b"-9223372036854775808", -2 ** 63), ("status", b"9223372036854775807", 2 ** 63 - 1),
    ("status", b"null", None), ("error", b'"\\ud83c\\udf89 \\"q\\" \\/"', '🎉 "q" /'), ("error", "\"ünï\"".encode(), "ünï"),
    ("prompt_token_ids", b"[ ]", []), ("prompt_token_ids", b"[1 , -0 ,2]", [1, 0, 2]), ("prompt_token_ids", b"null", None),
    ("logprobs", b"[-1E-5,0,-0.0,-1.7976931348623157e308]", [-1e-5, 0.0, -0.0, -1.7976931348623157e308]),
    ("extra_choices", b'[{"index":3,"unknown":{"x":[1]}}]', [{"index": 3, "completion_token_ids": None, "logprobs": None,
                                                               "finish_reason": None}]),
])
def test_odd_values_of_each_type_decode_the_same_either_way(field, text, expected):
    event = orjson.loads(encode(CALLS[1]))
    event["data"][field] = "PLACEHOLDER"
    value = orjson.dumps(event).replace(b'"PLACEHOLDER"', text)
    batch = records([value])
    assert fast_way_taken(batch, "calls")
    fast = decode_aligned(batch, "calls")
    assert_frame_equal(fast, careful(batch, "calls"))
    assert fast[field].to_list() == [expected]


@pytest.mark.parametrize("value", [
    b'{"type":"call","data":{"status":200}} trailing', b'{"type":"call","data":{"status":200}', b"",
    b"\xff\xfe{}", b'{"type":"call","data":{"error":"\xff"}}', b'{"type":"call","data":{"error":"\\ud800"}}',
    b'{"type":"call","data":{"status":200,"status":201}}', b'{"type":"call","type":"reward"}',
    b'{"type":"call","data":{"latency_ms":NaN}}', b'{"type":"call","data":{"latency_ms":1e400}}',
    b'{"type":"call","data":{"status":01}}', b'{"type":"call","data":{"usage":[1]}}', b'{"type":"call","data":[]}',
    b'{"type":"call","data":{"error":"a\tb"}}', b'{"type":"call","data":{"prompt_token_ids":[1,]}}',
    b'{"type":"call","data":{"request":{"a":tru}}}', b"null", b'{"type":1}',
])
def test_a_record_that_is_not_a_fitting_event_sends_the_batch_the_careful_way(value):
    batch = records([encode(CALLS[1]), value, encode(CALLS[2])])
    assert not fast_way_taken(batch, "calls")
    fast = decode_aligned(batch, "calls")
    assert_frame_equal(fast, careful(batch, "calls"))
    assert fast["readable"][0] and fast["readable"][2]


def test_numbers_of_every_length_decode_the_same_either_way():
    """Token ids of 1 to 19 digits, signs, and floats of every form, around the decoder's 8-byte steps."""
    import random

    rng = random.Random(7)
    ids = [0, -1, 2 ** 63 - 1, -2 ** 63] + [rng.randrange(10 ** (n - 1), 10 ** n) * rng.choice((1, -1))
                                            for n in range(1, 20) for _ in range(3)]
    floats = [rng.uniform(-1, 1) * 10.0 ** rng.randrange(-320, 300) for _ in range(200)] + [1.0, -0.0, 1e-7, 12.0]
    assert_lists_decode_the_same(ids, floats)


def test_numbers_read_in_one_step_decode_the_same_either_way():
    """Token ids of 1 to 7 digits and floats without an exponent whose digits make at most 2^53 take the
    decoder's one-step reads (a float: Clinger's fast path); around those limits (2^53, 8 digits, 19
    digits, signs, zeros) the full parser reads them: either way, the doubles orjson reads."""
    import random

    rng = random.Random(11)
    floats = [round(rng.uniform(-1, 1) * 10.0 ** rng.randrange(0, 12), rng.randrange(0, 19)) for _ in range(2000)]
    floats += [rng.random() for _ in range(500)] + [0.1, 0.2, 0.30000000000000004, -0.0, 0.0, 1.0000000000000002,
                                                   9007199254740992.0, 9007199254740994.0, 0.9007199254740993,
                                                   0.9007199254740992, 900719925474099.3, 123456789012.34567]
    ids = [rng.randrange(10 ** rng.randrange(0, 9)) for _ in range(2000)] + [0, 9_999_999, 10_000_000, 99_999_999]
    assert_lists_decode_the_same(ids, floats)



def assert_lists_decode_the_same(ids: list[int], floats: list[float]) -> None:
    """Calls made of these token ids and logprobs (rotated) decode the native way as row by row."""
    events = [call(prompt_token_ids=ids[i:] + ids[:i], logprobs=floats[i:] + floats[:i]) for i in range(0, 40, 7)]
    batch = records([encode(e) for e in events])
    assert fast_way_taken(batch, "calls")
    fast = decode_aligned(batch, "calls")
    assert_frame_equal(fast, careful(batch, "calls"))
    assert fast["prompt_token_ids"][0].to_list() == ids and fast["logprobs"][0].to_list() == floats

@pytest.mark.parametrize(("field", "text", "fits"), [
    ("logprobs", b"[0.1,-0.0,0.30000000000000004,9007199254740993.0,9007199254740993.5,0.9007199254740993,12.5e1,5.0]",
     True),
    ("logprobs", b"[1234567.000000000001,0.0000000000000000001,0.00000000000000000001,1.5 ,2.5]", True),
    ("logprobs", b"[0,7,1234567,12345678,99999999,-5,0]", True),
    ("prompt_token_ids", b"[0,7,1234567,12345678,99999999,-5,0,1 ,2, 3,4]", True),
    ("prompt_token_ids", b"[01,2]", False), ("prompt_token_ids", b"[1,2.0]", False),
    ("prompt_token_ids", b"[1,2,]", False), ("prompt_token_ids", b"[1,-]", False),
    ("logprobs", b"[01.5,2.0]", False), ("logprobs", b"[1.,2.0]", False), ("logprobs", b"[1.5,]", False),
    ("logprobs", b"[-.5]", False), ("logprobs", b"[1.5,2.5", False),
])
def test_numbers_near_the_one_step_reads_decode_the_same_either_way(field, text, fits):
    """Read into their column, and checked and skipped when the query does not ask for it."""
    event = orjson.loads(encode(CALLS[1]))
    event["data"][field] = "PLACEHOLDER"
    batch = records([orjson.dumps(event).replace(b'"PLACEHOLDER"', text)])
    assert fast_way_taken(batch, "calls") == fits
    assert_frame_equal(decode_aligned(batch, "calls"), careful(batch, "calls"))
    columns = frozenset({"id", "kafka_offset", "status"})
    schema = table_schema("calls")
    assert_frame_equal(decode_aligned(batch, "calls", columns), _decode_rows(batch, schema, [n for n in schema
                                                                                             if n in columns]))
    def fits_json(read) -> bool:
        try:
            read()
        except (ValueError, orjson.JSONDecodeError):
            return False
        return True

    # skipped, a value need only be JSON (`[1,2.0]` is, if not token ids)
    assert fits_json(lambda: _columns(batch, ("id",), tuple(f for f in table_fields("calls") if f.column == "status"),
                                      _sub_records("calls"))) == fits_json(lambda: orjson.loads(text))


def test_take_keeps_the_messages_of_the_range_and_sets_errors_apart():
    """`take` (a columnar scan's fetch, librdkafka's messages in bulk): a partition's messages before its end
    kept, those at or past it and those of a partition not asked dropped, errors apart; the same list when
    all are kept. A fetch decodes as the `Record`s of the same messages do."""
    from confluent_kafka import KafkaError, Message

    from agentstream.logs.query import decode
    from agentstream.schemas.scan import Fetch

    values = [encode(e) for e in CALLS]

    def message(partition: int, offset: int, value: bytes | None = None) -> Message:
        return Message(topic="t", partition=partition, offset=offset, timestamp=(1, 1_700_000_000_000 + offset),
                       key=b"k", value=value if value is not None else values[offset % 3])

    eof = Message(topic="t", partition=1, offset=12, error=KafkaError(KafkaError._PARTITION_EOF))
    fetched = [message(0, 1), message(1, 9), message(0, 2), message(0, 3), message(2, 0), eof, message(1, 10),
               message(1, 11, b"not json")]
    kept, taken, errors, positions = take(fetched, {0: 3, 1: 12})
    assert [(m.partition(), m.offset()) for m in kept] == [(0, 1), (1, 9), (0, 2), (1, 10), (1, 11)]
    assert len(taken) == 5 and errors == [eof] and positions == {0: 3, 1: 12}
    whole = [message(0, 1), message(0, 2)]
    assert take(whole, {0: 3})[0] is whole

    fetch = Fetch("t", kept, taken)
    records = fetch.records()
    assert [(r.partition, r.offset, r.timestamp, r.value) for r in records] == [
        (m.partition(), m.offset(), m.timestamp()[1], m.value()) for m in kept]
    assert not fast_way_taken(records, "calls")  # the record that is not JSON: read row by row, from the fetch
    got, unreadable = decode(fetch, "calls")
    assert_frame_equal(got, decode(records, "calls")[0])
    assert unreadable == 1 and got.height == 4
    good = Fetch("t", kept[:4], take(kept[:4], {0: 3, 1: 12})[1])
    assert_frame_equal(decode(good, "calls")[0], decode(records[:4], "calls")[0])


def test_a_deeply_nested_request_is_refused_not_a_crash():
    """JSON nested thousands deep (an attack on recursive parsers): that record is unreadable, as orjson finds it."""
    good = encode(CALLS[1])
    start = good.index(b'"request":') + len(b'"request":')
    end = good.index(b',"response":')
    deep = good[:start] + b"[" * 5000 + b"]" * 5000 + good[end:]
    batch = records([good, deep])
    assert not fast_way_taken(batch, "calls")
    fast = decode_aligned(batch, "calls")
    assert_frame_equal(fast, careful(batch, "calls"))
    assert fast["readable"].to_list() == [True, False]


# --- a seeded differential test: random records, every writer, both ways -----------------------
# Records made at random from the tables' columns: values within and off the models' types, odd
# numbers and strings, missing, null, extra and repeated keys, shuffled keys, random whitespace,
# truncated records and bytes that are not UTF-8, written by orjson, Python's json and a hand writer.
# On each small batch the native way either gives the row-by-row frame or raises (and the batch is
# then read row by row, giving that frame too); it must be taken on over a quarter of the batches.

_CHARS = ['a', 'Z', ' ', '"', '\\', '/', '\b', '\f', '\n', '\r', '\t', '\x00', '\x1f', '\x7f', 'é', 'ß', '∅',
          '日本', '\u2028', '\ufeff', '🎉', '\U0010ffff', 'plain words ', '\\u00e9', '\ud800']  # a lone surrogate last


def _text(rng: _random.Random) -> str:
    chars = _CHARS if rng.random() < 0.005 else _CHARS[:-1]  # a lone surrogate: unreadable row by row
    return "".join(rng.choice(chars) for _ in range(rng.choice((0, 1, 3, 12))))


def _int(rng: _random.Random) -> int:
    bits = rng.choice((1, 7, 8, 31, 32, 53, 56, 62, 63, 63, 64, 65, 70, 100))
    return rng.choice((1, -1)) * rng.randrange(2 ** (bits - 1), 2 ** bits) if rng.random() < 0.9 else rng.choice(
        (0, 2 ** 63 - 1, -2 ** 63, 2 ** 63, -2 ** 63 - 1, 2 ** 64))


def _float(rng: _random.Random) -> float | int:
    return rng.choice((
        lambda: rng.uniform(-1, 1) * 10.0 ** rng.randrange(-330, 309), lambda: -0.0, lambda: 0.0, lambda: 5e-324,
        lambda: 1.7976931348623157e308, lambda: 2.2250738585072014e-308, lambda: rng.randrange(-10 ** 6, 10 ** 6),
        lambda: float(rng.randrange(10 ** 18)), lambda: rng.random(), lambda: 1e16, lambda: 1.5e-7,
    ))()


def _junk(rng: _random.Random, depth: int = 0):
    """Any JSON value: what free-form fields and extra keys hold, and values off a column's type."""
    pick = rng.randrange(10 if depth < 3 else 7)
    if pick == 0:
        return None
    if pick == 1:
        return rng.random() < 0.5
    if pick == 2:
        return _int(rng)
    if pick == 3:
        return _float(rng)
    if pick in (4, 5, 6):
        return _text(rng)
    if pick in (7, 8):
        return {_text(rng) or "k": _junk(rng, depth + 1) for _ in range(rng.randrange(4))}
    return [_junk(rng, depth + 1) for _ in range(rng.randrange(5))]


def _value(rng: _random.Random, dtype: pl.DataType, json: bool = False, depth: int = 0, off: float = 0.0):
    """A value of the column's type, mostly; now and then null, or (at the rate `off`) another type."""
    roll = rng.random()
    if roll < 0.08:
        return None
    if roll < 0.08 + off or json:
        return _junk(rng)
    if isinstance(dtype, pl.List):
        long = (0, 1, 2, 5, 40) if depth == 0 and not isinstance(dtype.inner, pl.Struct) else (0, 1, 3)
        return [_value(rng, dtype.inner, depth=depth + 1, off=off) if rng.random() < off else
                _typed(rng, dtype.inner, depth + 1, off) for _ in range(rng.choice(long))]
    return _typed(rng, dtype, depth, off)


def _typed(rng: _random.Random, dtype: pl.DataType, depth: int = 0, off: float = 0.0):
    if isinstance(dtype, pl.Struct):
        item = {f.name: _value(rng, f.dtype, depth=depth, off=off) for f in dtype.fields if rng.random() < 0.85}
        if rng.random() < 0.1:  # a key not in the model, a scalar: polars, row by row, fails on an object in one
            # item and a number in another, making the record unreadable (the native way reads it, rightly)
            item["extra"] = rng.choice((None, 1, 2.5, _text(rng)))
        return item
    if isinstance(dtype, pl.List):
        return _value(rng, dtype, depth=depth, off=off)
    if dtype == pl.Int64:  # beyond 64 bits now and then (`_int`)
        return _int(rng) if rng.random() < off else rng.randrange(-5, 10 ** rng.randrange(1, 19))
    if dtype == pl.Float64:
        return _float(rng)
    if dtype == pl.Boolean:
        return rng.random() < 0.5
    return _text(rng)


def _event(rng: _random.Random, table: str, off: float) -> dict:
    classes = {cls.model_fields["type"].default: cls for cls in s.EVENT_TYPES if cls.topic == table}
    kind = rng.choice(sorted(classes)) if rng.random() < 0.95 else rng.choice(("no.such", None, 3, ""))
    # the fields of that type only: a sub-record of another type's (task.id in rollout.started) is not
    # read row by row, so the two ways differ there (left alone: no writer puts it there)
    fields = _fields(classes[kind].model_fields["data"].annotation) if kind in classes else table_fields(table)
    data: dict = {}
    for f in fields:
        if rng.random() < 0.3:
            continue  # missing
        node = data
        for part in f.path[:-1]:
            if not isinstance(node.get(part, {}), dict):
                break
            node = node.setdefault(part, {} if rng.random() >= 3 * off else rng.choice((None, [], 1)))
            if not isinstance(node, dict):
                break
        else:
            node[f.path[-1]] = _value(rng, f.dtype, f.json, off=off)
    if rng.random() < 0.15:
        data["unknown_" + _text(rng)] = _junk(rng)
    event = {"type": kind, "id": _text(rng), "schema_version": rng.choice((1, 2, _int(rng) if off else -1)),
             "time": _int(rng) if rng.random() < off else 1_700_000_000_000, "source": _text(rng),
             "rollout_id": rng.choice((None, "r1", _text(rng))), "attempt_id": "a",
             "data": data if rng.random() >= off else rng.choice((None, [], "x", 1, 0))}
    if rng.random() < 0.1:
        del event[rng.choice(list(event))]
    return event


def _hand_written(value, rng: _random.Random, ascii_only: bool) -> str:
    """JSON as another writer might put it: random whitespace, keys shuffled or repeated, numbers in other forms."""
    def ws() -> str:
        return "".join(rng.choice(" \t\n\r") for _ in range(rng.choice((0, 0, 0, 1, 3))))

    def key(k: str) -> str:  # now and then its first character escaped: "\u0074ype"
        if k and rng.random() < 0.03:
            return f'"\\u{ord(k[0]):04x}' + _json.dumps(k[1:], ensure_ascii=ascii_only)[1:]
        return _json.dumps(k, ensure_ascii=ascii_only)

    def write(v) -> str:
        if isinstance(v, dict):
            items = list(v.items())
            if rng.random() < 0.3:
                rng.shuffle(items)
            if items and rng.random() < 0.03:
                items.insert(0, (items[-1][0], _junk(rng)))  # a repeated key, the last one wins in orjson
            return "{" + ws() + ",".join(f"{ws()}{key(k)}{ws()}:{ws()}{write(x)}{ws()}" for k, x in items) + "}"
        if isinstance(v, list):
            return "[" + ws() + ",".join(ws() + write(x) + ws() for x in v) + "]"
        if isinstance(v, float) and v == v and abs(v) != float("inf"):
            return rng.choice((repr, lambda f: f"{f:.17g}", lambda f: f"{f:E}", lambda f: f"{f:.17e}"))(v)
        return _json.dumps(v, ensure_ascii=ascii_only)

    return ws() + write(value) + ws()


def _write(event: dict, rng: _random.Random, off: float) -> bytes:
    pick = rng.randrange(4)
    try:
        if pick == 0:
            value = orjson.dumps(event)
        elif pick == 1:
            value = _json.dumps(event, indent=rng.choice((None, 0, 2, "\t")), ensure_ascii=rng.random() < 0.5,
                                separators=rng.choice((None, (",", ":"), (" , ", " : ")))).encode("utf-8", "surrogatepass")
        else:
            value = _hand_written(event, rng, ascii_only=rng.random() < 0.5).encode("utf-8", "surrogatepass")
    except (TypeError, orjson.JSONEncodeError):  # orjson refuses ints beyond 64 bits: Python's json writes them
        value = _json.dumps(event).encode()
    roll = rng.random() / off if off else 1.0
    if roll < 0.3:
        value = value[:rng.randrange(len(value))]  # truncated
    elif roll < 0.6:
        cut = rng.randrange(len(value))
        value = value[:cut] + rng.choice((b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\x80")) + value[cut:]
    elif roll < 0.8:
        value = value.replace(b'"', b'"\xe9', 1) if b'"' in value else value  # not UTF-8, inside a string
    return value


@pytest.mark.parametrize("table", TABLES)
def test_random_records_decode_the_same_either_way(table):
    rng = _random.Random(f"differential-{table}")
    schema = table_schema(table)
    taken = batches = 0
    unreadable = 0
    for _ in range(120):  # ~400 records
        offs = [rng.choice((0.0, 0.0, 0.0, 0.02, 0.1)) for _ in range(rng.choice((1, 1, 2, 4, 8)))]
        batch = records([_write(_event(rng, table, off), rng, off) if rng.random() < 0.98 else None for off in offs])
        columns = None if rng.random() < 0.6 else frozenset(rng.sample(list(schema), 4)) | {"kafka_offset"}
        wanted = [n for n in schema if columns is None or n in columns]
        got = decode_aligned(batch, table, columns)
        assert_frame_equal(got, _decode_rows(batch, schema, wanted))
        batches += 1
        taken += fast_way_taken(batch, table)
        unreadable += int((~got["readable"]).sum())
    assert taken > batches // 4, f"the native way was taken on only {taken} of {batches} batches"
    assert taken < batches and unreadable > 0  # records off the models were made too


@pytest.mark.parametrize("table, value", [
    ("calls", b'{"type":"call","time":1,"data":{"status":598,"usage":[]}}'),  # found by the differential test
    ("calls", b'{"type":"call","time":1,"data":"x"}'),
    ("rollouts", b'{"type":"rollout.queued","time":1,"data":{"group_id":"g","task":"t"}}'),
])
def test_a_sub_record_that_is_not_an_object_is_unreadable_whatever_the_columns_asked(table, value):
    """Row by row `"usage": []` makes the record unreadable; the native way, asked only for `time`, skipped
    `usage` and read it: `COUNT(*)` then depended on the columns a query named."""
    batch = records([value, encode(CALLS[1]) if table == "calls" else encode(known_events()[0])])
    for columns in (None, frozenset({"time", "kafka_offset"})):
        schema = table_schema(table)
        wanted = [n for n in schema if columns is None or n in columns]
        got = decode_aligned(batch, table, columns)
        assert_frame_equal(got, _decode_rows(batch, schema, wanted))
        assert got["readable"].to_list() == [False, True]
