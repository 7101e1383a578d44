"""The local three-broker cluster: topics made on it have three replicas of which two must take a write (those made
with fewer, as on one broker, are reported), and a broker killed (-9) while a producer writes with acks=all loses no
acknowledged record and doubles none; the consumer group's committed offsets survive it, and the broker rejoins every
partition's in-sync replicas."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError
from typer.testing import CliRunner

from agentstream.cli import app as cli
from agentstream.schemas.kafka import (
    KafkaSettings,
    ensure_topics,
    make_admin,
    make_consumer,
    make_producer,
    partitions_of,
    replicas_for,
)
from agentstream.stack.kafka import ClusterLayout, ClusterNode, KafkaCluster, LocalKafka
from tests.support.gateway import raw_records
from tests.support.wait import wait_for_async

# --- without a broker -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("brokers", "set_replicas", "set_isr", "expected"), [
    (1, None, None, (1, 1)), (2, None, None, (2, 1)), (3, None, None, (3, 2)), (5, None, None, (3, 2)),
    (3, 1, None, (1, 1)), (3, 3, 3, (3, 3)),
])
def test_topics_are_replicated_as_the_cluster_allows_unless_set(brokers, set_replicas, set_isr, expected):
    settings = KafkaSettings(replication_factor=set_replicas, min_insync_replicas=set_isr)
    assert replicas_for(settings, brokers) == expected


def test_a_cluster_node_is_a_voter_of_a_fixed_quorum_and_replicates_the_internal_topics(tmp_path):
    layout = ClusterLayout.new(4)
    assert len({port for ports in layout.ports.values() for port in ports}) == 8, "every port its own"
    node = LocalKafka(tmp_path, node=ClusterNode(4, layout.voters, replicas=3, cluster_id=layout.cluster_id))
    config = dict(line.split("=", 1) for line in node._write_config(*layout.ports[4]).read_text().splitlines() if line)
    assert layout.voters.count("@") == 3 and "4@" not in layout.voters, "the first three nodes are the quorum"
    assert config["process.roles"] == "broker" and config["controller.quorum.voters"] == layout.voters
    assert config["node.id"] == "4" and "CONTROLLER" not in config["listeners"]
    assert (config["offsets.topic.replication.factor"], config["transaction.state.log.min.isr"],
            config["min.insync.replicas"]) == ("3", "2", "2")
    voter = LocalKafka(tmp_path, node=ClusterNode(1, layout.voters, replicas=3))
    assert dict(line.split("=", 1) for line in voter._write_config(*layout.ports[1]).read_text().splitlines()
                if line)["process.roles"] == "broker,controller"


def test_a_cluster_keeps_its_ports_and_refuses_a_data_dir_that_holds_something_else(tmp_path, monkeypatch):
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)  # else the CLI leaves the local brokers alone
    cluster = KafkaCluster(tmp_path / "three", brokers=3)
    assert KafkaCluster(tmp_path / "three", brokers=3).bootstrap == cluster.bootstrap, "the layout is kept"
    runner = CliRunner()
    refused = runner.invoke(cli, ["kafka", "start", "--brokers", "1", "--data-dir", str(tmp_path / "three")])
    # the error is wrapped to the terminal's width, where the temp folder's name decides the break
    assert refused.exit_code == 1 and "holds a cluster of 3 brokers, not 1" in " ".join(refused.output.split())
    (tmp_path / "single" / "kraft").mkdir(parents=True)
    refused = runner.invoke(cli, ["kafka", "start", "--brokers", "3", "--data-dir", str(tmp_path / "single")])
    assert refused.exit_code == 1 and "holds a single broker's data" in " ".join(refused.output.split())
    refused = runner.invoke(cli, ["kafka", "start", "--port", "9", "--data-dir", str(tmp_path / "three")])
    assert refused.exit_code == 2 and "--port" in refused.output


# --- a real cluster ---------------------------------------------------------------------------------------


@pytest.fixture
def cluster(tmp_path) -> KafkaCluster:
    cluster = KafkaCluster(tmp_path / "cluster", brokers=3)
    try:
        cluster.start(timeout=240)
        yield cluster
    finally:
        cluster.stop(grace=0)


@pytest.mark.slow  # three JVMs start (~30-60 s under load), a broker is killed and rejoins
async def test_a_broker_killed_under_acks_all_loses_no_acknowledged_record_and_doubles_none(cluster, capsys):
    kafka = KafkaSettings(bootstrap_servers=cluster.bootstrap, topic_prefix="chaos.", partitions=4)
    assert (await ensure_topics(kafka)).ok
    assert await _replication(kafka, kafka.topics.calls) == {"replicas": {3}, "min.insync.replicas": "2"}
    # topics made with one replica (as on one broker), the cluster grown since: said, not kept silently
    grown = KafkaSettings(bootstrap_servers=cluster.bootstrap, topic_prefix="grown.", partitions=4)
    assert (await ensure_topics(grown.model_copy(update={"replication_factor": 1}))).ok
    report = await ensure_topics(grown)
    assert f"{grown.topics.calls}: replication factor 1, expected 3; " in "\n".join(report.mismatches), \
        report.mismatches

    producer = make_producer(kafka)
    await producer.start()
    acked: list[str] = []
    failed: list[str] = []
    try:
        async def write(count: int) -> None:
            """`count` records in flight at once (the idempotent producer keeps each partition's order), each
            noted as acknowledged or refused."""
            first = len(acked) + len(failed)
            values = [f"record-{n}" for n in range(first, first + count)]
            sent = [await producer.send(kafka.topics.calls, value.encode(), key=f"rollout-{n % 16}".encode())
                    for n, value in enumerate(values, first)]
            for value, result in zip(values, await asyncio.gather(*sent, return_exceptions=True), strict=True):
                if isinstance(result, KafkaError):
                    failed.append(value)  # not acknowledged: the writer knows to send it again
                elif isinstance(result, BaseException):
                    raise result
                else:
                    acked.append(value)

        await write(200)
        await _commit_everything(kafka)
        leader = await _leader(kafka, kafka.topics.calls, 0)
        cluster.kill_node(leader)
        written_before = len(acked)
        await write(400)  # the partitions that broker led move to another replica meanwhile
        moved = await _leader(kafka, kafka.topics.calls, 0)
        assert moved != leader
        # two brokers up, three replicas as asked when they were made: no mismatch
        assert (await ensure_topics(kafka)).ok
        assert len(acked) - written_before >= 390, f"the cluster took too few writes with a broker down: {failed[:3]}"

        read = Counter(await _read_all(kafka, kafka.topics.calls))
        lost = [value for value in acked if value not in read]
        doubled = [value for value, times in read.items() if times > 1]
        assert lost == [] and doubled == [], f"lost {lost[:5]}, doubled {doubled[:5]}"
        assert set(read) <= set(acked) | set(failed)
        resumed = await _group_resumes_at(kafka)
        assert resumed == 200, "the group's committed offsets outlived the broker"

        cluster.start_node(leader, timeout=240)
        await wait_for_async(lambda: _all_in_sync(kafka, kafka.topics.calls), timeout=120,
                             what="the restarted broker back in every partition's in-sync replicas")
        with capsys.disabled():
            print(f"\ncluster: broker {leader} killed -9 after {written_before} acknowledged writes; "
                  f"{len(acked)} acknowledged, {len(failed)} refused, {sum(read.values())} read back, "
                  f"{len(lost)} lost, {len(doubled)} doubled; partition 0's leader {leader} -> {moved}")
    finally:
        await producer.stop()


async def _replication(kafka: KafkaSettings, topic: str) -> dict:
    """Its replicas per partition and min.insync.replicas, once the broker asked knows the topic: under load, a moment
    after it was created, it may not yet (no partitions, no configs)."""
    return await wait_for_async(lambda: _replication_now(kafka, topic), timeout=30, what=f"{topic} described")


async def _replication_now(kafka: KafkaSettings, topic: str) -> dict | None:
    admin = make_admin(kafka)
    await admin.start()
    try:
        (described,) = await admin.describe_topics([topic])
        (response,) = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic, None)])
    finally:
        await admin.close()
    configs = {entry[0]: entry[1] for resource in response.resources for entry in resource[4]}
    if described["error_code"] or "min.insync.replicas" not in configs:
        return None
    return {"replicas": {len(p["replicas"]) for p in described["partitions"]},
            "min.insync.replicas": configs["min.insync.replicas"]}


async def _leader(kafka: KafkaSettings, topic: str, partition: int) -> int:
    async def elected() -> int | None:
        admin = make_admin(kafka)
        await admin.start()
        try:
            (described,) = await admin.describe_topics([topic])
        finally:
            await admin.close()
        leader = next(p["leader"] for p in described["partitions"] if p["partition"] == partition)
        return leader if leader >= 0 else None
    leader: int = await wait_for_async(elected, timeout=60, what=f"a leader of {topic}:{partition}")
    return leader


async def _all_in_sync(kafka: KafkaSettings, topic: str) -> bool:
    admin = make_admin(kafka)
    await admin.start()
    try:
        (described,) = await admin.describe_topics([topic])
    finally:
        await admin.close()
    return all(len(p["isr"]) == 3 for p in described["partitions"])


GROUP = "cluster-test"


async def _commit_everything(kafka: KafkaSettings) -> None:
    """A group reads the topic to its end and commits: the offsets the kill must not lose."""
    consumer = make_consumer(kafka, kafka.topics.calls, group_id=GROUP)
    await consumer.start()
    try:
        seen = 0
        while seen < 200:
            seen += sum(len(records) for records in (await consumer.getmany(timeout_ms=1000)).values())
        await consumer.commit()
    finally:
        await consumer.stop()


async def _group_resumes_at(kafka: KafkaSettings) -> int:
    consumer = make_consumer(kafka, group_id=GROUP)
    await consumer.start()
    try:
        return sum([await consumer.committed(tp) or 0 for tp in await partitions_of(kafka, kafka.topics.calls)])
    finally:
        await consumer.stop()


async def _read_all(kafka: KafkaSettings, topic: str) -> list[str]:
    return [value.decode() for value in await raw_records(kafka, topic)]


def test_cluster_layout_file_is_plain_json(tmp_path: Path):
    """What `kafka status` and a restart read: the cluster id and each node's two ports."""
    layout = ClusterLayout.new(3)
    layout.save(tmp_path / "cluster.json")
    data = json.loads((tmp_path / "cluster.json").read_text())
    assert [node[0] for node in data["nodes"]] == [1, 2, 3]
    assert ClusterLayout.load(tmp_path / "cluster.json") == layout

