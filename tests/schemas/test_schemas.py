import json

import orjson
import pytest

import agentstream.schemas as s
from agentstream.schemas.jsonschema import event_schemas
from samples.events import sample_events


def test_every_event_type_has_a_sample():
    assert {type(event) for event in sample_events()} == set(s.EVENT_TYPES)


@pytest.mark.parametrize("event", sample_events(), ids=lambda e: e.type)
def test_round_trip(event):
    raw = s.encode(event)
    decoded = s.decode(raw)
    assert type(decoded) is type(event)
    assert decoded == event
    assert s.decode(raw, expect=type(event)) == event


def test_encoding_is_the_bytes_orjson_wrote():
    """Repeats are compared as bytes, and logs hold events encoded before: pydantic's serializer
    must write what `orjson.dumps(model_dump())` did, floats, unicode and free-form JSON included."""
    from agentstream.streams.assembly import Timing
    from samples.assembly import assemble
    from samples.rollouts import history

    events = [*sample_events(), *history(20, "r")]
    events += assemble(events[-100:], Timing())
    odd = s.RewardEvent(rollout_id="r-ü", attempt_id="a", source="t", data=s.Reward(
        value=1e-7, details={"x": [1.5, 100.0, 1e16, -0.0, "é\u2028\n", None, True, {"k": 2**62}]}))
    odd_trajectory = s.TrajectoryEvent(rollout_id="r", attempt_id="a", source="t", data=s.Trajectory(
        status="failed", end_reason="é\u2028\n\"x\"", reward=float("nan"), turns=[s.Turn(
            call_id="c", sequence=0, prompt_token_ids=[1], completion_token_ids=[2], logprobs=[-0.0],
            latency_ms=1e16, reward=float("-inf"))], sequences=[], merged=False, finished_at=1, lineage=[]))
    for event in [*events, odd, odd_trajectory]:
        assert s.encode(event) == orjson.dumps(event.model_dump(mode="python")), event.type
        assert s.encode(event) == event.__pydantic_serializer__.to_json(event), event.type  # (trajectories: orjson)


def test_ids_are_sortable_by_creation():
    ids = [s.new_id() for _ in range(1000)]
    assert ids == sorted(ids)
    assert len(set(ids)) == 1000


def test_derived_ids_are_stable():
    assert s.derived_id("trajectory", "a-1") == s.derived_id("trajectory", "a-1")
    assert s.derived_id("trajectory", "a-1") != s.derived_id("trajectory", "a-2")


@pytest.mark.parametrize("parts", [("trajectory", "r-1", "a-1"), ("reward", "x", "streams.rewards:exact_match"),
                                   ("streams.deadletter", "t", "0", "12"), ("é\u2028", ""), ("",)])
def test_derived_ids_are_uuid5_of_the_parts(parts):
    """They are in the log (trajectory and reward ids): computed faster, they must stay these strings."""
    import uuid

    from agentstream.schemas.ids import _NAMESPACE

    assert s.derived_id(*parts) == str(uuid.uuid5(_NAMESPACE, "\x1f".join(parts)))


def _call_dict() -> dict:
    return orjson.loads(s.encode(next(e for e in sample_events() if e.type == "call")))


def _mutate(change) -> bytes:
    obj = _call_dict()
    change(obj)
    return orjson.dumps(obj)


BAD = {
    "not json": (b"{not json", None, "not JSON"),
    "not an object": (b"[1, 2]", None, "JSON object"),
    "missing field": (_mutate(lambda o: o["data"].pop("model")), "data.model", "Field required"),
    "wrong type": (_mutate(lambda o: o["data"].__setitem__("latency_ms", "fast")), "data.latency_ms", "fast"),
    "wrong list item": (_mutate(lambda o: o["data"]["prompt_token_ids"].__setitem__(1, "x")),
                        "data.prompt_token_ids.1", "integer"),
    "unknown field": (_mutate(lambda o: o["data"].__setitem__("surprise", 1)), "data.surprise", "Extra"),
    "unknown type": (_mutate(lambda o: o.__setitem__("type", "nonsense")), "type", "unknown event type 'nonsense'"),
    "bad literal": (_mutate(lambda o: o["data"].__setitem__("api", "chat")), "data.api", "chat"),
    "missing version": (_mutate(lambda o: o.pop("schema_version")), "schema_version", "integer"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_names_the_field(name):
    raw, field, text = BAD[name]
    with pytest.raises(s.DecodeError) as err:
        s.decode(raw)
    assert err.value.field == field
    assert text in str(err.value)
    if field:
        assert str(err.value).startswith(field)


def test_newer_schema_version_is_refused_explicitly():
    raw = _mutate(lambda o: o.__setitem__("schema_version", s.SCHEMA_VERSION + 1))
    with pytest.raises(s.UnsupportedSchemaVersion, match="newer than this agentstream understands"):
        s.decode(raw)


def test_decode_with_expected_type_rejects_others():
    with pytest.raises(s.DecodeError):
        s.decode(s.encode(sample_events()[0]), expect=s.CallEvent)


def test_json_schemas_validate_the_samples_shape():
    schemas = event_schemas()
    assert set(schemas) == {cls.model_fields["type"].default for cls in s.EVENT_TYPES}
    for event in sample_events():
        schema = schemas[event.type]
        payload = json.loads(s.encode(event))
        assert set(schema["required"]) <= set(payload)
        assert schema["x-topic"] == event.topic


def test_rollout_tokens_bind_rollout_and_attempt():
    from agentstream.schemas.tokens import InvalidToken, mint_rollout_token, verify_rollout_token

    token = mint_rollout_token("secret", "r-1", "a-1")
    claims = verify_rollout_token("secret", token)
    assert (claims.rollout_id, claims.attempt_id) == ("r-1", "a-1")
    for bad, reason in [
        (token[:-2] + ("AA" if not token.endswith("AA") else "BB"), "signature"),
        (token.replace("ast1.", "xyz1."), "not a rollout token"),
        ("ast1.only-two", "malformed"),
        (mint_rollout_token("other-secret", "r-1", "a-1"), "signature"),
        (mint_rollout_token("secret", "r-1", "a-1", ttl_s=-10), "expired"),
    ]:
        try:
            verify_rollout_token("secret", bad)
        except InvalidToken as exc:
            assert reason in str(exc)
        else:
            raise AssertionError(f"accepted a bad token ({reason})")


def test_the_relaxed_collector_is_undone_after_a_job_and_leaves_a_frozen_process_alone():
    # in a process of its own: the collector's state is the process's, and tests in this one (an
    # in-process gateway) freeze objects of their own
    import subprocess
    import sys

    check = """
import gc
from agentstream.schemas import collector
before = gc.get_threshold()
assert gc.get_freeze_count() == 0
with collector.relaxed():
    assert gc.get_threshold() == collector.THRESHOLD and gc.get_freeze_count() > 0
assert gc.get_threshold() == before and gc.get_freeze_count() == 0
gc.freeze()  # a service's main froze its own objects: a job within it changes nothing
frozen = gc.get_freeze_count()
with collector.relaxed():
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen
assert gc.get_freeze_count() == frozen
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert done.stdout.strip() == "ok", done.stderr
