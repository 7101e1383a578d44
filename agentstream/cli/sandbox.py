"""`agentstream sandbox`: one command in the local sandbox, and the Kubernetes sandbox's manifests."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agentstream.cli.options import pairs
from agentstream.cli.output import console


def sandbox_run(
    workspace: Annotated[Path, typer.Argument(help="host folder mounted read-write at /workspace")],
    command: Annotated[str, typer.Argument(help="a shell command, run with bash -c inside")],
    timeout: Annotated[float, typer.Option(help="wall clock for the command, seconds")] = 120.0,
    bind: Annotated[list[str] | None, typer.Option(help="HOST:INSIDE, mounted read-only (repeatable)")] = None,
    env: Annotated[list[str] | None, typer.Option(help="KEY=VALUE for the command (repeatable)")] = None,
    gateway_url: Annotated[str | None, typer.Option(help="whole-harness mode: the only address reachable")] = None,
) -> None:
    """Run one command in the local sandbox (as root: it needs bubblewrap) and exit with its code."""
    from agentstream.sandbox.contract import Limits, Network, SandboxSpec
    from agentstream.sandbox.local import LocalSandbox

    binds = [(Path(host), Path(inside)) for host, _, inside in (b.partition(":") for b in bind or [])]
    spec = SandboxSpec(workspace, Limits(command_timeout_s=timeout), Network.GATEWAY if gateway_url else Network.NONE,
                       binds, pairs(env or [], "--env"), gateway_url)
    with LocalSandbox(spec) as box:
        result = box.run(command)
    typer.echo(result.output, nl=False)
    if result.limit:
        console.print(f"[yellow]stopped by the sandbox's {result.limit} limit[/yellow]")
    raise typer.Exit(result.exit_code if result.exit_code >= 0 else 128 - result.exit_code)


def sandbox_k8s_manifests(
    out: Annotated[Path, typer.Argument(help="folder for job-template.yaml and networkpolicy.yaml")],
    gateway_label: Annotated[list[str] | None, typer.Option(
        help="KEY=VALUE of the gateway's pods (repeatable); without it: no network at all")] = None,
    gateway_port: Annotated[int, typer.Option(help="the port the gateway's pods listen on")] = 8000,
    gateway_namespace_label: Annotated[list[str] | None, typer.Option(
        help="KEY=VALUE of the gateway's namespace, if not the sandboxes' own (repeatable)")] = None,
    gateway_service_ip: Annotated[str | None, typer.Option(help="the gateway Service's ClusterIP")] = None,
    gateway_host: Annotated[str | None, typer.Option(help="the gateway's host name in OPENAI_BASE_URL")] = None,
    cpus: Annotated[float, typer.Option(help="CPU cores per sandbox")] = 1.0,
    memory_gib: Annotated[float, typer.Option(help="memory per sandbox, GiB")] = 4.0,
    attempt_timeout: Annotated[float, typer.Option(help="seconds an attempt may run")] = 1800.0,
    allow_dns: Annotated[bool, typer.Option(help="let sandboxes query kube-dns (a channel out)")] = False,
) -> None:
    """Write the sandbox's Job template (for `agentstream run --k8s-job-template`) and its NetworkPolicy."""
    from agentstream.sandbox.contract import Limits, Network
    from agentstream.sandbox.kubernetes import GatewayPeer, PodSandbox, write_manifests

    gateway = None
    if gateway_label:
        namespace_labels = pairs(gateway_namespace_label, "--gateway-namespace-label") \
            if gateway_namespace_label else None
        gateway = GatewayPeer(pairs(gateway_label, "--gateway-label"), gateway_port, namespace_labels,
                              gateway_service_ip, gateway_host)
    limits = Limits(cpus=cpus, memory_bytes=int(memory_gib * (1 << 30)), attempt_timeout_s=attempt_timeout)
    sandbox = PodSandbox(limits=limits, network=Network.GATEWAY if gateway else Network.NONE, gateway=gateway,
                         allow_dns=allow_dns)
    for path in write_manifests(out, sandbox):
        console.print(f"wrote {path}")
