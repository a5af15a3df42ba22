"""KV-cache storage backends (the tier below host memory): interface, file and Mooncake.

Owns nothing itself; re-exports the public API. ``mooncake_backend`` is not imported here
so that hosts without the Mooncake client can still use the file backend.
"""
import logging

from cache_manager.transfer_factory.base import BackendStats, KVStorageBackend
from cache_manager.transfer_factory.factory import BACKEND_NAMES, StorageConfig, create_storage_backend
from cache_manager.transfer_factory.file_backend import FileStorageBackend

logger = logging.getLogger(__name__)

__all__ = [
    "BACKEND_NAMES",
    "BackendStats",
    "FileStorageBackend",
    "KVStorageBackend",
    "StorageConfig",
    "create_storage_backend",
]
