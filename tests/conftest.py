"""Fixtures shared by the test modules, and the rule that only integration tests start a server.

``reference``: the greedy reference outputs (``harness.reference.load_reference``), read once per session.
``start_server``: starts a ``harness.server.ServerProcess`` healthy and closes it after the test on every
path (pass, failure, error in the test's own set-up); the caller can assert on ``server.leftovers``.

Every test that starts a process or a server carries the ``integration`` marker, so
``python -m pytest -m "not integration" tests`` is the fast inner loop. A test without the marker that tries
to start a server fails at once (``ServerProcess.launch`` refuses), so a missing marker cannot go unnoticed.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterator

import pytest

from harness.reference import load_reference
from harness.server import ServerProcess

logger = logging.getLogger(__name__)


@pytest.fixture(scope="session")
def reference() -> list[dict]:
    return load_reference()


@pytest.fixture
def start_server() -> Iterator[Callable[..., ServerProcess]]:
    """``start_server(*args, **kwargs)``: a healthy ``ServerProcess(*args, **kwargs)``, closed after the test."""
    started: list[ServerProcess] = []

    def start(*args: str, **kwargs: object) -> ServerProcess:
        server = ServerProcess(*args, **kwargs)
        started.append(server)  # before start(): a server that fails to come up still gets closed
        return server.start()

    yield start
    for server in reversed(started):
        server.close()


def _refuse_launch(self: ServerProcess) -> ServerProcess:
    raise RuntimeError("this test starts a server but is not marked integration: add pytest.mark.integration "
                       "(module pytestmark or on the test) so the fast loop (-m 'not integration') skips it")


@pytest.fixture(autouse=True)
def _servers_only_in_integration_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("integration") is None:
        monkeypatch.setattr(ServerProcess, "launch", _refuse_launch)
