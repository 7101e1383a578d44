"""The sandbox as Kubernetes objects, created through a real kube-apiserver (tests/support/kube.py).

The namespace enforces the `restricted` Pod Security Standard, so the API server itself refuses a
pod that is not locked down (a control pod without our settings must be refused, to show the check
bites). NetworkPolicies are validated and stored by the server; enforcing them is a CNI's job, and no
node runs here. Without the binaries only the pure test runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

import agentstream.schemas as s
from agentstream.controller.attempt import Attempt
from agentstream.controller.kubernetes import default_job, merge, render_job
from agentstream.controller.tasks import PlannedRollout
from agentstream.sandbox.contract import Limits, Network, SandboxError
from agentstream.sandbox.kubernetes import (
    CONTAINER,
    NETWORK_LABEL,
    GatewayPeer,
    PodSandbox,
    job_template,
    network_policy,
    pod,
    pod_spec,
)

LIMITS = Limits(cpus=1.5, memory_bytes=6 << 30, attempt_timeout_s=5400, tmp_bytes=1 << 30, disk_bytes=8 << 30)
GATEWAY = GatewayPeer(pod_labels={"app.kubernetes.io/name": "agentstream-gateway"}, port=8000,
                      namespace_labels={"kubernetes.io/metadata.name": "agentstream"},
                      service_ip="10.0.0.42", hostname="gateway.agentstream.svc")
HARNESS = PodSandbox(limits=LIMITS, network=Network.GATEWAY, gateway=GATEWAY, image="swe-task:1",
                     command="codex exec --full-auto", seed_from="/testbed",
                     env={"OPENAI_BASE_URL": "http://gateway.agentstream.svc:8000/v1"})


def assert_locked_down(spec: dict) -> None:
    """The fields the sandbox contract needs, in a PodSpec as sent or as the server stored it."""
    assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 1000
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["activeDeadlineSeconds"] == 5400 and spec["restartPolicy"] == "Never"
    for container in spec["containers"] + spec.get("initContainers", []):
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
        assert security["capabilities"] == {"drop": ["ALL"]} and security["runAsNonRoot"] is True
        assert all("valueFrom" not in variable and "envFrom" not in container for variable in container.get("env", []))
    agent = next(c for c in spec["containers"] if c["name"] == CONTAINER)
    assert agent["resources"]["limits"] == {"cpu": "1500m", "memory": str(6 << 30), "ephemeral-storage": str(9 << 30)}
    assert agent["resources"]["requests"] == agent["resources"]["limits"]
    mounts = {m["mountPath"]: m["name"] for m in agent["volumeMounts"]}
    assert mounts["/workspace"] == "workspace" and mounts["/tmp"] == "tmp"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["workspace"]["emptyDir"]["sizeLimit"] == str(8 << 30)
    assert spec["dnsPolicy"] == "None" and spec["dnsConfig"]["nameservers"] == ["127.0.0.1"]


def test_pod_spec_and_policies_as_built():
    spec = pod_spec(HARNESS)
    assert_locked_down(spec)
    assert spec["hostAliases"] == [{"ip": "10.0.0.42", "hostnames": ["gateway.agentstream.svc"]}]
    (seed,) = spec["initContainers"]
    assert seed["image"] == "swe-task:1" and seed["command"][-1] == "/testbed"
    agent = spec["containers"][0]
    assert agent["command"] == ["/bin/sh", "-c", "exec codex exec --full-auto"]
    assert {"name": "HOME", "value": "/tmp"} in agent["env"]

    closed = network_policy(Network.NONE)["spec"]
    assert closed["podSelector"] == {"matchLabels": {NETWORK_LABEL: "none"}}
    assert closed["policyTypes"] == ["Ingress", "Egress"] and closed["ingress"] == [] and closed["egress"] == []
    (only_gateway,) = network_policy(Network.GATEWAY, GATEWAY)["spec"]["egress"]
    assert only_gateway["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert only_gateway["to"] == [{
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "agentstream-gateway"}},
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "agentstream"}}}]
    with_dns = network_policy(Network.GATEWAY, GATEWAY, allow_dns=True)["spec"]["egress"]
    assert len(with_dns) == 2 and {p["port"] for p in with_dns[1]["ports"]} == {53}
    assert "dnsPolicy" not in pod_spec(PodSandbox(allow_dns=True))

    with pytest.raises(SandboxError, match="GatewayPeer"):
        network_policy(Network.GATEWAY)
    with pytest.raises(SandboxError, match=r"needs PodSandbox\.gateway"):
        pod_spec(PodSandbox(network=Network.GATEWAY))


def test_every_field_is_a_field_of_the_api():
    """Offline, without a server: the client's models drop unknown fields, so a misspelt one would not
    survive the round trip (the real API server's checks follow below)."""
    api = client.ApiClient()

    def round_trip(manifest: dict, kind: str) -> dict:
        return api.sanitize_for_serialization(api._ApiClient__deserialize(manifest, kind))

    manifests = [(pod("harness", HARNESS), "V1Pod"), (pod("tools", PodSandbox(limits=LIMITS)), "V1Pod"),
                 (job_template(HARNESS), "V1Job"), (network_policy(Network.GATEWAY, GATEWAY, allow_dns=True),
                                                    "V1NetworkPolicy"), (network_policy(Network.NONE), "V1NetworkPolicy")]
    for manifest, kind in manifests:
        assert round_trip(manifest, kind) == manifest, kind
    misspelt = pod("harness", HARNESS)
    misspelt["spec"]["containers"][0]["securityContext"]["readOnlyRootFS"] = True
    assert round_trip(misspelt, "V1Pod") != misspelt


# --- through the real API server --------------------------------------------------------------




def test_the_api_server_accepts_the_sandbox_pod_under_the_restricted_standard(restricted_namespace):
    api, name = restricted_namespace
    core = client.CoreV1Api(api)
    created = core.create_namespaced_pod(name, pod("harness-1", HARNESS))
    stored = api.sanitize_for_serialization(core.read_namespaced_pod("harness-1", name))
    assert_locked_down(stored["spec"])
    assert stored["metadata"]["labels"] == {NETWORK_LABEL: "gateway"} and created.metadata.uid
    assert stored["spec"]["hostAliases"] == [{"ip": "10.0.0.42", "hostnames": ["gateway.agentstream.svc"]}]

    # the control: the same pod without the lock-down is refused by the server's Pod Security admission
    loose = {"metadata": {"name": "loose"}, "spec": {"containers": [{"name": "agent", "image": "swe-task:1"}]}}
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod(name, loose)
    assert refused.value.status == 403 and "violates PodSecurity" in refused.value.body
    for field in ("allowPrivilegeEscalation", "capabilities", "runAsNonRoot", "seccompProfile"):
        assert field in refused.value.body


def test_the_network_policies_are_stored_as_built(restricted_namespace):
    api, name = restricted_namespace
    networking = client.NetworkingV1Api(api)
    for network in (Network.NONE, Network.GATEWAY):
        built = network_policy(network, GATEWAY)
        networking.create_namespaced_network_policy(name, built)
        stored = api.sanitize_for_serialization(
            networking.read_namespaced_network_policy(built["metadata"]["name"], name))
        assert stored["spec"]["podSelector"] == built["spec"]["podSelector"]
        assert stored["spec"]["policyTypes"] == ["Ingress", "Egress"]
        assert stored["spec"].get("ingress", []) == [] and stored["spec"].get("egress", []) == built["spec"]["egress"]
    bad = network_policy(Network.GATEWAY, GatewayPeer(pod_labels={"app": "gw"}, port=70000), name="bad-port")
    with pytest.raises(ApiException) as refused:
        networking.create_namespaced_network_policy(name, bad)
    assert refused.value.status == 422


def test_the_controllers_job_takes_the_sandbox_as_its_template(restricted_namespace):
    api, name = restricted_namespace
    template = PodSandbox(limits=LIMITS, network=Network.GATEWAY, gateway=GATEWAY)  # image, command: the controller's
    base = merge(default_job("swe-task:1", "codex exec --full-auto", timeout_s=5400, grace_s=10, keep_jobs=False),
                 job_template(template))
    rollout = PlannedRollout("0190d0c0-0000-5000-8000-000000000001", s.Task(id="t1", input={"repo": "x"}), "g", "train",
                             0, 0)
    attempt = Attempt(rollout, "0190d0c0-0000-7000-8000-000000000001", 1, 3, Path("/nonexistent"))
    env = {"OPENAI_BASE_URL": "http://gateway.agentstream.svc:8000/v1", "OPENAI_API_KEY": "attempt-token"}
    job = render_job(base, attempt, env, "run-1")
    created = client.BatchV1Api(api).create_namespaced_job(name, job)
    stored = api.sanitize_for_serialization(created)
    spec = stored["spec"]["template"]["spec"]
    assert stored["spec"]["activeDeadlineSeconds"] == 5400
    assert stored["spec"]["template"]["metadata"]["labels"][NETWORK_LABEL] == "gateway"
    (agent,) = spec["containers"]
    assert agent["image"] == "swe-task:1" and agent["command"][-1] == "exec codex exec --full-auto"
    assert {e["name"] for e in agent["env"]} == {"HOME", "AGENTSTREAM_SANDBOX", "OPENAI_BASE_URL", "OPENAI_API_KEY"}
    assert {m["mountPath"] for m in agent["volumeMounts"]} == {"/workspace", "/tmp", "/var/run/agentstream"}
    assert_locked_down({**spec, "volumes": spec["volumes"]})
    # Pod Security admission enforces on pods, not Jobs: the Job's pod must pass it too
    client.CoreV1Api(api).create_namespaced_pod(name, {"metadata": {"name": "from-job"}, "spec": spec})


def test_the_cli_writes_manifests_the_controller_loads(tmp_path: Path):
    from typer.testing import CliRunner

    from agentstream.cli import app
    from agentstream.controller.kubernetes import load_template

    result = CliRunner().invoke(app, ["sandbox", "k8s-manifests", str(tmp_path), "--gateway-label", "app=gw",
                                      "--gateway-port", "8080", "--gateway-service-ip", "10.0.0.9",
                                      "--gateway-host", "gw.agentstream.svc", "--attempt-timeout", "600"])
    assert result.exit_code == 0, result.output
    template = load_template(tmp_path / "job-template.yaml")
    assert template["spec"]["activeDeadlineSeconds"] == 600
    spec = template["spec"]["template"]["spec"]
    assert spec["hostAliases"] == [{"ip": "10.0.0.9", "hostnames": ["gw.agentstream.svc"]}]
    policy = yaml.safe_load((tmp_path / "networkpolicy.yaml").read_text())
    assert policy["spec"]["egress"] == [{"to": [{"podSelector": {"matchLabels": {"app": "gw"}}}],
                                         "ports": [{"protocol": "TCP", "port": 8080}]}]
    closed = CliRunner().invoke(app, ["sandbox", "k8s-manifests", str(tmp_path / "closed")])
    assert closed.exit_code == 0 and yaml.safe_load((tmp_path / "closed" / "networkpolicy.yaml").read_text())[
        "spec"]["egress"] == []
