"""Partial rollouts without a server: a followed call marks where its server switched weights, its event carries
the segments, and a drain waits only for the calls that are not followed (`gateway/pool.py`,
`gateway/call_record.py`). The real swap is in test_partial_rollouts.py."""

from __future__ import annotations

import aiohttp

from agentstream.gateway.adapter import Tokens
from agentstream.gateway.apis import ADAPTERS
from agentstream.gateway.auth import Attribution
from agentstream.gateway.call_record import CallRecord
from agentstream.gateway.metrics import Metrics
from agentstream.gateway.pool import Pool, Upstream
from agentstream.schemas.events import WeightSegment

SERVER = "http://server-0"


def call_at(version: int, generated: list[int]) -> CallRecord:
    call = CallRecord(ADAPTERS["chat.completions"], Attribution(rollout_id="r", attempt_id="a"))
    call.model, call.weight_version, call.generated = "tiny", version, lambda: len(generated)
    return call


def tokens(n: int) -> Tokens:
    return Tokens(prompt_token_ids=[1], completion_token_ids=list(range(n)), logprobs=[-0.1] * n)


def test_a_call_records_a_segment_per_version_at_the_tokens_it_had():
    generated: list[int] = [0] * 3
    call = call_at(4, generated)
    call.switched(5)
    call.switched(5)  # the pool event after the applier's own mark: no second segment
    generated += [0] * 4
    call.switched(4)  # an older version (a late event) never starts a segment
    call.switched(7)
    data = call.event("gw", 200, tokens=tokens(9)).data
    assert data.weight_version == 4
    assert data.weight_segments == [WeightSegment(version=4, start=0), WeightSegment(version=5, start=3),
                                    WeightSegment(version=7, start=7)]


def test_switches_before_the_first_token_or_after_the_last_are_no_segments():
    generated: list[int] = []
    call = call_at(4, generated)
    call.switched(5)  # nothing generated yet: every token is the new version's
    generated += [0] * 3
    call.switched(6)  # after its last token (the stream ended right then)
    data = call.event("gw", 200, tokens=tokens(3)).data
    assert (data.weight_version, data.weight_segments) == (5, [])


def test_a_call_that_is_not_followed_learns_nothing():
    call = call_at(4, [])
    call.generated = None
    call.switched(5)
    assert call.event("gw", 200, tokens=tokens(3)).data.weight_segments == []


async def test_a_drain_with_followed_calls_waits_only_for_the_others():
    async with aiohttp.ClientSession() as http:
        upstream = Upstream(SERVER, {"tiny"})
        pool = Pool([upstream], http, Metrics())
        generated: list[int] = [0, 0]
        followed, plain = pool.lease("tiny", upstream), pool.lease("tiny", upstream)
        call = call_at(0, generated)
        followed.follow(call)
        assert not await pool.drain("tiny", [], timeout=0.05, followed_go_on=True), "a plain call is waited for"
        plain.close()
        assert await pool.drain("tiny", [], timeout=0.05, followed_go_on=True)
        assert not await pool.drain("tiny", [], timeout=0.05), "without partial rollouts every call is waited for"
        pool.switched(SERVER, 1)
        followed.close()
        pool.switched(SERVER, 2)  # closed: no longer followed
        assert call.switches == [WeightSegment(version=1, start=2)]
        assert pool.followed[SERVER] == set() and pool.in_flight("tiny") == 0
