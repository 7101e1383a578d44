"""The sandbox contract as Kubernetes objects: a locked-down Pod spec, and the NetworkPolicy that fences it.

Plain dicts (the API's JSON), so they merge into the controller's Job (`job_template` is a partial Job
for `controller.kubernetes.merge`, `--k8s-job-template`) and go to any client as they are.

What the local backend does and what stands for it here:
| local (bubblewrap)                   | Kubernetes                                                        |
|--------------------------------------|-------------------------------------------------------------------|
| a uid of its own, no capabilities    | runAsNonRoot, runAsUser 1000, capabilities drop ALL,              |
|                                      | allowPrivilegeEscalation false, seccomp RuntimeDefault            |
| read-only system                     | readOnlyRootFilesystem                                            |
| the workspace, a private /tmp        | emptyDir volumes at /workspace and /tmp (with size limits)        |
| a clean environment                  | env from SandboxSpec.env only (+ AGENTSTREAM_SANDBOX=pod); no    |
|                                      | service account token, no                                         |
|                                      | service links, nothing from Secrets                               |
| memory and cpu cgroup, RLIMIT_AS/CPU | memory and cpu limits (cgroups; requests = limits)                |
| pids cgroup, RLIMIT_NPROC            | the kubelet's podPidsLimit (a node setting: no pod field exists)  |
| a workspace disk of Limits.disk_bytes| ephemeral-storage limit, emptyDir sizeLimits (eviction)           |
| attempt wall clock                   | activeDeadlineSeconds                                             |
| per-command wall clock               | the harness's, inside the pod                                     |
| no network / only the gateway        | the NetworkPolicy below (needs a CNI that enforces policies)      |

The agent's command runs with `exec` when it is one command (`agent_command`): no shell stays in the
pod holding the environment, and so the attempt's token, where the agent's own commands could read it.

The NetworkPolicy selects sandbox pods by `NETWORK_LABEL` and denies all ingress and egress, except,
for `Network.GATEWAY`, TCP to the gateway's pods on the gateway's port. DNS is NOT allowed: a cluster
resolver forwards names to the internet, and that is a channel out. So the pod's DNS points at
127.0.0.1 (lookups fail at once instead of timing out) and the gateway's Service name is given by
`hostAliases` (the Service's ClusterIP, so the URL and TLS names stay the same). Policies match pod
addresses after the Service's DNAT, so allowing the gateway pods allows their Service IP too.
`allow_dns=True` opens UDP/TCP 53 to kube-dns for clusters that accept that channel.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agentstream.sandbox.contract import IN_POD_ENV, WORKSPACE_MOUNT, Limits, Network, SandboxError

NETWORK_LABEL = "agentstream.io/sandbox-network"
"""on every sandbox pod: 'none' or 'gateway'; the NetworkPolicies select on it"""
CONTAINER = "agent"
"""the container name the controller's Job uses (controller.kubernetes.CONTAINER)"""
RUN_AS = 1000
WORKSPACE_VOLUME = "workspace"
TMP_VOLUME = "tmp"


@dataclass(frozen=True)
class GatewayPeer:
    """Where the gateway runs, as a NetworkPolicy and a pod's /etc/hosts need it."""

    pod_labels: Mapping[str, str]
    """labels of the gateway's pods"""
    port: int
    """the port the gateway's pods listen on (the Service's targetPort)"""
    namespace_labels: Mapping[str, str] | None = None
    """labels of the gateway's namespace, if it is not the sandbox's"""
    service_ip: str | None = None
    """the gateway Service's ClusterIP; with `hostname`, written into the pod's /etc/hosts"""
    hostname: str | None = None
    """the host name in the gateway URL the harness is given (e.g. gateway.agentstream.svc)"""


@dataclass(frozen=True)
class PodSandbox:
    """One sandbox pod's settings: the SandboxSpec's limits, network and environment, plus an image."""

    limits: Limits = field(default_factory=Limits)
    network: Network = Network.NONE
    env: Mapping[str, str] = field(default_factory=dict)
    gateway: GatewayPeer | None = None
    image: str | None = None
    """None in a Job template: the controller sets the image"""
    command: str | None = None
    """a shell command; None in a Job template: the controller sets the command"""
    seed_from: str | None = None
    """a folder of the image to copy into the (empty) workspace first, by an init container"""
    allow_dns: bool = False


def container_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def resources(limits: Limits) -> dict[str, Any]:
    amounts = {
        "cpu": f"{math.ceil(limits.cpus * 1000)}m",
        "memory": str(limits.memory_bytes),
        "ephemeral-storage": str(limits.disk_bytes + limits.tmp_bytes),
    }
    return {"limits": amounts, "requests": dict(amounts)}  # requests = limits: Guaranteed, never overcommitted


def pod_spec(sandbox: PodSandbox) -> dict[str, Any]:
    """The PodSpec of one sandbox (the `spec` of a Pod, or of a Job's pod template)."""
    _check(sandbox)
    limits = sandbox.limits
    container: dict[str, Any] = {
        "name": CONTAINER,
        "workingDir": str(WORKSPACE_MOUNT),
        "env": [{"name": name, "value": value}
                for name, value in {"HOME": "/tmp", IN_POD_ENV: "pod", **sandbox.env}.items()],
        "securityContext": container_security_context(),
        "resources": resources(limits),
        "volumeMounts": [{"name": WORKSPACE_VOLUME, "mountPath": str(WORKSPACE_MOUNT)},
                         {"name": TMP_VOLUME, "mountPath": "/tmp"}],
    }
    if sandbox.image:
        container["image"] = sandbox.image
    if sandbox.command:
        container["command"] = agent_command(sandbox.command)
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "activeDeadlineSeconds": math.ceil(limits.attempt_timeout_s),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "hostNetwork": False,
        "hostPID": False,
        "hostIPC": False,
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": WORKSPACE_VOLUME, "emptyDir": {"sizeLimit": str(limits.disk_bytes)}},
            {"name": TMP_VOLUME, "emptyDir": {"sizeLimit": str(limits.tmp_bytes)}},
        ],
    }
    if sandbox.seed_from:
        spec["initContainers"] = [{
            "name": "seed-workspace",
            "image": sandbox.image,
            "command": ["/bin/sh", "-c", f'cp -a "$0"/. {WORKSPACE_MOUNT}/', sandbox.seed_from],
            "securityContext": container_security_context(),
            "resources": resources(limits),
            "volumeMounts": [{"name": WORKSPACE_VOLUME, "mountPath": str(WORKSPACE_MOUNT)}],
        }]
    if not sandbox.allow_dns:
        spec["dnsPolicy"] = "None"
        spec["dnsConfig"] = {"nameservers": ["127.0.0.1"]}  # refused at once, instead of a blocked lookup's timeout
    gateway = sandbox.gateway
    if sandbox.network is Network.GATEWAY and gateway and gateway.service_ip and gateway.hostname:
        spec["hostAliases"] = [{"ip": gateway.service_ip, "hostnames": [gateway.hostname]}]
    return spec


def agent_command(command: str) -> list[str]:
    """The container's command for the agent's shell command: with `exec` when it is one command.

    The pod's environment holds the attempt's token; a shell left waiting as the pod's first process
    (dash does not exec the last command of `sh -c`) would hold it too, readable by every process of
    the pod's uid, the agent's commands included. Exec'd, the agent is that process and can make
    itself unreadable (`sandbox.inpod.harden`). A compound command keeps its shell (and the harness
    then refuses to run commands, naming this fix)."""
    words = _simple_command(command)
    exec_it = bool(words) and words[0] != "exec"
    return ["/bin/sh", "-c", f"exec {command}" if exec_it else command]


_COMPOUND_WORDS = {"!", "{", "if", "while", "until", "for", "case", "function"}


def _simple_command(command: str) -> list[str]:
    """The words of `command` if it is one simple command: not a list, pipeline, subshell, background
    job or compound statement, nor one that starts with variable assignments (`exec A=1 cmd` would run
    a program named `A=1`); else []."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:  # unbalanced quotes: the shell will say so; leave the command as it is
        return []
    redirection = set("<>&")
    control = [word for word in words if set(word) <= set("();<>|&") and not set(word) <= redirection]
    if "\n" in command or control or "&" in words or "&&" in words or not words \
            or words[0] in _COMPOUND_WORDS or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        return []
    return words


def pod_labels(sandbox: PodSandbox) -> dict[str, str]:
    return {NETWORK_LABEL: sandbox.network.value}


def pod(name: str, sandbox: PodSandbox) -> dict[str, Any]:
    """A bare Pod (for a sandbox outside the controller's Jobs)."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": pod_labels(sandbox)},
            "spec": pod_spec(sandbox)}


def job_template(sandbox: PodSandbox) -> dict[str, Any]:
    """A partial Job to merge over the controller's default Job (`--k8s-job-template`): the pod spec,
    its labels (the NetworkPolicy's selector) and the attempt's deadline."""
    return {"apiVersion": "batch/v1", "kind": "Job", "spec": {
        "activeDeadlineSeconds": math.ceil(sandbox.limits.attempt_timeout_s),
        "template": {"metadata": {"labels": pod_labels(sandbox)}, "spec": pod_spec(sandbox)},
    }}


def network_policy(network: Network, gateway: GatewayPeer | None = None, name: str | None = None,
                   allow_dns: bool = False) -> dict[str, Any]:
    """Default-deny for the sandbox pods of `network` mode; Network.GATEWAY allows TCP to the gateway only."""
    egress: list[dict[str, Any]] = []
    if network is Network.GATEWAY:
        if gateway is None:
            raise SandboxError("a Network.GATEWAY policy needs the gateway's pod labels and port (GatewayPeer)")
        peer: dict[str, Any] = {"podSelector": {"matchLabels": dict(gateway.pod_labels)}}
        if gateway.namespace_labels is not None:
            peer["namespaceSelector"] = {"matchLabels": dict(gateway.namespace_labels)}
        egress.append({"to": [peer], "ports": [{"protocol": "TCP", "port": gateway.port}]})
    if allow_dns:
        dns = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
               "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}
        egress.append({"to": [dns], "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name or f"agentstream-sandbox-{network.value}"},
        "spec": {
            "podSelector": {"matchLabels": {NETWORK_LABEL: network.value}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [],  # nothing may connect to a sandbox
            "egress": egress,
        },
    }


def _check(sandbox: PodSandbox) -> None:
    if sandbox.network is Network.GATEWAY and sandbox.gateway is None:
        raise SandboxError("Network.GATEWAY needs PodSandbox.gateway (the gateway's pods, port and Service)")
    if sandbox.seed_from and not sandbox.image:
        raise SandboxError("seed_from copies a folder of the image: give PodSandbox.image too")


def write_manifests(folder: Path, sandbox: PodSandbox) -> list[Path]:
    """`job-template.yaml` (for the controller's --k8s-job-template) and `networkpolicy.yaml` (to apply
    once per namespace: the policy of this sandbox's network mode)."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, manifest in (("job-template.yaml", job_template(sandbox)),
                           ("networkpolicy.yaml", network_policy(sandbox.network, sandbox.gateway,
                                                                 allow_dns=sandbox.allow_dns))):
        path = folder / name
        path.write_text(yaml.safe_dump(manifest, sort_keys=False))
        written.append(path)
    return written
