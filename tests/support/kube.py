"""A real Kubernetes API server for the launcher's tests: etcd + kube-apiserver, on 127.0.0.1.

Neither binary ships with agentstream. The tests use them when present:
  etcd            on PATH (Debian: `apt-get install etcd-server`), or AGENTSTREAM_ETCD
  kube-apiserver  on PATH, or AGENTSTREAM_KUBE_APISERVER (scripts/kube-apiserver.sh builds it)
and skip otherwise (the recorded-API test still runs); `make test` and `make test-unit` provide both. There is no kubelet and no controller
manager, so no pod runs: `ClusterSim` plays the Job controller and the kubelet by writing the
pods and the Job status a real cluster would, through the same API, which validates them.
"""

from __future__ import annotations

import os
import shutil
import ssl
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentstream.stack.process import await_ready, free_port, spawn, stop_pid

TOKEN = "agentstream-test-token"
FIXED_TIME = "2026-01-01T00:00:00Z"
"""timestamps the simulated cluster writes, fixed so a recording replays byte for byte"""


def binary(name: str, variable: str) -> str | None:
    return os.environ.get(variable) or shutil.which(name)


def missing_binaries() -> str | None:
    missing = [name for name, var in (("etcd", "AGENTSTREAM_ETCD"), ("kube-apiserver", "AGENTSTREAM_KUBE_APISERVER"))
               if not binary(name, var)]
    if missing:
        return (f"needs {' and '.join(missing)} (on PATH, or AGENTSTREAM_ETCD / AGENTSTREAM_KUBE_APISERVER); "
                "`make test-unit` or `make test` provides them; the recorded-API test covers the launcher without them")
    return None


@dataclass
class KubeCluster:
    url: str
    kubeconfig: Path
    ca_file: Path


def _write_service_account_key(path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                       serialization.NoEncryption()))


def write_kubeconfig(path: Path, url: str, ca_file: Path | None, token: str = TOKEN) -> Path:
    trust = f", certificate-authority: {ca_file}" if ca_file else ""
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: test, cluster: {{server: "{url}"{trust}}}}}]
users: [{{name: test, user: {{token: {token}}}}}]
contexts: [{{name: test, context: {{cluster: test, user: test}}}}]
current-context: test
""")
    return path


def start_cluster(root: Path, authorization: str = "AlwaysAllow"):
    """Start etcd and kube-apiserver; yield the cluster; stop both. `authorization="RBAC"` makes the
    API server check Roles (the test token stays an admin: its group is system:masters)."""
    root.mkdir(parents=True, exist_ok=True)
    etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
    etcd = spawn([binary("etcd", "AGENTSTREAM_ETCD"), "--data-dir", str(root / "etcd"),
                  "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                  "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                  "--listen-peer-urls", f"http://127.0.0.1:{peer_port}"], root / "etcd.log")
    apiserver = None
    try:
        _write_service_account_key(root / "sa.key")
        (root / "tokens.csv").write_text(f"{TOKEN},admin,admin,system:masters\n")
        apiserver = spawn([
            binary("kube-apiserver", "AGENTSTREAM_KUBE_APISERVER"), f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", f"--secure-port={api_port}", f"--cert-dir={root / 'certs'}",
            f"--token-auth-file={root / 'tokens.csv'}", f"--authorization-mode={authorization}",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={root / 'sa.key'}", f"--service-account-signing-key-file={root / 'sa.key'}",
            "--service-cluster-ip-range=10.0.0.0/24",
        ], root / "apiserver.log")
        url = f"https://127.0.0.1:{api_port}"
        ca_file = root / "certs" / "apiserver.crt"  # self-signed serving cert, with its CA, written at start

        def ready() -> bool:
            if not ca_file.exists():
                return False
            request = urllib.request.Request(f"{url}/readyz", headers={"Authorization": f"Bearer {TOKEN}"})
            try:
                with urllib.request.urlopen(request, context=ssl.create_default_context(cafile=str(ca_file)),
                                            timeout=2) as response:
                    return response.status == 200
            except OSError:
                return False

        await_ready("kube-apiserver", apiserver, ready, root / "apiserver.log", timeout=120)
        yield KubeCluster(url, write_kubeconfig(root / "kubeconfig", url, ca_file), ca_file)
    finally:
        # the cluster goes with the session: no graceful drain (the API server's took its whole 10 s)
        if apiserver is not None:
            stop_pid(apiserver.pid, grace=1)
        stop_pid(etcd.pid, grace=1)


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory):
    """The session's API server, checking Roles (RBAC) for the chart's tests; the test token is an admin."""
    reason = missing_binaries()
    if reason:
        pytest.skip(reason)
    yield from start_cluster(tmp_path_factory.mktemp("kube"), authorization="RBAC")


@pytest.fixture
def restricted_namespace(kube_cluster):
    """A fresh namespace enforcing the `restricted` Pod Security Standard: (api client, its name)."""
    import uuid

    from kubernetes import client

    from agentstream.controller.kubernetes import api_client

    api = api_client(kube_cluster.kubeconfig, None)
    core = client.CoreV1Api(api)
    name = f"restricted-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name, "labels": {
        "pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}}})
    core.create_namespaced_service_account(name, {"metadata": {"name": "default"}})  # no controller-manager here
    yield api, name
    core.delete_namespace(name)


class ClusterSim:
    """What the Job controller and a kubelet would write, written through the real API."""

    def __init__(self, api_client, namespace: str):
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.batch = client.BatchV1Api(api_client)
        self.namespace = namespace

    def create_namespace(self) -> None:
        self.core.create_namespace({"metadata": {"name": self.namespace}})
        # the service-account controller does not run here; pods need the namespace's default account
        self.core.create_namespaced_service_account(self.namespace, {"metadata": {"name": "default"}})

    def finish(self, job: str, exit_code: int, reason: str = "BackoffLimitExceeded") -> None:
        """The job's pod ran and exited with `exit_code`; the job is marked Complete or Failed."""
        pod = f"{job}-pod"
        self.core.create_namespaced_pod(self.namespace, {
            "metadata": {"name": pod, "labels": {"job-name": job, "batch.kubernetes.io/job-name": job}},
            "spec": {"restartPolicy": "Never", "containers": [{"name": "agent", "image": "agent:test"}]},
        })
        phase = "Succeeded" if exit_code == 0 else "Failed"
        self.core.patch_namespaced_pod_status(pod, self.namespace, {"status": {
            "phase": phase, "containerStatuses": [{
                "name": "agent", "image": "agent:test", "imageID": "", "ready": False, "restartCount": 0,
                "state": {"terminated": {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                                         "startedAt": FIXED_TIME, "finishedAt": FIXED_TIME}}}]}})
        self.end_job(job, exit_code == 0, reason)

    def end_job(self, job: str, succeeded: bool, reason: str = "BackoffLimitExceeded") -> None:
        at = {"lastTransitionTime": FIXED_TIME, "lastProbeTime": FIXED_TIME}
        if succeeded:
            status = {"startTime": FIXED_TIME, "completionTime": FIXED_TIME, "succeeded": 1, "conditions": [
                {"type": "SuccessCriteriaMet", "status": "True", "reason": "CompletionsReached", **at},
                {"type": "Complete", "status": "True", "reason": "CompletionsReached", **at}]}
        else:
            status = {"startTime": FIXED_TIME, "failed": 1, "conditions": [
                {"type": "FailureTarget", "status": "True", "reason": reason, "message": "simulated", **at},
                {"type": "Failed", "status": "True", "reason": reason, "message": "simulated", **at}]}
        self.batch.patch_namespaced_job_status(job, self.namespace, {"status": status})
