"""The floor above ``envs``: typed configuration, sampling parameters and logging set-up.

Everything here is plain data or a pure function, importable by every other package (inter_communicator,
cache_manager, worker, engine, the API server) without importing any of them.
"""
