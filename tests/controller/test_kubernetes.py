"""The Kubernetes launcher.

Three layers, from always-run to most real:
- rendered manifests (pure): the default Job, a user template merged over it, the attempt's fields;
- the launcher against a *recorded* API: every answer was written by a real kube-apiserver 1.37
  (tests/data/kube_launcher_recording.json, made by the real-server test with
  AGENTSTREAM_RECORD_KUBE=1), replayed so CI needs no Kubernetes binaries;
- the launcher and the whole controller against a *real* kube-apiserver + etcd (skipped unless the
  binaries are installed, see tests/support/kube.py). No kubelet runs, so `ClusterSim` writes the
  pods and Job status a cluster would, through the API, which validates every write.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from pathlib import Path

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

import agentstream.schemas as s
from agentstream.controller.attempt import Attempt, Gateway, LaunchError
from agentstream.controller.controller import Controller
from agentstream.controller.history import AttemptRecord
from agentstream.controller.kubernetes import (
    ATTEMPT_LABEL,
    RUN_LABEL,
    TASK_ANNOTATION,
    KubernetesLauncher,
    RateLimit,
    api_client,
    default_job,
    job_name,
    load_template,
    merge,
    render_job,
)
from agentstream.controller.tasks import PlannedRollout
from agentstream.sandbox.kubernetes import NETWORK_LABEL
from agentstream.schemas.tokens import is_rollout_token
from tests.support.controller import SECRET, attempts_of, controller_settings, read_rollouts, types, write_tasks
from tests.support.kube import ClusterSim, write_kubeconfig
from tests.support.kube_recorded import Recorder, Replayer

RECORDING = Path(__file__).parents[1] / "data" / "kube_launcher_recording.json"
GATEWAY = Gateway("http://gateway.agentstream.svc:8000", SECRET, "tiny")
RUN = "run-recorded-launcher"
NAMESPACE = "agentstream-launcher"


def make_attempt(n: int, task_input=None, tmp: Path = Path("/nonexistent")) -> Attempt:
    rollout = PlannedRollout(f"0190d0c0-0000-5000-8000-{n:012d}", s.Task(id=f"task-{n}", input=task_input or {"n": n}),
                             "group-1", "train", 0, 0)
    return Attempt(rollout, f"0190d0c0-0000-7000-8000-{n:012d}", 1, 3, tmp)


# --- rendered manifests ---------------------------------------------------------------------


def test_rendered_job_carries_the_attempt_and_merges_the_template(tmp_path: Path):
    template = tmp_path / "job.yaml"
    template.write_text("""
metadata: {namespace: ignored-here, annotations: {team: rl}}
spec:
  backoffLimit: 4            # the controller retries, but a template may still say otherwise
  template:
    spec:
      nodeSelector: {pool: cpu}
      containers:
      - name: agent
        resources: {limits: {cpu: "1"}}
        env: [{name: EXTRA, value: "1"}, {name: AGENTSTREAM_TASK, value: "overridden?"}]
      - name: sidecar
        image: busybox
""")
    base = merge(default_job("agent:1", "python agent.py", timeout_s=60, grace_s=5, keep_jobs=False),
                 load_template(template))
    attempt = make_attempt(1, {"question": "2+2", "nested": [1, {"x": None}]})
    env = {"OPENAI_BASE_URL": "http://gw/v1", "AGENTSTREAM_TASK": "/var/run/agentstream/task.json"}
    job = render_job(base, attempt, env, RUN)

    assert job["metadata"]["name"] == job_name(attempt.attempt_id) and len(job["metadata"]["name"]) <= 63
    assert job["metadata"]["annotations"] == {"team": "rl"}
    labels = job["metadata"]["labels"]
    assert labels[RUN_LABEL] == RUN and labels[ATTEMPT_LABEL] == attempt.attempt_id
    spec = job["spec"]
    assert spec["backoffLimit"] == 4 and spec["activeDeadlineSeconds"] == 95 and spec["ttlSecondsAfterFinished"]
    pod = spec["template"]
    assert json.loads(pod["metadata"]["annotations"][TASK_ANNOTATION]) == attempt.rollout.task.input
    assert pod["metadata"]["labels"] == {**labels, NETWORK_LABEL: "gateway"}, "the NetworkPolicy's selector stays"
    assert pod["spec"]["nodeSelector"] == {"pool": "cpu"} and pod["spec"]["restartPolicy"] == "Never"
    # the default pod is the sandbox's: locked down whatever the template adds
    assert pod["spec"]["automountServiceAccountToken"] is False and pod["spec"]["activeDeadlineSeconds"] == 95
    agent, sidecar = pod["spec"]["containers"]
    assert (agent["image"], agent["command"]) == ("agent:1", ["/bin/sh", "-c", "exec python agent.py"])
    assert agent["securityContext"]["readOnlyRootFilesystem"] and agent["securityContext"]["capabilities"] == {
        "drop": ["ALL"]}
    assert agent["resources"]["limits"]["cpu"] == "1" and agent["resources"]["limits"]["memory"] == str(4 << 30)
    assert sidecar == {"name": "sidecar", "image": "busybox"}
    variables = {e["name"]: e["value"] for e in agent["env"]}
    assert variables == {"HOME": "/tmp", "AGENTSTREAM_SANDBOX": "pod", "EXTRA": "1", **env}, \
        "the attempt's variables win over the template's"
    assert agent["volumeMounts"][-1] == {"name": "agentstream-task", "mountPath": "/var/run/agentstream",
                                         "readOnly": True}
    assert [m["mountPath"] for m in agent["volumeMounts"]] == ["/workspace", "/tmp", "/var/run/agentstream"]
    volume = pod["spec"]["volumes"][-1]
    assert volume["downwardAPI"]["items"][0]["fieldRef"]["fieldPath"] == f"metadata.annotations['{TASK_ANNOTATION}']"

    other = render_job(base, make_attempt(2), {"AGENTSTREAM_TASK": "elsewhere"}, RUN)
    other_env = {e["name"]: e["value"] for e in other["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert other_env["AGENTSTREAM_TASK"] == "elsewhere"
    assert {e["name"]: e["value"] for e in agent["env"]} == variables, "attempts must not share manifest parts"

    (tmp_path / "bad.yaml").write_text("kind: Deployment\n")
    with pytest.raises(ValueError, match="must be a YAML mapping of kind Job"):
        load_template(tmp_path / "bad.yaml")


async def test_rate_limit_spaces_creations():
    limit = RateLimit(20.0)
    began = time.monotonic()
    for _ in range(5):
        await limit.acquire()
    assert time.monotonic() - began >= 4 / 20.0 - 0.01


# --- the launcher, against the real API or its recording --------------------------------------


async def exercise_launcher(kubeconfig: Path, namespace: str = NAMESPACE) -> None:
    """Everything the launcher does, in an order that replays deterministically."""
    sim_api = api_client(kubeconfig, None)
    sim = ClusterSim(sim_api, namespace)
    await asyncio.to_thread(sim.create_namespace)
    base = default_job("agent:test", "python /app/agent.py", timeout_s=30, grace_s=1, keep_jobs=False)

    def launcher(job=base, rate=4.0) -> KubernetesLauncher:
        return KubernetesLauncher(api_client(kubeconfig, None), namespace, job, RUN, timeout_s=30, create_rate=rate,
                                  keep_jobs=False, tail_chars=500, grace_s=1)

    def gone(name: str) -> bool:
        try:
            sim.batch.read_namespaced_job(name, namespace)
        except ApiException as exc:
            return exc.status == 404
        return False

    jobs = launcher()
    await jobs.start()
    try:
        # an agent that succeeds: the Job the API stored is what the agent needs
        ok = await jobs.launch(make_attempt(1, {"question": "2+2"}), GATEWAY)
        stored = (await asyncio.to_thread(sim.batch.read_namespaced_job, ok.name, namespace)).to_dict()
        pod = stored["spec"]["template"]
        container = pod["spec"]["containers"][0]
        variables = {e["name"]: e["value"] for e in container["env"]}
        attempt_id = make_attempt(1).attempt_id
        assert variables["OPENAI_BASE_URL"] == (f"{GATEWAY.url}/rollouts/{make_attempt(1).rollout_id}"
                                                f"/attempts/{attempt_id}/v1")
        assert variables["AGENTSTREAM_TASK"] == "/var/run/agentstream/task.json"
        assert is_rollout_token(variables["OPENAI_API_KEY"]) and variables["AGENTSTREAM_MODEL"] == "tiny"
        assert json.loads(pod["metadata"]["annotations"][TASK_ANNOTATION]) == {"question": "2+2"}
        assert stored["spec"]["backoff_limit"] == 0 and pod["spec"]["restart_policy"] == "Never"
        await asyncio.to_thread(sim.finish, ok.name, 0)
        ended = await asyncio.wait_for(ok.wait(), 30)
        assert (ended.exit_code, ended.error, ended.timed_out) == (0, None, False)
        await ok.close()
        assert await asyncio.to_thread(gone, ok.name), "a recorded Job should be deleted"

        # an agent that fails: the pod's exit code reaches the event
        bad = await jobs.launch(make_attempt(2), GATEWAY)
        await asyncio.to_thread(sim.finish, bad.name, 3)
        ended = await asyncio.wait_for(bad.wait(), 30)
        assert ended.exit_code == 3 and "BackoffLimitExceeded" in ended.error and not ended.timed_out
        await bad.close()

        # the cluster enforced the deadline (e.g. the controller was away): a timeout, not a failure
        late = await jobs.launch(make_attempt(3), GATEWAY)
        await asyncio.to_thread(sim.end_job, late.name, False, "DeadlineExceeded")
        ended = await asyncio.wait_for(late.wait(), 30)
        assert ended.timed_out and ended.exit_code is None
        await late.close()

        # the controller's own timeout: the Job is deleted
        stuck = await jobs.launch(make_attempt(4), GATEWAY)
        await stuck.stop()
        await stuck.close()
        assert await asyncio.to_thread(gone, stuck.name)

        # a Job left by a dead controller is removed by the next one
        left = await jobs.launch(make_attempt(5), GATEWAY)
        successor = launcher()
        await successor.reap(RUN, [AttemptRecord(make_attempt(5).attempt_id, 1, None)])
        await successor.close()
        assert await asyncio.to_thread(gone, left.name)
        jobs.forget(left.name)

        # a template the API refuses: a clear launch error with the server's reason
        refused = launcher(merge(base, {"spec": {"backoffLimit": -1}}))
        with pytest.raises(LaunchError, match=r"refused Job .*422.*backoffLimit"):
            await refused.launch(make_attempt(6), GATEWAY)
        await refused.close()

        # creation is rate-limited: three at once at 4/s take at least half a second
        began = time.monotonic()
        burst = await asyncio.gather(*(jobs.launch(make_attempt(n), GATEWAY) for n in (7, 8, 9)))
        assert time.monotonic() - began >= 0.5 - 0.01
        for run in burst:
            await run.stop()
            await run.close()
    finally:
        await jobs.close()
        sim_api.close()


async def test_launcher_against_a_real_api_server(kube_cluster):
    if os.environ.get("AGENTSTREAM_RECORD_KUBE"):
        with Recorder(kube_cluster.url, kube_cluster.ca_file, token="agentstream-test-token") as recorder:
            await exercise_launcher(write_kubeconfig(kube_cluster.kubeconfig.with_name("recorder"), recorder.url, None))
        recorder.save(RECORDING)
    else:
        await exercise_launcher(kube_cluster.kubeconfig, namespace=f"launcher-{uuid.uuid4().hex[:8]}")


async def test_launcher_against_the_recorded_api(tmp_path: Path):
    with Replayer(RECORDING) as api:
        await exercise_launcher(write_kubeconfig(tmp_path / "kubeconfig", api.url, None))
    assert not api.mismatches, "requests differ from the recording (re-record with a real API server):\n" + \
        "\n".join(api.mismatches)
    assert not api.unserved, f"recorded requests the launcher no longer makes: {api.unserved}"


# --- the whole controller on a real API server ------------------------------------------------


class JobPlayer:
    """Plays the cluster for the controller's Jobs: by task mode, finish, fail once, or never end."""

    def __init__(self, kubeconfig: Path, namespace: str):
        self.sim = ClusterSim(api_client(kubeconfig, None), namespace)
        self.namespace = namespace
        self.seen: dict[str, dict] = {}
        self.failed_once: set[str] = set()
        self.errors: list[str] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._play, daemon=True)

    def _play(self) -> None:
        while not self.stopping.is_set():
            try:
                for event in watch.Watch().stream(self.sim.batch.list_namespaced_job, self.namespace,
                                                  timeout_seconds=1):
                    if event["type"] == "ADDED" and event["object"].metadata.name not in self.seen:
                        self._start(event["object"])
            except ApiException as exc:
                if exc.status in (410, 504):  # its watch cache lags (a loaded server) or moved on: watch again
                    continue
                self.errors.append(f"ApiException {exc.status} {exc.body}")
                return
            except Exception as exc:  # reported by the test
                self.errors.append(f"{type(exc).__name__}: {exc}")
                return

    def _start(self, job) -> None:
        name = job.metadata.name
        self.seen[name] = job.to_dict()
        task = json.loads(job.spec.template.metadata.annotations[TASK_ANNOTATION])
        rollout = job.metadata.labels["agentstream.io/rollout"]
        if task["mode"] == "ok":
            self.sim.finish(name, 0)
        elif task["mode"] == "flaky":
            first = rollout not in self.failed_once
            self.failed_once.add(rollout)
            self.sim.finish(name, 3 if first else 0)
        # "hang": never ends; the controller's timeout deletes it

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.thread.join(5)


async def test_controller_runs_rollouts_as_jobs_on_a_real_api_server(kube_cluster, kafka, tmp_path: Path):
    namespace = f"controller-{uuid.uuid4().hex[:8]}"
    tasks = write_tasks(tmp_path / "tasks.jsonl", [
        {"id": "ok", "input": {"mode": "ok"}}, {"id": "flaky", "input": {"mode": "flaky"}},
        {"id": "hang", "input": {"mode": "hang"}},
    ])
    settings = controller_settings(kafka, tasks, tmp_path, backend="kubernetes", k8s_kubeconfig=kube_cluster.kubeconfig,
                                   k8s_namespace=namespace, k8s_image="agent:test", timeout_s=2.0,
                                   k8s_gateway_service_ip="10.0.0.9", max_attempts=2,
                                   samples=2, heartbeat_s=0.5)
    with JobPlayer(kube_cluster.kubeconfig, namespace) as player:
        await asyncio.to_thread(player.sim.create_namespace)
        summary = await Controller(settings).run()
    assert not player.errors, player.errors
    assert (summary.done, summary.failed) == (4, 2)

    events = await read_rollouts(kafka)
    assert len({e.id for e in events}) == len(events)
    by_task: dict[str, list] = {}
    for tries in attempts_of(events).values():
        by_task.setdefault(tries[0][0].data.task.id, []).append(tries)
    for tries in by_task["ok"]:
        (attempt,) = tries
        assert types(attempt)[:2] == ["queued", "started"] and types(attempt)[-1] == "finished"
        assert attempt[1].data.launcher == "kubernetes" and attempt[1].data.worker == \
            f"job {namespace}/{job_name(attempt[0].attempt_id)}"
        assert attempt[-1].data.exit_code == 0
    for first, second in by_task["flaky"]:
        assert types(first)[-1] == "failed" and first[-1].data.exit_code == 3 and first[-1].data.will_retry
        assert types(second)[-1] == "finished" and second[0].data.attempt_number == 2
    for first, second in by_task["hang"]:
        assert types(first)[-1] == "timed_out" and types(second)[-1] == "timed_out"
        assert not second[-1].data.will_retry

    # every attempt had its Job, with its own environment; none is left once recorded
    attempt_ids = {e.attempt_id for e in events}
    assert {name.removeprefix("agent-") for name in player.seen} == attempt_ids
    for name, job in player.seen.items():
        variables = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert variables["AGENTSTREAM_ATTEMPT_ID"] == name.removeprefix("agent-")
        assert job["spec"]["template"]["spec"]["automount_service_account_token"] is False, "the sandbox's pod"
    batch = client.BatchV1Api(api_client(kube_cluster.kubeconfig, None))
    assert (await asyncio.to_thread(batch.list_namespaced_job, namespace)).items == []
