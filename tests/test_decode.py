"""The fast decoding of records into table columns gives what the row-by-row decoding gives.

`agentstream.query.decode` reads a batch with msgspec and polars; `_decode_rows` (one dict per record,
the way queries read before) is the reference: on every batch here both must make the same frame,
and the fast way must actually be taken where the records fit the models. No broker: records are
made in memory, as Kafka would hand them over.
"""

from __future__ import annotations

import orjson
import polars as pl
import pytest
from polars.testing import assert_frame_equal

import schemas as s
from agentstream.query import TABLES, _columns, _decode_rows, decode_aligned, table_fields, table_schema
from schemas.codec import encode
from schemas.scan import Record


def records(values: list[bytes | None]) -> list[Record]:
    return [Record("t", i % 3, 100 + i, 1_700_000_000_000 + i, None, v) for i, v in enumerate(values)]


def careful(batch: list[Record], table: str) -> pl.DataFrame:
    schema = table_schema(table)
    return _decode_rows(batch, schema, list(schema))


def fast_way_taken(batch: list[Record], table: str) -> bool:
    try:
        _columns(batch, ("id", "schema_version", "time", "source", "rollout_id", "attempt_id"), table_fields(table))
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
    value = orjson.dumps(event).replace(b'"PLACEHOLDER"', text if isinstance(text, bytes) else text)
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
    events = [call(prompt_token_ids=ids[i:] + ids[:i], logprobs=floats[i:] + floats[:i]) for i in range(0, 40, 7)]
    batch = records([encode(e) for e in events])
    assert fast_way_taken(batch, "calls")
    fast = decode_aligned(batch, "calls")
    assert_frame_equal(fast, careful(batch, "calls"))
    assert fast["prompt_token_ids"][0].to_list() == ids and fast["logprobs"][0].to_list() == floats


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
