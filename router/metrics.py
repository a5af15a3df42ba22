"""The router's own Prometheus metrics (``GET /metrics`` of the router; each backend keeps its own).

Owns ``RouterMetrics``: requests by endpoint and mode (pd or mixed) and by answer status, per-backend
requests, errors, health and in-flight counts, the P/D prefill call's duration and the prefill fallbacks
(requests whose decode instance prefilled locally). Its own registry, so two routers in one process (tests)
never collide.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from router.backends import BackendPool

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIX = "fdserve_router_"


class RouterMetrics:
    def __init__(self, pool: BackendPool) -> None:
        self.pool = pool
        self.registry = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "Client completion requests, by endpoint and mode (pd, mixed)",
                                ["endpoint", "mode"], registry=self.registry)
        self.responses = Counter(PREFIX + "responses", "Client answers by endpoint and HTTP status",
                                 ["endpoint", "status"], registry=self.registry)
        self.backend_requests = Counter(PREFIX + "backend_requests", "Requests sent to each backend",
                                        ["backend", "role"], registry=self.registry)
        self.backend_errors = Counter(PREFIX + "backend_errors",
                                      "Failed backend calls (kind: connect, status or the transport error's name)",
                                      ["backend", "role", "kind"], registry=self.registry)
        self.prefill_seconds = Histogram(PREFIX + "prefill_seconds", "Duration of P/D call 1 (the prefill instance)",
                                         registry=self.registry,
                                         buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.prefill_fallbacks = Counter(
            PREFIX + "prefill_fallbacks",
            "P/D requests whose decode instance prefilled locally, by reason: no_offer (the prefill answer has "
            "no kv_transfer_params: a prompt shorter than one block), no_prefill (none healthy), prefill_failed, "
            "batch (several prompts in one request)", ["reason"], registry=self.registry)
        self.healthy = Gauge(PREFIX + "backend_healthy", "1 if the backend takes requests", ["backend", "role"],
                             registry=self.registry)
        self.in_flight = Gauge(PREFIX + "backend_in_flight", "Requests in flight at the backend",
                               ["backend", "role"], registry=self.registry)

    def render(self) -> bytes:
        for backend in self.pool.backends:
            labels = {"backend": backend.url, "role": backend.role.value}
            self.healthy.labels(**labels).set(1 if backend.healthy else 0)
            self.in_flight.labels(**labels).set(backend.in_flight)
        return generate_latest(self.registry)
