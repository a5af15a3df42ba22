"""Prometheus metrics of one API server, served at ``GET /metrics``.

Owns: the metric definitions (every name starts with ``fdserve:``, every series has the label
``model_name``) in a per-app ``CollectorRegistry`` (never the process-global one, so two apps in
one process do not collide), the per-request recorder the request path feeds (prompt and
generation tokens, finish reason, TTFT, inter-token latency, time per output token, end-to-end
latency), the ASGI middleware counting HTTP requests by endpoint and status code, and the
scrape-time collection of engine-side state, all of it read through the engine client
(``EngineClient`` / ``DPRouter``, see ``engine_client`` for the one path):

- scheduler gauges and counters from the engine's ``ENGINE_STATS`` shared memory, read by name
  (fields appended later are tolerated; ``worker_restarts`` is 0 while the engine lacks it);
- engine process restarts per DP rank (``fdserve:engine_restarts{dp_rank=...}``), counted by the
  API server's supervisor (the engine's own counters restart from 0 with a new engine process);
- prefix-cache counters (hit tokens per tier, swap / write-back / storage miss and error counts)
  from the client's ``cache_stats`` (a control command), bounded by ``FD_METRICS_ENGINE_TIMEOUT``: a
  slow or dead engine never hangs ``/metrics``, the last values received are served instead
  (counters must not drop back to 0) and ``fdserve:engine_query_failures_total`` counts the misses;
- worker readiness and heartbeat age per DP and TP rank (labels ``dp_rank``, ``tp_rank``) from the
  client's health snapshot;
- KV-cache lock wait / hold seconds and acquisitions of every DP rank (label ``dp_rank``) from
  the client's ``kvcache_lock_stats``, when ``FD_USE_KVCACHE_LOCK`` is on.

``/metrics`` is not behind the API key (like vLLM): it exposes counters, never request content.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Iterable, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import envs

logger = logging.getLogger(__name__)

PREFIX = "fdserve:"
METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST

# A CPU server: a first token takes tens of ms (short prompt) to minutes (long prompt, busy batch).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
# A decode step is ~40 ms at batch 1 and ~160 ms at batch 32 here; seconds when prefills interleave.
TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                         10.0, 20.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1800.0)

# Routes counted under their own name; anything else is "other" so that scanners probing random
# paths cannot create unbounded label values.
_KNOWN_ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                              "/v1/cache/reset", "/v1/cache/stats", "/tokenize", "/detokenize",
                              "/tokenizer_info"})
_MODEL_ROUTE_PREFIX = "/v1/models/"

# cache_stats key -> (metric name without prefix, help). Missing keys read as 0.
_CACHE_HIT_TIERS = (("device", "device_hit_tokens"), ("host", "host_hit_tokens"), ("storage", "storage_hit_tokens"))
_CACHE_COUNTERS = (
    ("storage_miss_blocks", "kv_storage_miss_blocks", "Blocks looked up in the storage tier and not found."),
    ("write_back_blocks", "kv_storage_write_back_blocks", "Blocks written back to the storage tier."),
    ("write_back_failed", "kv_storage_write_back_errors", "Storage write-backs that failed."),
    ("storage_errors", "kv_storage_errors", "Storage tier read/write errors reported by the engine."),
    ("swap_out_blocks", "kv_swap_out_blocks", "Blocks swapped out from the device to the host tier."),
    ("transfer_timeouts", "kv_transfer_timeouts", "KV fills (swap-in / prefetch) that timed out and recomputed."),
    ("transfers_overdue", "kv_transfers_overdue", "KV transfers of any kind seen past their deadline."),
    ("storage_lookups", "kv_storage_lookups", "Batched exists calls the engine made to the storage tier."),
    ("storage_lookup_hits", "kv_storage_lookup_hit_blocks", "Blocks the storage tier's exists calls found."),
    ("storage_lookup_misses", "kv_storage_lookup_miss_blocks", "Blocks the storage tier's exists calls did not find."),
    ("storage_lookup_timeouts", "kv_storage_lookup_timeouts",
     "Storage exists calls that outlasted FD_STORAGE_LOOKUP_TIMEOUT_S (counted as misses)."),
    ("storage_lookup_seconds", "kv_storage_lookup_seconds", "Seconds the engine waited for storage exists calls."),
    ("fork_shared_blocks", "kv_fork_shared_blocks",
     "KV blocks choices of an n > 1 request shared instead of computing."),
    ("fork_copied_blocks", "kv_fork_copied_blocks", "Partial KV blocks copied when an n > 1 request forked."),
)
_CACHE_GAUGES = (
    ("kv_blocks_cached", "kv_blocks_cached", "Device KV blocks holding an evictable cached prefix."),
    ("host_blocks_used", "host_kv_blocks_used", "Host-tier KV blocks in use."),
    ("storage_blocks_known", "kv_storage_blocks_known", "Blocks the engine knows to be in the storage tier."),
    ("transfers_in_flight", "kv_transfers_in_flight", "KV transfers (swap, write-back, prefetch) running."),
)
# ENGINE_STATS field -> (metric name, help); counters are monotonic in the engine.
_ENGINE_GAUGES = (
    ("num_running", "num_requests_running", "Requests in the engine's running batch."),
    ("num_waiting", "num_requests_waiting", "Requests queued in the engine, waiting for KV blocks or a slot."),
    ("kv_blocks_used", "kv_blocks_used", "Device KV blocks in use."),
    ("kv_blocks_total", "kv_blocks_total", "Device KV blocks in the pool."),
)
_ENGINE_COUNTERS = (
    ("num_preemptions", "num_preemptions", "Requests preempted (KV blocks reclaimed, recomputed later)."),
    ("num_steps", "engine_steps", "Model steps the engine ran."),
    ("worker_restarts", "worker_restarts", "Worker processes the engine restarted after a failure."),
    ("cache_transfer_restarts", "cache_transfer_restarts", "Cache transfer processes the engine restarted."),
)
_NS = 1e-9


class EngineView(Protocol):
    """What the metrics need from ``EngineClient``."""

    @property
    def num_active_requests(self) -> int: ...

    def engine_stats(self) -> dict[str, int]: ...

    async def cache_stats(self, timeout: float = ...) -> dict[str, Any]: ...

    def kvcache_lock_stats(self) -> dict[int, dict[str, Any] | None]: ...


def endpoint_label(path: str) -> str:
    """The ``endpoint`` label of a request path (bounded set of values)."""
    if path in _KNOWN_ENDPOINTS:
        return path
    if path.startswith(_MODEL_ROUTE_PREFIX):
        return "/v1/models/{model}"
    return "other"


class RequestRecorder:
    """Timing and token counts of one generation request; ``finish`` publishes them once.

    ``on_tokens`` runs per engine output (about once per token): a clock read and one histogram
    observation, about 2 µs here against a decode step of ~40 ms.
    """

    __slots__ = ("_metrics", "_endpoint", "_num_prompt_tokens", "_started", "_first_token_at", "_last_token_at",
                 "_num_tokens", "_finished")

    def __init__(self, metrics: "ServerMetrics", endpoint: str, num_prompt_tokens: int, started: float) -> None:
        self._metrics = metrics
        self._endpoint = endpoint
        self._num_prompt_tokens = num_prompt_tokens
        self._started = started
        self._first_token_at: float | None = None
        self._last_token_at = started
        self._num_tokens = 0
        self._finished = False

    def on_tokens(self, count: int) -> None:
        """``count`` new tokens arrived from the engine."""
        now = time.perf_counter()
        if self._first_token_at is None:
            self._first_token_at = now
            self._metrics.ttft.observe(now - self._started)
        else:
            self._metrics.inter_token_latency.observe((now - self._last_token_at) / count)
        self._last_token_at = now
        self._num_tokens += count

    def finish(self, finish_reason: str | None) -> None:
        """Count the request; ``None`` means it ended before a finish reason (client gone): ``abort``."""
        if self._finished:
            return
        self._finished = True
        metrics = self._metrics
        metrics.count_finished(self._endpoint, finish_reason or "abort")
        metrics.prompt_tokens.inc(self._num_prompt_tokens)
        metrics.generation_tokens.inc(self._num_tokens)
        metrics.e2e_latency.observe(time.perf_counter() - self._started)
        if self._num_tokens >= 2 and self._first_token_at is not None:
            metrics.time_per_output_token.observe((self._last_token_at - self._first_token_at)
                                                  / (self._num_tokens - 1))


class ServerMetrics:
    """Every metric of one app, and the scrape (``render``)."""

    def __init__(self, model_name: str, engine: EngineView, engine_timeout: float | None = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, labels, registry=self.registry, buckets=buckets).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        self._http_requests = Counter(PREFIX + "http_requests", "HTTP requests by endpoint and status code.",
                                      labels + ["endpoint", "status_code"], registry=self.registry)
        self._requests_finished = Counter(PREFIX + "request_finished",
                                          "Generation requests that ended, by endpoint and finish reason "
                                          "(stop, length, abort, error).",
                                          labels + ["endpoint", "finish_reason"], registry=self.registry)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished generation requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated (the usage completion_tokens).")
        self.ttft = histogram("time_to_first_token_seconds", "Seconds from request arrival to the first token.",
                              TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Seconds between consecutive tokens of a request (per engine output, "
                                             "divided by the tokens it carried).", TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = histogram("time_per_output_token_seconds",
                                               "Per request: (last token - first token) / (tokens - 1).",
                                               TOKEN_LATENCY_BUCKETS)
        self.e2e_latency = histogram("e2e_request_latency_seconds",
                                     "Seconds from request arrival until the last token (or the early end).",
                                     E2E_BUCKETS)
        self.engine_state = EngineStateCollector(model_name, engine, engine_timeout)
        self.registry.register(self.engine_state)

    def start_request(self, endpoint: str, num_prompt_tokens: int, started: float) -> RequestRecorder:
        """A recorder for one generation request that arrived at ``started`` (``time.perf_counter()``)."""
        return RequestRecorder(self, endpoint, num_prompt_tokens, started)

    def count_finished(self, endpoint: str, finish_reason: str) -> None:
        self._requests_finished.labels(self.model_name, endpoint, finish_reason).inc()

    def count_http(self, endpoint: str, status_code: int) -> None:
        self._http_requests.labels(self.model_name, endpoint, str(status_code)).inc()

    async def render(self) -> bytes:
        """The Prometheus text exposition, with engine-side values fetched now."""
        await self.engine_state.refresh()
        return generate_latest(self.registry)


class EngineStateCollector:
    """A custom collector: engine gauges, prefix-cache and lock counters, refreshed per scrape.

    ``refresh`` (async, before ``generate_latest``) asks the engine for ``cache_stats``;
    ``collect`` (sync, called by the registry) only reads shared memory and the last replies.
    """

    def __init__(self, model_name: str, engine: EngineView, engine_timeout: float | None) -> None:
        self._model_name = model_name
        self._engine = engine
        self._timeout = envs.FD_METRICS_ENGINE_TIMEOUT if engine_timeout is None else float(engine_timeout)
        if not self._timeout > 0:
            raise ValueError(f"the metrics engine timeout must be positive, got {self._timeout}")
        self._cache_stats: dict[str, Any] = {}
        self._cache_query: asyncio.Future | None = None
        self._engine_query_failures = 0
        self._engine_query_failing = False

    async def refresh(self) -> None:
        """Fetch ``cache_stats`` from the engine; on failure keep the previous values."""
        # Concurrent scrapes share one in-flight query instead of piling commands onto the engine.
        if self._cache_query is None or self._cache_query.done():
            self._cache_query = asyncio.ensure_future(self._engine.cache_stats(timeout=self._timeout))
            self._cache_query.add_done_callback(_retrieve_outcome)
        try:
            reply = await asyncio.shield(self._cache_query)
        except Exception as exc:  # timeout, dead engine, engine-side error: serve the last values
            self._query_failed(f"{type(exc).__name__}: {exc}")
            return
        if not isinstance(reply, dict):
            self._query_failed(f"the reply is a {type(reply).__name__}, not a dict")
            return
        if self._engine_query_failing:
            logger.info("metrics: cache_stats from the engine answered again")
        self._engine_query_failing = False
        self._cache_stats = reply

    def _query_failed(self, reason: str) -> None:
        self._engine_query_failures += 1
        # One warning per failure streak: a scraper polling a stuck engine must not flood the log.
        log = logger.debug if self._engine_query_failing else logger.warning
        log("metrics: cache_stats from the engine failed (%s); serving the last values", reason)
        self._engine_query_failing = True

    def describe(self) -> list[Metric]:
        # Dynamic content: no up-front description (the registry then never calls collect at registration).
        return []

    def collect(self) -> Iterable[Metric]:
        yield from self._engine_metrics()
        yield from self._cache_metrics()
        yield from self._lock_metrics()
        yield self._counter("engine_query_failures", "Scrapes whose cache_stats query to the engine failed or "
                            "timed out (the previous values were served).", self._engine_query_failures)

    # -- families

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self._model_name], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self._model_name], value)
        return family

    def _engine_metrics(self) -> Iterable[Metric]:
        try:
            stats = self._engine.engine_stats()
        except Exception:  # the scrape must still answer with what it has
            logger.exception("metrics: could not read the engine stats from shared memory")
            stats = {}
        for key, name, doc in _ENGINE_GAUGES:
            yield self._gauge(name, doc, stats.get(key, 0))
        total = stats.get("kv_blocks_total", 0)
        yield self._gauge("kv_cache_usage_ratio", "Share of device KV blocks in use (0..1).",
                          stats.get("kv_blocks_used", 0) / total if total else 0.0)
        for key, name, doc in _ENGINE_COUNTERS:
            yield self._counter(name, doc, stats.get(key, 0))
        yield self._gauge("api_server_active_requests", "Requests the API server is waiting on the engine for.",
                          self._engine.num_active_requests)
        engine_restarts = getattr(self._engine, "engine_restarts", None)
        if engine_restarts is not None:
            family = CounterMetricFamily(PREFIX + "engine_restarts", "Engine processes the API server restarted "
                                         "after they died, by DP rank.", labels=["model_name", "dp_rank"])
            for rank, count in sorted(engine_restarts().items()):
                family.add_metric([self._model_name, str(rank)], count)
            yield family
        yield from self._worker_metrics()

    def _worker_metrics(self) -> Iterable[Metric]:
        """Readiness and heartbeat age of every worker, by DP and TP rank (from the health snapshot)."""
        health = getattr(self._engine, "health", None)
        if health is None:
            return
        labels = ["model_name", "dp_rank", "tp_rank"]
        ready = GaugeMetricFamily(PREFIX + "worker_ready", "1 while the worker of this DP/TP rank is ready.",
                                  labels=labels)
        age = GaugeMetricFamily(PREFIX + "worker_heartbeat_age_seconds",
                                "Seconds since the worker of this DP/TP rank last beat its heartbeat.", labels=labels)
        for worker in health().get("workers", []):
            rank_labels = [self._model_name, str(worker.get("dp_rank", 0)), str(worker["rank"])]
            ready.add_metric(rank_labels, 1 if worker["ready"] else 0)
            age.add_metric(rank_labels, worker["heartbeat_age_s"])
        yield ready
        yield age

    def _cache_metrics(self) -> Iterable[Metric]:
        stats = self._cache_stats
        hits = CounterMetricFamily(PREFIX + "prefix_cache_hit_tokens",
                                   "Prompt tokens served from the prefix cache, by tier (device, host, storage).",
                                   labels=["model_name", "tier"])
        for tier, key in _CACHE_HIT_TIERS:
            hits.add_metric([self._model_name, tier], stats.get(key, 0))
        yield hits
        for key, name, doc in _CACHE_COUNTERS:
            yield self._counter(name, doc, stats.get(key, 0))
        for key, name, doc in _CACHE_GAUGES:
            yield self._gauge(name, doc, stats.get(key, 0))

    def _lock_metrics(self) -> Iterable[Metric]:
        try:
            by_rank = self._engine.kvcache_lock_stats()
        except Exception:  # the scrape must still answer with what it has
            logger.exception("metrics: could not read the kvcache lock stats")
            by_rank = {}
        attached = {rank: stats for rank, stats in by_rank.items() if stats is not None}
        labels = ["model_name", "dp_rank"]

        def family(kind: type, name: str, doc: str, key: str, scale: float = 1.0) -> Metric:
            metric = kind(PREFIX + name, doc, labels=labels)
            for rank, stats in sorted(attached.items()):
                metric.add_metric([self._model_name, str(rank)], stats[key] * scale)
            return metric

        enabled = GaugeMetricFamily(PREFIX + "kvcache_lock_enabled",
                                    "1 if FD_USE_KVCACHE_LOCK is on and the DP rank's lock is attached.",
                                    labels=labels)
        for rank, stats in sorted(by_rank.items()):
            enabled.add_metric([self._model_name, str(rank)], 0 if stats is None else 1)
        yield enabled
        if not attached:
            return
        yield family(CounterMetricFamily, "kvcache_lock_acquisitions", "Acquisitions of the KV-cache lock.",
                     "acquisitions")
        yield family(CounterMetricFamily, "kvcache_lock_contended", "Acquisitions that had to wait.", "contended")
        yield family(CounterMetricFamily, "kvcache_lock_wait_seconds", "Seconds spent waiting for the KV-cache lock.",
                     "wait_ns_total", _NS)
        yield family(CounterMetricFamily, "kvcache_lock_hold_seconds", "Seconds the KV-cache lock was held.",
                     "hold_ns_total", _NS)
        yield family(CounterMetricFamily, "kvcache_lock_recoveries",
                     "Times the lock was recovered from a dead holder.", "recoveries")
        yield family(GaugeMetricFamily, "kvcache_lock_max_wait_seconds", "Longest wait for the KV-cache lock.",
                     "max_wait_ns", _NS)
        yield family(GaugeMetricFamily, "kvcache_lock_max_hold_seconds", "Longest hold of the KV-cache lock.",
                     "max_hold_ns", _NS)
        held = GaugeMetricFamily(PREFIX + "kvcache_lock_held", "1 while some process holds the KV-cache lock.",
                                 labels=labels)
        for rank, stats in sorted(attached.items()):
            held.add_metric([self._model_name, str(rank)], 1 if stats["held"] else 0)
        yield held


def _retrieve_outcome(task: asyncio.Future) -> None:
    # A query whose scrape went away (client disconnect) is awaited by nobody; reading its
    # exception here keeps asyncio from logging "exception was never retrieved".
    if not task.cancelled():
        task.exception()


class HTTPMetricsMiddleware:
    """Plain ASGI middleware counting every HTTP request by endpoint and response status.

    Outermost, so 401s from the API-key check and 413s are counted too. A request that ends
    without a response start counts as 500 if the app raised, else 499 (client gone).
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: int | None = None

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        failed = False
        try:
            await self.app(scope, receive, send_and_watch)
        except Exception:
            failed = True
            raise
        finally:
            if status is None:
                status = 500 if failed else 499
            self._metrics.count_http(endpoint_label(scope["path"]), status)
