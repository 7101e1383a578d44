"""The Helm chart (deploy/helm/agentstream): linted, rendered, and every object it renders admitted by
a real kube-apiserver that checks RBAC, with the `restricted` Pod Security Standard enforced.

Helm is built from the Go module proxy by scripts/helm.sh (cached; or AGENTSTREAM_HELM / helm on PATH);
without Go and helm the tests skip. The API server is the suite's (tests/support/kube.py: etcd and
kube-apiserver), started here with RBAC. No kubelet runs, so no pod starts: each workload's pod
template is created as a Pod (server-side dry run), which is where Pod Security admission decides.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from agentstream.controller.kubernetes import api_client, default_job, sandbox_of
from agentstream.controller.settings import ControllerSettings
from agentstream.sandbox.contract import Network
from agentstream.sandbox.kubernetes import network_policy
from tests.support.kube import write_kubeconfig

ROOT = Path(__file__).parents[2]
CHART = ROOT / "deploy" / "helm" / "agentstream"
RELEASE = "rl"
NAMESPACE = "agentstream"
SANDBOX = "agentstream-sandbox"
GATEWAY_IP = "10.0.0.80"  # in the test API server's --service-cluster-ip-range
VALUES = {
    "kafka": {"bootstrapServers": "kafka-0.kafka:9092,kafka-1.kafka:9092,kafka-2.kafka:9092", "partitions": 8},
    "inference": {"upstreams": ["http://vllm-0.vllm:8000", "http://vllm-1.vllm:8000"]},
    "gateway": {"replicas": 3, "service": {"clusterIP": GATEWAY_IP}},
    "streams": {"replicas": 4},
    "trainer": {"baseModel": "tiny", "settings": {"lr": 1e-4, "source_weights": {"session": 0.5}}},
    "controller": {"enabled": True, "tasksConfigMap": "tasks"},
    "sandbox": {"namespace": SANDBOX},
}
PSS_RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted",
                  "pod-security.kubernetes.io/enforce-version": "latest"}


@pytest.fixture(scope="session")
def helm() -> str:
    found = os.environ.get("AGENTSTREAM_HELM") or shutil.which("helm")
    if found:
        return found
    if not shutil.which("go"):
        pytest.skip("needs helm (on PATH or AGENTSTREAM_HELM), or Go to build it from the module proxy (scripts/helm.sh)")
    built = subprocess.run([str(ROOT / "scripts" / "helm.sh")], capture_output=True, text=True, timeout=1800)
    assert built.returncode == 0, f"scripts/helm.sh failed:\n{built.stderr[-3000:]}"
    return built.stdout.strip()


def helm_run(helm: str, *args: str, values: dict | None = None, tmp: Path) -> subprocess.CompletedProcess:
    values_file = tmp / f"values-{uuid.uuid4().hex[:6]}.yaml"
    values_file.write_text(yaml.safe_dump(values or {}))
    return subprocess.run([helm, *args, "-f", str(values_file)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HELM_CACHE_HOME": str(tmp / "helm-cache"),
                               "HELM_CONFIG_HOME": str(tmp / "helm-config"), "HELM_DATA_HOME": str(tmp / "helm-data")})


def render(helm: str, tmp: Path, values: dict = VALUES) -> list[dict]:
    result = helm_run(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, values=values, tmp=tmp)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def find(objects: list[dict], kind: str, name: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} rendered"
    return matches[0]


def container_env(workload: dict) -> dict[str, str]:
    """A workload's first container's variables; secrets as placeholders."""
    container = workload["spec"]["template"]["spec"]["containers"][0]
    return {var["name"]: var.get("value", f"<secret {var.get('valueFrom')}>") for var in container.get("env", [])}


def settings_classes() -> dict[str, type]:
    """Each component's settings model, by the name of its values section."""
    from agentstream.dashboard.settings import DashboardSettings
    from agentstream.gateway.settings import GatewaySettings
    from agentstream.releases.settings import ReleasesSettings
    from agentstream.streams.settings import StreamsSettings
    from agentstream.trainer.settings import TrainerSettings

    return {"gateway": GatewaySettings, "streams": StreamsSettings, "trainer": TrainerSettings,
            "dashboard": DashboardSettings, "controller": ControllerSettings, "releases": ReleasesSettings}


@pytest.mark.parametrize("values", [{}, VALUES], ids=["defaults", "full"])
def test_helm_lint(helm, tmp_path, values):
    result = helm_run(helm, "lint", "--strict", str(CHART), values=values, tmp=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("values, message", [
    ({"streams": {"replicas": 9}}, "streams.replicas (9) is more than kafka.partitions (8)"),
    ({"controller": {"enabled": True, "tasksConfigMap": "tasks"}}, "needs gateway.service.clusterIP"),
    ({"controller": {"enabled": True}, "gateway": {"service": {"clusterIP": GATEWAY_IP}}}, "needs controller.tasksConfigMap"),
    ({"checkpoints": {"existingClaim": ""}}, "needs checkpoints.existingClaim"),
], ids=["streams-beyond-partitions", "controller-without-gateway-ip", "controller-without-tasks", "trainer-without-claim"])
def test_values_that_cannot_work_are_refused_by_name(helm, tmp_path, values, message):
    result = helm_run(helm, "template", RELEASE, str(CHART), values=values, tmp=tmp_path)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_the_services_get_their_settings(helm, tmp_path):
    objects = render(helm, tmp_path)
    gateway = find(objects, "Deployment", f"{RELEASE}-gateway")
    assert gateway["spec"]["replicas"] == 3
    env = container_env(gateway)
    assert env["AGENTSTREAM_UPSTREAMS"] == "tiny=http://vllm-0.vllm:8000,tiny=http://vllm-1.vllm:8000"
    assert env["KAFKA_BOOTSTRAP_SERVERS"] == VALUES["kafka"]["bootstrapServers"]
    assert env["AGENTSTREAM_POOL_SYNC"] == "true"
    streams = find(objects, "Deployment", f"{RELEASE}-streams")
    assert streams["spec"]["replicas"] == 4
    # the table on disk, in the pod's state volume (a container's restart reads it and the changelog's tail)
    assert container_env(streams)["AGENTSTREAM_STORE"] == "rocksdb"
    assert container_env(streams)["AGENTSTREAM_STATE_MEMORY_MB"] == "256"
    mounts = {m["mountPath"]: m["name"] for m in streams["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in streams["spec"]["template"]["spec"]["volumes"]}
    state = volumes[mounts[container_env(streams)["AGENTSTREAM_DATA_DIR"]]]
    assert state["emptyDir"] == {"sizeLimit": "20Gi"}
    trainer = find(objects, "Deployment", f"{RELEASE}-trainer")
    assert trainer["spec"]["replicas"] == 1 and trainer["spec"]["strategy"]["type"] == "Recreate"
    assert container_env(trainer)["AGENTSTREAM_BASE_MODEL"] == "/checkpoints/tiny"
    assert container_env(trainer)["AGENTSTREAM_LR"] == "0.0001", "a setting by its field name, as the model reads it"
    assert container_env(trainer)["AGENTSTREAM_SOURCE_WEIGHTS"] == '{"session":0.5}'
    assert find(objects, "Service", f"{RELEASE}-gateway")["spec"]["clusterIP"] == GATEWAY_IP
    # every setting named is one the service has (a typo would be ignored by pydantic-settings otherwise)
    for component, cls in settings_classes().items():
        kind = "Job" if component == "controller" else "Deployment"
        known = {f"AGENTSTREAM_{name.upper()}" for name in cls.model_fields} | {"KAFKA_BOOTSTRAP_SERVERS"}
        unknown = set(container_env(find(objects, kind, f"{RELEASE}-{component}"))) - known
        assert not unknown, f"{component}: {cls.__name__} has no setting for {sorted(unknown)}"


def test_the_settings_values_name_only_the_services_fields():
    """`<service>.settings` in values.yaml: each key a field of the service's settings model (no helm needed)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    classes = settings_classes()
    assert {name for name, part in values.items() if isinstance(part, dict) and "settings" in part} == set(classes)
    for component, cls in classes.items():
        assert set(values[component]["settings"]) <= set(cls.model_fields), component


def test_the_gateway_is_taken_out_of_its_service_when_not_ready_and_restarted_only_when_dead(helm, tmp_path):
    """Readiness /readyz (503 while Kafka or every upstream is down), liveness /healthz (200 while the process
    answers): an upstream's reload must not restart every gateway pod at once."""
    container = find(render(helm, tmp_path), "Deployment", f"{RELEASE}-gateway")["spec"]["template"]["spec"][
        "containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_the_releases_service_judges_canaries_alone(helm, tmp_path):
    objects = render(helm, tmp_path, {**VALUES, "releases": {"settings": {"alpha": 0.01, "min_sessions": 50}}})
    releases = find(objects, "Deployment", f"{RELEASE}-releases")
    assert releases["spec"]["replicas"] == 1 and releases["spec"]["strategy"]["type"] == "Recreate"
    container = releases["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "agentstream.releases"]
    env = container_env(releases)
    assert env["AGENTSTREAM_ALPHA"] == "0.01" and env["AGENTSTREAM_MIN_SESSIONS"] == "50"
    assert env["KAFKA_BOOTSTRAP_SERVERS"] == VALUES["kafka"]["bootstrapServers"]
    assert not [o for o in render(helm, tmp_path, {**VALUES, "releases": {"enabled": False}})
                if o["metadata"]["name"] == f"{RELEASE}-releases"]


def secret_refs(workload: dict) -> dict[str, dict]:
    container = workload["spec"]["template"]["spec"]["containers"][0]
    return {var["name"]: var["valueFrom"]["secretKeyRef"] for var in container["env"] if "valueFrom" in var}


def test_every_key_comes_from_the_auth_secret_which_generates_each(helm, tmp_path):
    objects = render(helm, tmp_path)
    secret = find(objects, "Secret", f"{RELEASE}-auth")
    keys = {"token-secret", "api-keys", "app-keys", "read-keys", "arm-secret"}
    assert set(secret["data"]) == keys
    assert len(set(secret["data"].values())) == len(keys), "each generated apart"
    gateway = secret_refs(find(objects, "Deployment", f"{RELEASE}-gateway"))
    assert {name: ref["key"] for name, ref in gateway.items()} == {
        "AGENTSTREAM_TOKEN_SECRET": "token-secret", "AGENTSTREAM_API_KEYS": "api-keys",
        "AGENTSTREAM_APP_KEYS": "app-keys", "AGENTSTREAM_READ_KEYS": "read-keys", "AGENTSTREAM_ARM_SECRET": "arm-secret"}
    assert {ref["name"] for ref in gateway.values()} == {f"{RELEASE}-auth"}
    dashboard = secret_refs(find(objects, "Deployment", f"{RELEASE}-dashboard"))
    assert {name: ref["key"] for name, ref in dashboard.items()} == {
        "AGENTSTREAM_API_KEYS": "api-keys", "AGENTSTREAM_READ_KEYS": "read-keys"}
    # an existing Secret needs only the token secret and the operator keys: the others are optional
    given = render(helm, tmp_path, {**VALUES, "auth": {"existingSecret": "ours"}})
    assert not [o for o in given if o["kind"] == "Secret"]
    refs = secret_refs(find(given, "Deployment", f"{RELEASE}-gateway"))
    assert {name for name, ref in refs.items() if not ref.get("optional")} == {
        "AGENTSTREAM_TOKEN_SECRET", "AGENTSTREAM_API_KEYS"}
    assert {ref["name"] for ref in refs.values()} == {"ours"}


SASL = {"sasl": {"enabled": True, "username": "agentstream", "passwordSecret": {"name": "kafka-user"}}}


@pytest.mark.parametrize("tls, protocol", [(False, "SASL_PLAINTEXT"), (True, "SASL_SSL")])
def test_kafka_sasl_reaches_every_service_as_its_client_settings(helm, tmp_path, monkeypatch, tls, protocol):
    """kafka.sasl: each workload's variables, read by its settings model, make the clients authenticate."""
    from agentstream.schemas.kafka import aiokafka_auth, librdkafka_auth

    objects = render(helm, tmp_path, {**VALUES, "kafka": {**VALUES["kafka"], **SASL, "tls": tls}})
    workloads = [o for o in objects if o["kind"] in ("Deployment", "Job")]
    assert len(workloads) == 7
    for workload in workloads:
        container = workload["spec"]["template"]["spec"]["containers"][0]
        env = {var["name"]: var for var in container["env"]}
        name = workload["metadata"]["name"]
        assert env["AGENTSTREAM_SASL_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "kafka-user",
                                                                                   "key": "password"}, name
        for variable in [v for v in os.environ if v.startswith("AGENTSTREAM_") or v == "KAFKA_BOOTSTRAP_SERVERS"]:
            monkeypatch.delenv(variable)
        for variable, value in container_env(workload).items():
            monkeypatch.setenv(variable, value)
        monkeypatch.setenv("AGENTSTREAM_SASL_PASSWORD", "from-the-secret")
        from agentstream.schemas.kafka import KafkaSettings
        settings = KafkaSettings()
        options = aiokafka_auth(settings)
        assert (options["security_protocol"], options["sasl_mechanism"], options["sasl_plain_username"],
                options["sasl_plain_password"]) == (protocol, "SCRAM-SHA-512", "agentstream", "from-the-secret"), name
        assert ("ssl_context" in options) == tls
        assert librdkafka_auth(settings)["security.protocol"] == protocol.lower()


def test_kafka_sasl_without_a_user_or_password_is_refused_by_name(helm, tmp_path):
    values = {**VALUES, "kafka": {**VALUES["kafka"], "sasl": {"enabled": True, "username": "agentstream"}}}
    result = helm_run(helm, "template", RELEASE, str(CHART), values=values, tmp=tmp_path)
    assert result.returncode != 0 and "kafka.sasl.passwordSecret.name" in result.stderr, result.stderr


def controller_settings(objects: list[dict], monkeypatch) -> ControllerSettings:
    """The controller's settings as its container would read them."""
    for variable in [v for v in os.environ if v.startswith("AGENTSTREAM_") or v == "KAFKA_BOOTSTRAP_SERVERS"]:
        monkeypatch.delenv(variable)
    for name, value in container_env(find(objects, "Job", f"{RELEASE}-controller")).items():
        monkeypatch.setenv(name, value)
    return ControllerSettings()


def test_the_sandbox_policies_are_the_launchers(helm, tmp_path, monkeypatch):
    """The chart writes the NetworkPolicies the controller would otherwise create: the same objects."""
    objects = render(helm, tmp_path)
    settings = controller_settings(objects, monkeypatch)
    assert settings.backend == "kubernetes" and settings.k8s_namespace == SANDBOX and not settings.k8s_network_policy
    sandbox = sandbox_of(settings)
    assert sandbox.gateway is not None and sandbox.gateway.service_ip == GATEWAY_IP
    assert sandbox.gateway.hostname == f"{RELEASE}-gateway.{NAMESPACE}.svc"
    for network, peer in ((Network.GATEWAY, sandbox.gateway), (Network.NONE, None)):
        expected = network_policy(network, peer, allow_dns=False)
        rendered = find(objects, "NetworkPolicy", expected["metadata"]["name"])
        assert rendered["metadata"]["namespace"] == SANDBOX
        assert rendered["spec"] == expected["spec"]


# --- against a real API server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def installed(kube_cluster, helm, tmp_path_factory):
    """Every object of the chart, created by server-side apply (as `helm install --server-side` would),
    in a release namespace that enforces `restricted` too. Returns (admin client, the objects)."""
    from kubernetes import client
    from kubernetes.dynamic import DynamicClient

    objects = render(helm, tmp_path_factory.mktemp("helm"))
    admin = api_client(kube_cluster.kubeconfig, None)
    client.CoreV1Api(admin).create_namespace({"metadata": {"name": NAMESPACE, "labels": PSS_RESTRICTED}})
    dynamic = DynamicClient(admin)
    for obj in sorted(objects, key=lambda o: o["kind"] != "Namespace"):
        resource = dynamic.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        namespace = obj["metadata"].get("namespace", NAMESPACE) if resource.namespaced else None
        applied = dynamic.server_side_apply(resource, body=obj, name=obj["metadata"]["name"], namespace=namespace,
                                           field_manager="helm")
        assert applied.metadata.name == obj["metadata"]["name"]
    for namespace in (NAMESPACE, SANDBOX):  # the service-account controller does not run here
        client.CoreV1Api(admin).create_namespaced_service_account(namespace, {"metadata": {"name": "default"}})
    return admin, objects


def pod_of(workload: dict) -> dict:
    template = workload["spec"]["template"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{workload['metadata']['name']}-pod", "labels": template["metadata"].get("labels", {})},
            "spec": template["spec"]}


def test_every_object_is_admitted_and_its_pods_pass_restricted(installed):
    from kubernetes import client

    admin, objects = installed
    core = client.CoreV1Api(admin)
    assert core.read_namespace(SANDBOX).metadata.labels["pod-security.kubernetes.io/enforce"] == "restricted"
    workloads = [o for o in objects if o["kind"] in ("Deployment", "Job")]
    assert {o["metadata"]["name"] for o in workloads} == {
        f"{RELEASE}-{name}" for name in ("gateway", "streams", "trainer", "dashboard", "controller", "topics",
                                         "releases")}
    for workload in workloads:
        pod = core.create_namespaced_pod(NAMESPACE, pod_of(workload), dry_run="All")
        assert pod.spec.security_context.run_as_non_root
    service = core.read_namespaced_service(f"{RELEASE}-gateway", NAMESPACE)
    assert service.spec.cluster_ip == GATEWAY_IP


def test_attempt_pods_are_admitted_in_the_sandbox_and_a_loosened_one_is_not(installed, monkeypatch):
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    admin, objects = installed
    core = client.CoreV1Api(admin)
    settings = controller_settings(objects, monkeypatch)
    job = default_job(settings.k8s_image, settings.agent, settings.timeout_s, settings.kill_grace_s,
                      settings.k8s_keep_jobs, sandbox_of(settings))
    job["metadata"] = {"name": "attempt"}
    pod = pod_of(job)
    assert core.create_namespaced_pod(SANDBOX, pod, dry_run="All").spec.host_aliases[0].ip == GATEWAY_IP

    # the attack: agent code asking for root and its capabilities back
    loosened = yaml.safe_load(yaml.safe_dump(pod))
    loosened["spec"]["securityContext"]["runAsNonRoot"] = False
    loosened["spec"]["securityContext"]["runAsUser"] = 0
    loosened["spec"]["containers"][0]["securityContext"]["capabilities"] = {"add": ["NET_RAW"]}
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod(SANDBOX, loosened, dry_run="All")
    assert refused.value.status == 403 and "violates PodSecurity" in refused.value.body


def test_the_controller_can_do_what_the_launcher_does_and_nothing_more(installed, kube_cluster, tmp_path, monkeypatch):
    """As the controller's service account (a token from the TokenRequest API): the launcher's calls in the
    sandbox namespace are allowed, everything else is refused by RBAC."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    admin, objects = installed
    token = client.CoreV1Api(admin).create_namespaced_service_account_token(
        f"{RELEASE}-controller", NAMESPACE, {"spec": {"expirationSeconds": 3600}}).status.token
    controller = api_client(write_kubeconfig(tmp_path / "kubeconfig", kube_cluster.url, kube_cluster.ca_file, token),
                            None)
    batch, core = client.BatchV1Api(controller), client.CoreV1Api(controller)
    networking = client.NetworkingV1Api(controller)
    settings = controller_settings(objects, monkeypatch)
    job = default_job(settings.k8s_image, settings.agent, settings.timeout_s, settings.kill_grace_s,
                      settings.k8s_keep_jobs, sandbox_of(settings))
    job["metadata"] = {"name": "agent-rbac", "labels": {"agentstream.io/run": "rbac"}}

    batch.create_namespaced_job(SANDBOX, job)
    listed = batch.list_namespaced_job(SANDBOX, label_selector="agentstream.io/run=rbac")
    assert [j.metadata.name for j in listed.items] == ["agent-rbac"]
    batch.list_namespaced_job(SANDBOX, watch=True, timeout_seconds=1, _preload_content=False).release_conn()
    assert core.list_namespaced_pod(SANDBOX, label_selector="job-name=agent-rbac").items == []
    with pytest.raises(ApiException) as missing:  # allowed to read logs: the pod is just not there
        core.read_namespaced_pod_log("agent-rbac-pod", SANDBOX, container="agent")
    assert missing.value.status == 404
    batch.delete_namespaced_job("agent-rbac", SANDBOX, propagation_policy="Background")

    refused = {
        "a pod of its own": lambda: core.create_namespaced_pod(SANDBOX, pod_of(job)),
        "the secrets": lambda: core.list_namespaced_secret(SANDBOX),
        "the release's secrets": lambda: core.list_namespaced_secret(NAMESPACE),
        "Jobs outside the sandbox": lambda: batch.create_namespaced_job(NAMESPACE, job),
        "the sandbox's NetworkPolicies": lambda: networking.delete_namespaced_network_policy(
            "agentstream-sandbox-gateway", SANDBOX),
        "exec into pods": lambda: core.connect_post_namespaced_pod_exec("agent-rbac-pod", SANDBOX, command=["sh"]),
    }
    for what, call in refused.items():
        with pytest.raises(ApiException) as denied:
            call()
        assert denied.value.status == 403, f"{what}: {denied.value.status} {denied.value.body}"
