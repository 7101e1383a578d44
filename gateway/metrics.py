"""Prometheus metrics of one gateway (a registry of its own, so several can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_FAST = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_SLOW = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("gateway_requests", "model calls answered, by API and HTTP status",
                                ["api", "status"], registry=r)
        self.latency = Histogram("gateway_request_seconds", "model call latency as the agent sees it",
                                 ["api", "streamed"], buckets=_SLOW, registry=r)
        self.ttft = Histogram("gateway_ttft_seconds", "time to the first token of streamed calls",
                              ["api"], buckets=_SLOW, registry=r)
        self.in_flight = Gauge("gateway_in_flight_requests", "model calls being served now", registry=r)
        self.publish = Histogram("gateway_publish_seconds", "time from sending a call event to Kafka's ack",
                                 buckets=_FAST, registry=r)
        self.publish_failures = Counter("gateway_publish_failures", "events Kafka did not acknowledge in time",
                                        ["reason"], registry=r)
        self.held = Gauge("gateway_held_requests", "requests waiting for a weight update to finish", registry=r)
        self.hold_wait = Histogram("gateway_hold_wait_seconds", "time requests waited for a weight update",
                                   buckets=_SLOW, registry=r)
        self.hold_timeouts = Counter("gateway_hold_timeouts", "held requests answered 503", registry=r)
        self.upstream_healthy = Gauge("gateway_upstream_healthy", "1 if the upstream passed its last health check",
                                      ["upstream"], registry=r)
        self.upstream_version = Gauge("gateway_upstream_weight_version", "weight version the upstream serves",
                                      ["upstream"], registry=r)
        self.failovers = Counter("gateway_upstream_failovers", "requests moved off an unreachable upstream",
                                 ["upstream"], registry=r)
        self.pool_updates = Counter("gateway_pool_updates", "weight updates this replica applied to a server",
                                    ["status"], registry=r)
        self.pause = Histogram("gateway_pool_pause_seconds", "time a server was paused for a weight update",
                               buckets=_SLOW, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
