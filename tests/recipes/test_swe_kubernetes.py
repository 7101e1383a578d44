"""The coding recipe's attempt as a Kubernetes Job, on a real kube-apiserver (tests/support/kube.py).

The controller's launcher, from the settings a GPU cluster would give it, launches the
mini-swe-agent harness: what the API server stored must be the sandbox's pod (one template: the
hardened `sandbox.kubernetes.pod_spec`, admitted by the `restricted` Pod Security Standard), the
NetworkPolicy that lets it reach the gateway only, and an environment holding the gateway URL and
the attempt's own key — no operator credential, nothing of the hidden tests. No kubelet runs here,
so no pod starts: what is checked is what the cluster would run. Skipped without the binaries.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from kubernetes import client

from agentstream.controller.attempt import Attempt, Gateway
from agentstream.controller.kubernetes import TASK_ANNOTATION, KubernetesLauncher
from agentstream.controller.settings import ControllerSettings
from agentstream.controller.tasks import PlannedRollout, load_tasks, plan_rollouts
from agentstream.recipes.swe.instance import Instance
from agentstream.recipes.swe.task_files import write_task_files
from agentstream.sandbox.kubernetes import NETWORK_LABEL
from agentstream.schemas.tokens import verify_rollout_token

SECRET = "operator-token-secret-" + "x" * 16
OPERATOR_ENV = {"AGENTSTREAM_TOKEN_SECRET": SECRET, "AWS_SECRET_ACCESS_KEY": "aws-secret-of-the-operator",
                "HF_TOKEN": "hf_operator_token", "KAFKA_SASL_PASSWORD": "kafka-password-of-the-operator"}
INSTANCE = Instance(
    instance_id="pytoolz__toolz-bug-7", repo="pytoolz/toolz", base_commit="a" * 40,
    problem_statement="AssertionError: assert take(2, [1, 2, 3]) == [1, 2]",
    patch="--- a/toolz/itertoolz.py\n+++ b/toolz/itertoolz.py\n@@ GOLD-PATCH-BODY @@\n",
    test_patch="--- a/toolz/tests/test_itertoolz.py\n+++ b/toolz/tests/test_itertoolz.py\n@@ HIDDEN-TEST-BODY @@\n",
    FAIL_TO_PASS=["toolz/tests/test_itertoolz.py::test_take_hidden"], PASS_TO_PASS=["toolz/tests/test_x.py::test_y"])
HARNESS_TEMPLATE = """
spec:
  template:
    spec:
      containers:
      - name: agent
        env:   # the harness's settings; the image holds the repository, its Python and the public index
        - {name: AGENTSTREAM_SWE_REPOS, value: /opt/swe/repos}
        - {name: AGENTSTREAM_SWE_ENVS, value: /opt/swe/envs}
        - {name: AGENTSTREAM_SWE_INDEX, value: /opt/swe/index.jsonl}
        - {name: AGENTSTREAM_SWE_STEP_LIMIT, value: "40"}
"""




async def test_the_harness_attempt_is_a_sandboxed_job(kube_cluster, restricted_namespace, tmp_path: Path,
                                                     monkeypatch):
    api, namespace = restricted_namespace
    for name, value in OPERATOR_ENV.items():  # the controller's own environment: none of it may reach a pod
        monkeypatch.setenv(name, value)
    # the recipe's own task files, as the controller reads them: the image is named from what they carry
    train, _, instances = write_task_files([INSTANCE], tmp_path / "tasks")  # instances: the grader's, hidden tests
    (task,) = load_tasks(train)
    template = tmp_path / "harness-job.yaml"
    template.write_text(HARNESS_TEMPLATE)
    settings = ControllerSettings(
        tasks=train, agent="python -m agentstream.recipes.swe.harness", token_secret=SECRET,
        gateway_url="http://gateway.agentstream.svc:8000", model="qwen-9b", backend="kubernetes",
        k8s_kubeconfig=kube_cluster.kubeconfig, k8s_namespace=namespace, k8s_image="registry.test/swe-{repo_slug}:1",
        k8s_job_template=template, k8s_gateway_namespace="agentstream", k8s_gateway_service_ip="10.0.0.42",
        k8s_cpus=2, k8s_memory_gib=8, timeout_s=1800, kill_grace_s=10)
    (rollout,) = plan_rollouts("run-swe-k8s", [task], samples=1, validation_samples=1, epochs=1, shuffle=False, seed=0)
    attempt = Attempt(rollout, "0190d0c0-0000-7000-8000-0000000000a1", 1, 3, tmp_path)
    launcher = KubernetesLauncher.from_settings(settings, "run-swe-k8s")
    await launcher.start()
    try:
        run = await launcher.launch(attempt, Gateway(settings.gateway_url, SECRET, settings.model))
        stored = api.sanitize_for_serialization(
            await asyncio.to_thread(client.BatchV1Api(api).read_namespaced_job, run.name, namespace))
        await run.stop()
        await run.close()
    finally:
        await launcher.close()

    # one template: the sandbox's pod, as the API server stored it
    job, pod = stored["spec"], stored["spec"]["template"]
    spec = pod["spec"]
    assert job["backoffLimit"] == 0 and job["activeDeadlineSeconds"] == spec["activeDeadlineSeconds"] == 1840
    assert pod["metadata"]["labels"][NETWORK_LABEL] == "gateway"
    assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 1000
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["dnsPolicy"] == "None" and spec["hostAliases"] == [
        {"ip": "10.0.0.42", "hostnames": ["gateway.agentstream.svc"]}]
    (agent,) = spec["containers"]
    assert agent["image"] == "registry.test/swe-pytoolz__toolz:1", "the task's repository picks the image"
    assert agent["command"] == ["/bin/sh", "-c", "exec python -m agentstream.recipes.swe.harness"], "exec: no shell holds the token"
    security = agent["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]} and security["privileged"] is False
    assert agent["resources"]["limits"] == agent["resources"]["requests"]
    assert agent["resources"]["limits"]["cpu"] == "2" and agent["resources"]["limits"]["memory"] == str(8 << 30)
    assert {m["mountPath"] for m in agent["volumeMounts"]} == {"/workspace", "/tmp", "/var/run/agentstream"}

    # the environment: the gateway, the attempt's key, the harness's settings; nothing else
    assert "envFrom" not in agent and all("valueFrom" not in e for e in agent["env"])
    env = {e["name"]: e["value"] for e in agent["env"]}
    assert env["OPENAI_BASE_URL"] == (f"{settings.gateway_url}/rollouts/{rollout.rollout_id}"
                                      f"/attempts/{attempt.attempt_id}/v1")
    claims = verify_rollout_token(SECRET, env["OPENAI_API_KEY"])
    assert (claims.rollout_id, claims.attempt_id) == (rollout.rollout_id, attempt.attempt_id)
    assert env["AGENTSTREAM_SANDBOX"] == "pod" and env["AGENTSTREAM_MODEL"] == "qwen-9b"
    assert env["AGENTSTREAM_TASK"] == "/var/run/agentstream/task.json" and env["AGENTSTREAM_SWE_STEP_LIMIT"] == "40"
    assert set(env) == {"HOME", "AGENTSTREAM_SANDBOX", "AGENTSTREAM_SWE_REPOS", "AGENTSTREAM_SWE_ENVS",
                        "AGENTSTREAM_SWE_INDEX", "AGENTSTREAM_SWE_STEP_LIMIT", "OPENAI_BASE_URL", "OPENAI_API_KEY",
                        "AGENTSTREAM_ROLLOUT_ID", "AGENTSTREAM_ATTEMPT_ID", "AGENTSTREAM_TASK",
                        "AGENTSTREAM_REWARD_URL", "AGENTSTREAM_MODEL"}
    assert json.loads(pod["metadata"]["annotations"][TASK_ANNOTATION]) == INSTANCE.agent_task()
    everything = json.dumps(stored)
    for secret in OPERATOR_ENV.values():
        assert secret not in everything, "an operator credential reached the Job"
    for hidden in ("GOLD-PATCH-BODY", "HIDDEN-TEST-BODY", "test_take_hidden", str(instances), instances.name):
        assert hidden not in everything, f"the hidden tests' {hidden!r} reached the Job"

    # the pod the Job would make passes the restricted Pod Security Standard (enforced on pods, not Jobs)
    core = client.CoreV1Api(api)
    await asyncio.to_thread(core.create_namespaced_pod, namespace, {"metadata": {"name": "harness-pod"}, "spec": spec})

    # the NetworkPolicy the launcher put in place: nothing in, out only TCP 8000 to the gateway's pods
    networking = client.NetworkingV1Api(api)
    (policy,) = api.sanitize_for_serialization(
        await asyncio.to_thread(networking.list_namespaced_network_policy, namespace)).get("items")
    assert policy["spec"]["podSelector"] == {"matchLabels": {NETWORK_LABEL: "gateway"}}
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"] and policy["spec"].get("ingress", []) == []
    assert policy["spec"]["egress"] == [{"ports": [{"port": 8000, "protocol": "TCP"}], "to": [{
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "agentstream"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "agentstream-gateway"}}}]}]

    # a second controller with other settings brings the existing policy up to date (not a 409)
    moved = KubernetesLauncher.from_settings(settings.model_copy(update={"k8s_gateway_port": 9000}), "run-swe-k8s-2")
    await moved.start()
    await moved.close()
    (policy,) = api.sanitize_for_serialization(
        await asyncio.to_thread(networking.list_namespaced_network_policy, namespace)).get("items")
    assert policy["spec"]["egress"][0]["ports"] == [{"port": 9000, "protocol": "TCP"}]


def test_settings_that_would_leave_the_pod_without_its_gateway_are_refused(tmp_path: Path):
    from agentstream.controller.attempt import LaunchError
    from agentstream.controller.kubernetes import image_of, sandbox_of

    base = dict(tasks=tmp_path / "t.jsonl", agent="a", token_secret="s", backend="kubernetes")
    with pytest.raises(ValueError, match="--k8s-gateway-service-ip"):
        sandbox_of(ControllerSettings(**base, gateway_url="http://gateway.agentstream.svc:8000"))
    by_ip = sandbox_of(ControllerSettings(**base, gateway_url="http://10.1.2.3:8080"))
    assert by_ip.gateway.port == 8080 and by_ip.gateway.hostname is None
    with pytest.raises(ValueError, match="KEY=VALUE"):
        sandbox_of(ControllerSettings(**base, gateway_url="http://10.1.2.3", k8s_gateway_selector="gateway"))
    with pytest.raises(LaunchError, match="no metadata field 'repo'"):
        image_of("reg/swe-{repo}:1", PlannedRollout("r", INSTANCE.rollout_task().model_copy(update={"metadata": {}}),
                                                    "g", "train", 0, 0).task)
