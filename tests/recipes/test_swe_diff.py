"""The diff is data: the gateway's diff endpoint turns an attempt's final diff into a `rollout.diff`
event of that attempt, for its rollout token only; bad or oversized bodies are refused with the reason."""

from __future__ import annotations

from agentstream.gateway.rollouts import MAX_DIFF_BODY_BYTES, MAX_DIFF_BYTES
from agentstream.schemas.events import RolloutDiffEvent
from agentstream.schemas.tokens import mint_rollout_token
from agentstream.stack.process import free_port
from tests.support.gateway import TOKEN_SECRET, gateway_settings, read_events, running_gateway

DIFF = "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
BODY = {"instance_id": "pkg__1", "base_commit": "abc123", "diff": DIFF, "outcome": "submitted",
        "details": {"steps": 3}}


async def test_a_diff_becomes_an_event_of_the_tokens_attempt_and_nothing_else_gets_in(kafka):
    async with running_gateway(gateway_settings(kafka, [f"tiny=http://127.0.0.1:{free_port()}"])) as gw:
        async with gw.http(mint_rollout_token(TOKEN_SECRET, "r1", "a1")) as agent:
            posted = await agent.post("/rollouts/r1/attempts/a1/diff", json=BODY)
            other_rollout = await agent.post("/rollouts/r2/attempts/a1/diff", json=BODY)
            other_attempt = await agent.post("/rollouts/r1/attempts/a2/diff", json=BODY)
            missing = await agent.post("/rollouts/r1/attempts/a1/diff", json={"diff": DIFF})
            extra = await agent.post("/rollouts/r1/attempts/a1/diff", json={**BODY, "reward": 1.0})
            long = await agent.post("/rollouts/r1/attempts/a1/diff", json={**BODY, "diff": "+" * (MAX_DIFF_BYTES + 10)})
            huge = await agent.post("/rollouts/r1/attempts/a1/diff", json={**BODY, "diff": "+" * MAX_DIFF_BODY_BYTES})
        async with gw.http(api_key=None) as anonymous:
            unauthenticated = await anonymous.post("/rollouts/r1/attempts/a1/diff", json=BODY)

    assert posted.status_code == 200 and long.status_code == 200, (posted.text, long.text)
    assert (other_rollout.status_code, other_attempt.status_code) == (403, 403)
    assert (missing.status_code, extra.status_code) == (400, 400)
    assert "instance_id" in missing.json()["error"]["message"] and "reward" in extra.json()["error"]["message"]
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "diff_too_large"
    assert unauthenticated.status_code == 401

    events = {e.id: e for e in await read_events(kafka, kafka.topics.rollouts, count=2, settle_ms=300)}
    assert set(events) == {posted.json()["id"], long.json()["id"]}
    event, cut = events[posted.json()["id"]], events[long.json()["id"]]
    assert isinstance(event, RolloutDiffEvent) and not event.data.truncated and event.data.size == len(DIFF)
    assert cut.data.truncated and cut.data.size == MAX_DIFF_BYTES + 10 and len(cut.data.diff) == MAX_DIFF_BYTES
    assert (event.rollout_id, event.attempt_id) == ("r1", "a1")
    assert event.data.diff == DIFF and event.data.outcome == "submitted" and event.data.details == {"steps": 3}
