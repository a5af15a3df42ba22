"""One running instance of the API server: its engine processes and shared resources, and the HTTP serving.

Owns: ``Server`` (sweeps what a killed predecessor left, makes the instance's socket directory, one
``EngineReplica`` per local DP rank; starts them, waits until they are ready, stops them and releases
every shared-memory name and socket file on ``close``), ``ipc_dir_for`` (where an instance's sockets
live) and ``serve_http``: the app on uvicorn with the engine supervisor, and the SIGINT/SIGTERM drain
(new requests get 503, requests in flight get ``FD_SHUTDOWN_DRAIN_S``, then the engines stop).
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time

import envs
from config.engine_config import EngineConfig
from engine.entrypoints.engine_supervisor import EngineReplica, EngineSupervisor

logger = logging.getLogger(__name__)


def ipc_dir_for(instance_id: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"fd.{instance_id}.ipc")


class Server:
    """The processes and shared resources of one running instance; ``close`` releases them all."""

    def __init__(self, config: EngineConfig) -> None:
        from inter_communicator.shm import sweep_stale

        self.config = config
        removed = sweep_stale(config.instance_id)
        if removed:
            logger.warning("removed %d stale shared-memory names of instance %s", len(removed), config.instance_id)
        config.ipc_dir = ipc_dir_for(config.instance_id)
        shutil.rmtree(config.ipc_dir, ignore_errors=True)
        os.makedirs(config.ipc_dir, mode=0o700)
        self.replicas = [EngineReplica(config.for_dp_rank(rank)) for rank in config.parallel.local_dp_ranks]
        self._stop_lock = threading.Lock()

    def start_engines(self) -> None:
        for replica in self.replicas:
            replica.start()

    def wait_engines_ready(self) -> None:
        from engine.entrypoints.engine_client import STATE_RUNNING

        while not all(r.ready() for r in self.replicas):
            time.sleep(0.1)
        for replica in self.replicas:
            replica.state = STATE_RUNNING

    def any_rank_down(self) -> bool:
        from engine.entrypoints.engine_client import STATE_DOWN

        return any(r.state == STATE_DOWN for r in self.replicas)

    def stop_engines(self) -> None:
        """Stop every engine process (all ranks at once) and release the ranks' shared memory."""
        from engine.entrypoints.engine_client import STATE_STOPPING

        with self._stop_lock:
            for replica in self.replicas:
                replica.state = STATE_STOPPING
                replica.terminate()
            for replica in self.replicas:
                replica.stop()

    def close(self) -> None:
        from inter_communicator.shm import sweep_stale

        self.stop_engines()
        for child in multiprocessing.active_children():
            child.kill()
        leftovers = sweep_stale(self.config.instance_id)
        if leftovers:
            logger.info("removed %d shared-memory names left by child processes", len(leftovers))
        shutil.rmtree(self.config.ipc_dir, ignore_errors=True)


def serve_http(server: Server, config: EngineConfig) -> None:
    from engine.entrypoints.api_server import build_app
    from engine.entrypoints.http_server import create_server
    from engine.entrypoints.dp_router import DPRouter
    from engine.entrypoints.engine_client import EngineClient
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.model.path)
    clients = [EngineClient(tokenizer, r.addresses, r.signals, r, instance_id=r.config.instance_id,
                            dp_rank=r.config.parallel.dp_rank)
               for r in server.replicas]
    client = clients[0] if len(clients) == 1 else DPRouter(clients, config.cache.block_size)
    app = build_app(client, served_model_name=config.server.served_model_name,
                    max_model_len=config.scheduler.max_model_len, api_key=config.server.api_key,
                    max_request_bytes=envs.FD_MAX_REQUEST_BYTES,
                    max_tokens_default=config.server.max_tokens_default,
                    max_num_seqs=config.scheduler.max_num_seqs)
    drain_s = max(0.0, envs.FD_SHUTDOWN_DRAIN_S)
    # Our own SIGINT/SIGTERM handlers: a drain, then launch's finally-block cleanup. uvicorn's
    # own deadline is only a backstop: the drain ends every request before it.
    http = create_server(app, config.server.host, config.server.port, handle_signals=False,
                         timeout_graceful_shutdown=drain_s + 3)
    supervisor = EngineSupervisor(server.replicas, clients)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        shutdown: list[asyncio.Task] = []
        signals_seen: list[signal.Signals] = []

        def on_signal(sig: signal.Signals) -> None:
            signals_seen.append(sig)
            if len(signals_seen) == 2:
                # Requests in flight end now with an error event, so their connections close cleanly;
                # uvicorn's graceful wait then returns at once (forcing it would cancel them mid-write).
                logger.warning("received %s again; stopping now", sig.name)
                app.state.serving.cut_drain()
                return
            if len(signals_seen) > 2:
                logger.warning("received %s a third time; exiting without waiting for connections", sig.name)
                http.force_exit = True
                return
            logger.info("received %s; draining requests for up to %.1f s, then stopping", sig.name, drain_s)
            supervisor.stop()
            http.request_stop()  # closes the listener; uvicorn then waits for the requests in flight
            shutdown.append(asyncio.ensure_future(app.state.serving.drain(drain_s)))

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        await client.start()
        supervisor.start()
        try:
            await http.serve()
        finally:
            supervisor.stop()
            for task in shutdown:
                if not task.done():
                    task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            # The engines stop while this client still reads their outputs: an engine sending the
            # last outputs (aborts) to a closed socket would block and miss its stop deadline.
            await asyncio.to_thread(server.stop_engines)
            await client.close()

    logger.info("serving %s on http://%s:%d", config.server.served_model_name, config.server.host,
                config.server.port)
    asyncio.run(run())
