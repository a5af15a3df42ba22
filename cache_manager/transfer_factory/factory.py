"""Choosing and building a KV-cache storage backend from configuration.

This module owns ``create_storage_backend``, the one place that maps a backend name to its class.
``StorageConfig`` (every knob of every backend, defaults from envs.py) is part of the typed
config in ``config/engine_config.py``; it is re-exported here for the backends' callers.
"""
from __future__ import annotations

import logging
from typing import Callable

from cache_manager.transfer_factory.base import KVStorageBackend
from config.engine_config import StorageConfig

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("file", "mooncake")


def _create_file(config: StorageConfig) -> KVStorageBackend:
    from cache_manager.transfer_factory.file_backend import FileStorageBackend

    return FileStorageBackend(config.file_dir, namespace=config.namespace, fsync=config.file_fsync,
                              max_bytes=config.file_max_bytes)


def _create_mooncake(config: StorageConfig) -> KVStorageBackend:
    # Imported lazily: the mooncake module loads the Mooncake client, absent on file-only hosts.
    from cache_manager.transfer_factory.mooncake_backend import MooncakeStorageBackend

    return MooncakeStorageBackend(
        config.mooncake_master_addr,
        metadata_server=config.mooncake_metadata_server,
        protocol=config.mooncake_protocol,
        global_segment_size=config.mooncake_global_segment_size,
        local_buffer_size=config.mooncake_local_buffer_size,
        local_hostname=config.mooncake_local_hostname,
        namespace=config.namespace,
        reconnect_interval_s=config.mooncake_reconnect_interval_s,
        rebuild_after_s=config.mooncake_rebuild_after_s,
    )


_FACTORIES: dict[str, Callable[[StorageConfig], KVStorageBackend]] = {
    "file": _create_file,
    "mooncake": _create_mooncake,
}


def create_storage_backend(config: StorageConfig) -> KVStorageBackend:
    """Build the backend ``config.backend`` names; unknown names raise ValueError."""
    factory = _FACTORIES.get(config.backend)
    if factory is None:
        raise ValueError(f"unknown KV-cache storage backend {config.backend!r}; "
                         f"choose one of: {', '.join(BACKEND_NAMES)}")
    backend = factory(config)
    logger.info("KV-cache storage backend: %s (namespace %s)", backend.name, config.namespace)
    return backend
