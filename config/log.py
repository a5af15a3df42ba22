"""Logging set-up shared by every fdserve process: role and rank in every line."""
from __future__ import annotations

import logging
import sys

import envs

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_FORMAT = "%(asctime)s %(levelname)s [{role}:{rank} pid=%(process)d] %(name)s: %(message)s"


def setup_logging(role: str, rank: int = 0) -> None:
    """Configure the root logger of this process; call once at process start.

    Raises ValueError naming FD_LOG_LEVEL when it is not a level name (before touching the logger).
    """
    level = envs.FD_LOG_LEVEL.upper()
    if level not in _LEVELS:
        raise ValueError(f"environment variable FD_LOG_LEVEL={envs.FD_LOG_LEVEL!r} is not a log level "
                         f"({', '.join(_LEVELS)})")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT.format(role=role, rank=rank), datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
