"""The Kubernetes launcher: one Job per attempt, created and watched with the official client.

The manifest is the default Job below, with the user's template (`--k8s-job-template`, YAML)
merged over it, then the attempt's own fields set: name, labels, the agent's environment, the
image (per task, for per-repo images) and the task. The default Job's pod is the sandbox's
(`sandbox.kubernetes.pod_spec`: non-root, read-only root, no capabilities, seccomp RuntimeDefault,
no service-account token, limits, deadline, labelled for the NetworkPolicy that lets it reach the
gateway only); there is no second, looser template. At start the launcher creates or updates that
NetworkPolicy in its namespace (`--no-k8s-network-policy` when the operator applies it instead).
Merging follows Kubernetes' strategic-merge habit: mappings merge key by key, lists of named items
(containers, env, volumes, volumeMounts) merge by `name`, other lists are replaced.

The task reaches the pod as a file without any extra object: its JSON is an annotation of the
pod template, and a downward-API volume mounts that annotation at AGENTSTREAM_TASK.

The client is synchronous; calls run in threads (`asyncio.to_thread`), and one thread watches
the run's Jobs (list, then watch from that resourceVersion; relist on 410 Gone) and hands each
change to the event loop. (The client's own `kubernetes.informer.SharedInformer` runs the same
loop, but without a server-side timeout its `stop()` joins a thread blocked on a quiet watch, it
gives no "listed" signal to wait on before the first launch, and it hands typed objects where
this module reads the Jobs' JSON.) Retries are the controller's (backoffLimit 0); the controller deletes
a Job at its timeout and once it is recorded (unless asked to keep it). activeDeadlineSeconds and
ttlSecondsAfterFinished are backstops for Jobs a dead controller leaves behind.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException
from urllib3.response import BaseHTTPResponse

from agentstream.controller.attempt import Attempt, Exit, Gateway, LaunchError, agent_env
from agentstream.controller.history import AttemptRecord
from agentstream.controller.settings import ControllerSettings
from agentstream.sandbox.contract import Limits, Network
from agentstream.sandbox.kubernetes import GatewayPeer, PodSandbox, job_template, network_policy
from agentstream.sandbox.local import is_ip
from agentstream.schemas.events import Task
from agentstream.schemas.ids import derived_id

log = logging.getLogger(__name__)

TASK_DIR = "/var/run/agentstream"
TASK_ANNOTATION = "agentstream.io/task"
RUN_LABEL = "agentstream.io/run"
ROLLOUT_LABEL = "agentstream.io/rollout"
ATTEMPT_LABEL = "agentstream.io/attempt"
MANAGED_BY = {"app.kubernetes.io/managed-by": "agentstream"}
CONTAINER = "agent"
BACKSTOP_TTL_S = 3600
Ended = asyncio.Future[dict[str, Any] | None]
"""a Job's end: the Job as it ended, or None if it was deleted before"""
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def job_name(attempt_id: str) -> str:
    return f"agent-{attempt_id}"


def run_label(run_id: str) -> str:
    """The run id if it is a valid label value, else a stable hash of it."""
    return run_id if _LABEL_VALUE.match(run_id) else f"run-{derived_id(run_id)[:23]}"


DEFAULT_GATEWAY = GatewayPeer(pod_labels={"app.kubernetes.io/name": "agentstream-gateway"}, port=8000)
"""the gateway's pods as the sandbox's NetworkPolicy selects them, unless settings say otherwise"""


def default_job(image: str, command: str, timeout_s: float, grace_s: float, keep_jobs: bool,
                sandbox: PodSandbox | None = None) -> dict[str, Any]:
    """The Job of an attempt: the sandbox's pod (default: gateway-only network, `DEFAULT_GATEWAY`) running
    `command` in `image`, one try, with the controller's deadline as the pod's and the Job's."""
    box = sandbox or PodSandbox(network=Network.GATEWAY, gateway=DEFAULT_GATEWAY)
    deadline = math.ceil(timeout_s + grace_s) + 30
    box = replace(box, image=image, command=command, limits=replace(box.limits, attempt_timeout_s=deadline))
    job = job_template(box)
    job["metadata"] = {}
    spec = job["spec"]
    spec["backoffLimit"] = 0
    spec["template"]["spec"]["terminationGracePeriodSeconds"] = math.ceil(grace_s)
    if not keep_jobs:
        spec["ttlSecondsAfterFinished"] = BACKSTOP_TTL_S
    return job


def sandbox_of(settings: ControllerSettings) -> PodSandbox:
    """The attempts' sandbox from the controller's settings: limits, and the gateway as the only peer."""
    url = urlsplit(settings.gateway_url)
    host = url.hostname or ""
    port = settings.k8s_gateway_port or url.port or (443 if url.scheme == "https" else 80)
    namespace = {"kubernetes.io/metadata.name": settings.k8s_gateway_namespace} \
        if settings.k8s_gateway_namespace else None
    if not is_ip(host) and not settings.k8s_gateway_service_ip and not settings.k8s_allow_dns:
        raise ValueError(f"the gateway URL names host {host!r}, and sandbox pods have no DNS: give "
                         "--k8s-gateway-service-ip (its Service's ClusterIP, written into the pods' /etc/hosts), "
                         "or --k8s-allow-dns (a channel out), or an IP address in --gateway-url")
    gateway = GatewayPeer(pod_labels=_selector(settings.k8s_gateway_selector), port=port,
                          namespace_labels=namespace, service_ip=settings.k8s_gateway_service_ip,
                          hostname=None if is_ip(host) else host)
    limits = Limits(cpus=settings.k8s_cpus, memory_bytes=int(settings.k8s_memory_gib * (1 << 30)))
    return PodSandbox(limits=limits, network=Network.GATEWAY, gateway=gateway, allow_dns=settings.k8s_allow_dns)


def _selector(text: str) -> dict[str, str]:
    pairs = [part.partition("=") for part in text.split(",") if part.strip()]
    if not pairs or any(not key.strip() or not sep for key, sep, _ in pairs):
        raise ValueError(f"--k8s-gateway-selector {text!r}: give the gateway pods' labels as KEY=VALUE[,KEY=VALUE]")
    return {key.strip(): value.strip() for key, _, value in pairs}


def image_of(template: str, task: Task) -> str:
    """The attempt's image: `--k8s-image` with `{…}` fields from the task's metadata, so tasks of several
    repositories run each in its own image (`registry/swe-{repo_slug}:1`); `{repo_slug}` is the
    metadata's `repo` as `owner__name`, lower case, `{task_id}` the task's id."""
    fields = {key: str(value) for key, value in (task.metadata or {}).items() if isinstance(value, (str, int))}
    if "repo" in fields:
        fields["repo_slug"] = fields["repo"].replace("/", "__").lower()
    fields["task_id"] = task.id
    try:
        return template.format_map(fields)
    except (KeyError, ValueError, IndexError) as exc:
        raise LaunchError(f"--k8s-image {template!r}: task {task.id!r} has no metadata field {exc} "
                          f"(it has {sorted(fields)})") from None


def merge(base: Any, override: Any) -> Any:
    """`override` over `base`: mappings by key, lists of named mappings by name, the rest replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = copy.deepcopy(base)  # never share structure: each attempt's manifest is its own
        for key, value in override.items():
            out[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if _named_list(base) and _named_list(override):
        items = [copy.deepcopy(item) for item in base]
        index = {item["name"]: i for i, item in enumerate(items)}
        for item in override:
            if item["name"] in index:
                items[index[item["name"]]] = merge(items[index[item["name"]]], item)
            else:
                items.append(copy.deepcopy(item))
        return items
    return copy.deepcopy(override)


def _named_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) and "name" in item for item in value)


def load_template(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        template = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: cannot read the Job template: {exc}") from None
    if not isinstance(template, dict) or template.get("kind", "Job") != "Job":
        raise ValueError(f"{path}: the Job template must be a YAML mapping of kind Job (any part of one)")
    return template


def render_job(base: dict[str, Any], attempt: Attempt, env: dict[str, str], run_id: str,
               image: str | None = None) -> dict[str, Any]:
    """The Job manifest of one attempt: `base` (default + template) with the attempt's fields set."""
    labels = {**MANAGED_BY, RUN_LABEL: run_label(run_id), ROLLOUT_LABEL: attempt.rollout_id,
              ATTEMPT_LABEL: attempt.attempt_id}
    task_json = json.dumps(attempt.rollout.task.input)
    attempt_fields = {
        "metadata": {"name": job_name(attempt.attempt_id), "labels": labels},
        "spec": {"template": {
            "metadata": {"labels": labels, "annotations": {TASK_ANNOTATION: task_json}},
            "spec": {"volumes": [{"name": "agentstream-task", "downwardAPI": {"items": [
                {"path": "task.json", "fieldRef": {"fieldPath": f"metadata.annotations['{TASK_ANNOTATION}']"}}]}}]},
        }},
    }
    job: dict[str, Any] = merge(base, attempt_fields)
    job["metadata"].pop("generateName", None)
    pod = job["spec"]["template"]["spec"]
    containers = pod["containers"]
    agent = next((c for c in containers if c["name"] == CONTAINER), containers[0])
    if image:  # the agent's, and the seeding init container's when it copies from the same image
        for container in pod.get("initContainers", []):
            if container.get("image") == agent.get("image"):
                container["image"] = image
        agent["image"] = image
    agent["env"] = merge(agent.get("env", []), [{"name": k, "value": v} for k, v in env.items()])
    agent["volumeMounts"] = merge(agent.get("volumeMounts", []),
                                  [{"name": "agentstream-task", "mountPath": TASK_DIR, "readOnly": True}])
    return job


def api_client(kubeconfig: Path | None, context: str | None) -> client.ApiClient:
    """From the kubeconfig file given; else in-cluster; else ~/.kube/config."""
    try:
        api: client.ApiClient
        if kubeconfig is not None:
            api = config.new_client_from_config(config_file=str(kubeconfig), context=context)
            return api
        try:
            config.load_incluster_config()
            return client.ApiClient()
        except config.ConfigException:
            api = config.new_client_from_config(context=context)
            return api
    except (config.ConfigException, OSError) as exc:
        raise ValueError(f"no usable Kubernetes configuration ({exc}): give --k8s-kubeconfig FILE "
                         "(and --k8s-context), or run the controller in a cluster") from None


class RateLimit:
    """At most `rate` acquisitions per second, spaced evenly.

    Ten lines, kept rather than a dependency: the limiting libraries (aiolimiter, pyrate-limiter) allow
    bursts up to the bucket's size, which is what the API server's own throttling answers with 429s."""

    def __init__(self, rate: float):
        self.interval = 1.0 / rate
        self.next_at = 0.0
        self.lock = asyncio.Lock()

    async def acquire(self) -> None:
        async with self.lock:
            now = time.monotonic()
            if self.next_at > now:
                await asyncio.sleep(self.next_at - now)
            self.next_at = max(now, self.next_at) + self.interval


def _condition(job: dict[str, Any], kind: str) -> dict[str, Any] | None:
    conditions: list[dict[str, Any]] = (job.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == kind and c.get("status") == "True"), None)


def job_ended(job: dict[str, Any]) -> bool:
    return bool(_condition(job, "Complete") or _condition(job, "Failed"))


class JobRun:
    """One attempt's Job, as the controller sees it."""

    def __init__(self, launcher: KubernetesLauncher, name: str, ended: Ended):
        self.launcher = launcher
        self.name = name
        self.worker = f"job {launcher.namespace}/{name}"
        self.ended = ended
        self.deleted = False

    async def wait(self) -> Exit:
        job = await asyncio.shield(self.ended)
        if job is None:
            return Exit(None, "the Job was deleted before it finished")
        exit_code = await asyncio.to_thread(self.launcher.pod_exit_code, self.name)
        if _condition(job, "Complete"):
            return Exit(0 if exit_code is None else exit_code)
        failed = _condition(job, "Failed") or {}
        reason = failed.get("reason", "Failed")
        if reason == "DeadlineExceeded":
            return Exit(exit_code, "the Job passed its activeDeadlineSeconds", timed_out=True)
        return Exit(exit_code, f"Job failed ({reason}): {failed.get('message', '')}".rstrip(": "))

    async def stop(self) -> None:
        await self.launcher.delete(self.name)
        self.deleted = True

    async def close(self) -> tuple[str, str]:
        logs = await asyncio.to_thread(self.launcher.pod_log_tail, self.name)
        if not self.deleted and not self.launcher.keep_jobs:
            await self.launcher.delete(self.name)
            self.deleted = True
        self.launcher.forget(self.name)
        return logs, ""  # a pod's log interleaves stdout and stderr


class KubernetesLauncher:
    name: Literal["kubernetes"] = "kubernetes"

    def __init__(self, api: client.ApiClient, namespace: str, base_job: dict[str, Any], run_id: str,
                 timeout_s: float, create_rate: float, keep_jobs: bool, tail_chars: int, grace_s: float,
                 image: str | None = None, policy: dict[str, Any] | None = None):
        self.api = api
        self.batch = client.BatchV1Api(api)
        self.core = client.CoreV1Api(api)
        self.networking = client.NetworkingV1Api(api)
        self.image = image
        """the image template (per-task fields); None: the base Job's image as it is"""
        self.policy = policy
        """the NetworkPolicy to put in place at start; None: the operator's"""
        self.namespace = namespace
        self.base_job = base_job
        self.run_id = run_id
        self.timeout_s = timeout_s
        self.rate = RateLimit(create_rate)
        self.keep_jobs = keep_jobs
        self.tail_chars = tail_chars
        self.grace_s = grace_s
        self.selector = f"{RUN_LABEL}={run_label(run_id)}"
        self._ended: dict[str, Ended] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = threading.Event()
        self._watching = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: watch.Watch | None = None
        self.watch_error: str | None = None

    @classmethod
    def from_settings(cls, settings: ControllerSettings, run_id: str) -> KubernetesLauncher:
        sandbox = sandbox_of(settings)
        base = merge(default_job(settings.k8s_image, settings.agent, settings.timeout_s, settings.kill_grace_s,
                                 settings.k8s_keep_jobs, sandbox), load_template(settings.k8s_job_template))
        policy = network_policy(sandbox.network, sandbox.gateway, allow_dns=sandbox.allow_dns) \
            if settings.k8s_network_policy else None
        return cls(api_client(settings.k8s_kubeconfig, settings.k8s_context), settings.k8s_namespace, base, run_id,
                   settings.timeout_s, settings.k8s_create_rate, settings.k8s_keep_jobs, settings.tail_chars,
                   settings.kill_grace_s, image=settings.k8s_image, policy=policy)

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        if self.policy is not None:
            await asyncio.to_thread(self.ensure_policy, self.policy)
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._watch_jobs, name="k8s-job-watch", daemon=True)
        self._thread.start()
        while not self._watching.is_set():  # the first list tells us the API is reachable
            if not self._thread.is_alive() or self.watch_error:
                raise RuntimeError(f"cannot watch Jobs in namespace {self.namespace}: {self.watch_error}; "
                                   "check --k8s-kubeconfig / --k8s-context and the namespace")
            await asyncio.sleep(0.05)

    def ensure_policy(self, policy: dict[str, Any]) -> None:
        """Create the sandbox pods' NetworkPolicy, or bring an existing one of that name up to date."""
        name = policy["metadata"]["name"]
        try:
            try:
                # the client serializes a manifest given as a dict as it does its own models; its annotations say models
                self.networking.create_namespaced_network_policy(self.namespace, policy)  # type: ignore[arg-type]
            except ApiException as exc:
                if exc.status != 409:
                    raise
                current = _json(self.networking.read_namespaced_network_policy(name, self.namespace,
                                                                               _preload_content=False))
                updated = merge(policy, {"metadata": {"resourceVersion": current["metadata"]["resourceVersion"]}})
                self.networking.replace_namespaced_network_policy(name, self.namespace, updated)
        except ApiException as exc:
            raise LaunchError(f"cannot put NetworkPolicy {name} in namespace {self.namespace} ({_api_message(exc)}): "
                              "let the controller create and update networkpolicies there, or apply "
                              "`agentstream sandbox k8s-manifests` yourself and run with --no-k8s-network-policy") \
                from exc

    async def close(self) -> None:
        self._closing.set()
        if self._watch:
            self._watch.stop()
        if self._thread:
            await asyncio.to_thread(self._thread.join, 10)
        await asyncio.to_thread(self.api.close)

    # --- attempts -----------------------------------------------------------------------------

    def render(self, attempt: Attempt, gateway: Gateway) -> dict[str, Any]:
        env = agent_env(gateway, attempt, f"{TASK_DIR}/task.json", self.timeout_s)
        image = image_of(self.image, attempt.rollout.task) if self.image else None
        return render_job(self.base_job, attempt, env, self.run_id, image)

    async def launch(self, attempt: Attempt, gateway: Gateway) -> JobRun:
        job = self.render(attempt, gateway)
        name = job["metadata"]["name"]
        ended: Ended = asyncio.get_running_loop().create_future()
        self._ended[name] = ended
        await self.rate.acquire()
        try:
            # (a dict manifest, which the client serializes as it does its V1Job model: see ensure_policy)
            await asyncio.to_thread(self.batch.create_namespaced_job, self.namespace, job)  # type: ignore[arg-type]
        except ApiException as exc:
            self._ended.pop(name, None)
            raise LaunchError(f"the API server refused Job {name}: {_api_message(exc)}") from exc
        return JobRun(self, name, ended)

    async def delete(self, name: str) -> None:
        try:
            await asyncio.to_thread(self.batch.delete_namespaced_job, name, self.namespace,
                                    propagation_policy="Background", grace_period_seconds=math.ceil(self.grace_s))
        except ApiException as exc:
            if exc.status != 404:
                raise

    def forget(self, name: str) -> None:
        self._ended.pop(name, None)

    async def reap(self, run_id: str, interrupted: list[AttemptRecord]) -> None:
        for attempt in interrupted:
            await self.delete(job_name(attempt.attempt_id))

    # --- pods (blocking; called in threads) ---------------------------------------------------

    def _pod(self, name: str) -> dict[str, Any] | None:
        pods = _json(self.core.list_namespaced_pod(self.namespace, label_selector=f"job-name={name}",
                                                   _preload_content=False))
        items: list[dict[str, Any]] = pods.get("items") or []
        return items[-1] if items else None

    def pod_exit_code(self, name: str) -> int | None:
        pod = self._pod(name)
        for status in ((pod or {}).get("status") or {}).get("containerStatuses") or []:
            terminated = (status.get("state") or {}).get("terminated")
            if status.get("name") == CONTAINER and terminated:
                code: int | None = terminated.get("exitCode")
                return code
        return None

    def pod_log_tail(self, name: str) -> str:
        try:
            pod = self._pod(name)
            if pod is None or self.tail_chars <= 0:
                return ""
            text = self.core.read_namespaced_pod_log(pod["metadata"]["name"], self.namespace, container=CONTAINER,
                                                     limit_bytes=4 * self.tail_chars)
        except ApiException:  # no log (pod never ran, or its node is gone)
            return ""
        return (text or "")[-self.tail_chars:]

    # --- the watch (its own thread) -----------------------------------------------------------

    def _watch_jobs(self) -> None:
        version: str | None = None
        while not self._closing.is_set():
            try:
                if version is None:
                    listing = _json(self.batch.list_namespaced_job(self.namespace, label_selector=self.selector,
                                                                   _preload_content=False))
                    version = listing["metadata"]["resourceVersion"]
                    for job in listing.get("items") or []:
                        self._hand_over(self._on_job, "MODIFIED", job)
                    self._watching.set()
                self._watch = watch.Watch()
                for event in self._watch.stream(self.batch.list_namespaced_job, self.namespace,
                                                label_selector=self.selector, resource_version=version,
                                                timeout_seconds=5, allow_watch_bookmarks=True, deserialize=False):
                    job = event["object"]
                    version = job["metadata"]["resourceVersion"]
                    if event["type"] != "BOOKMARK":
                        self._hand_over(self._on_job, event["type"], job)
            except ApiException as exc:
                if exc.status == 410:  # our resourceVersion is too old: list again
                    version = None
                    continue
                self._watch_failed(_api_message(exc))
            except Exception as exc:  # connection trouble: try again shortly
                self._watch_failed(str(exc))

    def _watch_failed(self, message: str) -> None:
        self.watch_error = message
        if not self._closing.is_set():
            log.warning("watching Jobs failed (%s); retrying", message)
            self._closing.wait(1.0)

    def _hand_over(self, handler: Callable[[str, dict[str, Any]], None], kind: str, job: dict[str, Any]) -> None:
        assert self._loop is not None  # (set by `start`, before the thread)
        try:
            self._loop.call_soon_threadsafe(handler, kind, job)
        except RuntimeError:  # the loop closed: nobody is waiting any more
            pass

    def _on_job(self, kind: str, job: dict[str, Any]) -> None:
        ended = self._ended.get(job["metadata"]["name"])
        if ended is None or ended.done():
            return
        if kind == "DELETED":
            ended.set_result(job if job_ended(job) else None)
        elif job_ended(job):
            ended.set_result(job)


def _json(response: object) -> dict[str, Any]:
    """The JSON body of a call made with `_preload_content=False`: the client then returns urllib3's response
    as it came (its annotations name the parsed model either way)."""
    if not isinstance(response, BaseHTTPResponse):
        raise TypeError(f"expected the raw response of a call with _preload_content=False, got {type(response)}")
    parsed: dict[str, Any] = json.loads(response.data)
    return parsed


def _api_message(exc: ApiException) -> str:
    try:
        return f"{exc.status} {json.loads(exc.body or '')['message']}"
    except (TypeError, ValueError, KeyError):
        return f"{exc.status} {exc.reason}"
