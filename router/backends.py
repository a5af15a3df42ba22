"""The router's backends: who they are, whether they are healthy, how busy they are, which one serves next.

Owns ``Backend`` (one instance's URL, role, health and in-flight count), ``BackendPool`` (the pick:
least in-flight requests among the healthy backends of a role, round-robin among equals) and
``HealthChecker`` (a periodic ``GET /health`` of every backend with a bounded timeout).

A backend is taken out as soon as its ``/health`` does not answer 200 (refused connection, an error status
such as the 503 of an engine restarting) or after ``unhealthy_after`` health checks in a row time out (a busy
CPU can delay one answer; a timeout alone is weaker evidence than a refusal); a request that cannot connect to
it takes it out at once too. It comes back with its first 200.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from enum import Enum

import httpx

logger = logging.getLogger(__name__)


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


class NoBackendError(Exception):
    """No healthy backend of the role asked for; the router answers 503 with this message."""


@dataclass
class Backend:
    """One fdserve instance behind the router."""

    url: str
    role: Role
    healthy: bool = False  # unknown until the first check answers
    in_flight: int = 0
    failed_checks: int = 0
    last_error: str | None = None
    last_checked: float | None = None  # time.monotonic() of the last health answer or failure
    requests_total: int = 0

    def mark_healthy(self) -> None:
        if not self.healthy:
            logger.info("backend %s (%s) is healthy", self.url, self.role.value)
        self.healthy, self.failed_checks, self.last_error = True, 0, None

    def mark_unhealthy(self, reason: str) -> None:
        if self.healthy:
            logger.warning("backend %s (%s) taken out: %s", self.url, self.role.value, reason)
        self.healthy, self.last_error = False, reason

    def status(self) -> dict:
        return {"url": self.url, "role": self.role.value, "healthy": self.healthy, "in_flight": self.in_flight,
                "requests_total": self.requests_total, "last_error": self.last_error}


@dataclass
class BackendPool:
    """Every backend of the router, by role."""

    backends: list[Backend]
    _turn: itertools.count = field(default_factory=itertools.count)

    def of_role(self, role: Role) -> list[Backend]:
        return [b for b in self.backends if b.role is role]

    def has_healthy(self, role: Role) -> bool:
        return any(b.healthy for b in self.of_role(role))

    def pick(self, role: Role) -> Backend:
        """The healthy backend of ``role`` with the fewest requests in flight; round-robin among equals.

        Raises NoBackendError naming the role and why each backend of it is out.
        """
        candidates = [b for b in self.of_role(role) if b.healthy]
        if not candidates:
            reasons = "; ".join(f"{b.url}: {b.last_error or 'not checked yet'}" for b in self.of_role(role))
            raise NoBackendError(f"no healthy {role.value} backend ({reasons or 'none configured'})")
        fewest = min(b.in_flight for b in candidates)
        tied = [b for b in candidates if b.in_flight == fewest]
        # One shared counter: successive picks among the same tied set go round it in order.
        return tied[next(self._turn) % len(tied)]

    def least_in_flight(self, role: Role) -> int | None:
        """The smallest in-flight count among the healthy backends of ``role`` (None if there is none)."""
        counts = [b.in_flight for b in self.of_role(role) if b.healthy]
        return min(counts) if counts else None


class HealthChecker:
    """Checks every backend's ``GET /health`` every ``interval`` seconds (``timeout`` each, all at once)."""

    def __init__(self, pool: BackendPool, client: httpx.AsyncClient, interval: float, timeout: float,
                 unhealthy_after: int) -> None:
        self.pool = pool
        self.client = client
        self.interval = interval
        self.timeout = timeout
        self.unhealthy_after = unhealthy_after
        self._task: asyncio.Task | None = None

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(b) for b in self.pool.backends))

    async def check(self, backend: Backend) -> None:
        try:
            response = await self.client.get(backend.url + "/health", timeout=self.timeout)
        except httpx.TimeoutException:
            backend.failed_checks += 1
            if backend.failed_checks >= self.unhealthy_after or not backend.healthy:
                backend.mark_unhealthy(f"GET /health timed out {backend.failed_checks} time(s) "
                                       f"after {self.timeout:g} s")
        except httpx.HTTPError as exc:
            backend.failed_checks += 1
            backend.mark_unhealthy(f"GET /health failed: {type(exc).__name__}: {exc}")
        else:
            if response.status_code == 200:
                backend.mark_healthy()
            else:
                backend.failed_checks += 1
                backend.mark_unhealthy(f"GET /health answered {response.status_code}: {response.text[:200]}")
        backend.last_checked = time.monotonic()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="router-health-checker")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # a bug here must not end the checks: log it and keep checking
                logger.exception("health check round failed")
            await asyncio.sleep(self.interval)
