"""Start an fdserve server: ``python launch.py [--model PATH] [--port 8000] ...``.

This process is the API server (FastAPI on uvicorn). It creates the instance's
shared-memory signals, spawns the engine process (which spawns the workers),
waits until the model is loaded, serves HTTP, and on SIGINT/SIGTERM stops
everything and removes every shared-memory segment, semaphore and socket file
of this instance.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

import envs
from engine.config import ConfigError, EngineArgs, EngineConfig, build_engine_config
from engine.log import setup_logging

logger = logging.getLogger("launch")

ENGINE_STOP_TIMEOUT_S = 7.0


class LaunchError(RuntimeError):
    pass


def parse_args(argv: list[str] | None = None) -> EngineArgs:
    parser = argparse.ArgumentParser(prog="launch.py", description="Serve an LLM over an OpenAI-compatible API.")
    EngineArgs.add_cli_args(parser)
    return EngineArgs.from_cli_args(parser.parse_args(argv))


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise LaunchError(f"cannot bind {host}:{port}: {exc.strerror}") from exc


def ipc_dir_for(instance_id: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"fd.{instance_id}.ipc")


class EngineReplica:
    """One data-parallel rank: its signals, KV-cache lock and engine process."""

    def __init__(self, config: EngineConfig) -> None:
        from engine.engine_process import EngineAddresses
        from inter_communicator.instance_signals import InstanceSignals

        self.config = config
        self.addresses = EngineAddresses.in_dir(config.ipc_dir, config.dp_rank)
        self.signals = InstanceSignals(config, create=True)
        self.kvcache_lock = None
        if envs.FD_USE_KVCACHE_LOCK:
            from inter_communicator.kvcache_lock import KVCacheLock

            self.kvcache_lock = KVCacheLock.create(config.instance_id, config.dp_rank, role="launch")
        self.proc: multiprocessing.process.BaseProcess | None = None

    def start(self) -> None:
        from engine.engine_process import run_engine

        spawn = multiprocessing.get_context("spawn")
        self.proc = spawn.Process(target=run_engine, name=f"fdserve-engine-{self.config.dp_rank}",
                                  args=(self.config, self.addresses))
        self.proc.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def ready(self) -> bool:
        if not self.alive():
            code = self.proc.exitcode if self.proc is not None else None
            raise LaunchError(f"engine of DP rank {self.config.dp_rank} exited during start-up (code {code}); "
                              "see the log above")
        return bool(self.signals.engine_ready.value[0])

    def stop(self) -> None:
        proc = self.proc
        if proc is not None and proc.exitcode is None:
            proc.terminate()  # SIGTERM: the engine stops its workers, then exits
            proc.join(ENGINE_STOP_TIMEOUT_S)
            if proc.is_alive():
                logger.warning("engine %s did not stop in %.0f s; killing it", proc.name, ENGINE_STOP_TIMEOUT_S)
                proc.kill()
                proc.join(2.0)
        self.signals.close()
        self.signals.unlink()
        if self.kvcache_lock is not None:
            self.kvcache_lock.close()
            self.kvcache_lock.unlink()


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
        self.replicas = [EngineReplica(dataclasses.replace(config, dp_rank=rank)) for rank in local_dp_ranks(config)]
        self.engine_failed = False

    def start_engines(self) -> None:
        for replica in self.replicas:
            replica.start()

    def engines_alive(self) -> bool:
        return all(r.alive() for r in self.replicas)

    def wait_engines_ready(self) -> None:
        while not all(r.ready() for r in self.replicas):
            time.sleep(0.1)

    def close(self) -> None:
        from inter_communicator.shm import sweep_stale

        for replica in self.replicas:
            replica.stop()
        for child in multiprocessing.active_children():
            child.kill()
        leftovers = sweep_stale(self.config.instance_id)
        if leftovers:
            logger.info("removed %d shared-memory names left by child processes", len(leftovers))
        shutil.rmtree(self.config.ipc_dir, ignore_errors=True)


def local_dp_ranks(config: EngineConfig) -> range:
    """The DP ranks this node hosts: an equal share of --data-parallel-size per node."""
    per_node = config.dp_size // config.args.nnodes
    return range(config.args.node_rank * per_node, (config.args.node_rank + 1) * per_node)


def _raise_keyboard_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def serve_http(server: Server, config: EngineConfig) -> None:
    from engine.api_server import build_app, create_server
    from engine.dp_router import DPRouter
    from engine.engine_client import EngineClient
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.args.model)
    clients = [EngineClient(tokenizer, r.addresses.requests, r.addresses.outputs, r.signals, r.alive)
               for r in server.replicas]
    client = clients[0] if len(clients) == 1 else DPRouter(clients, config.block_size)
    app = build_app(client, served_model_name=config.served_model_name, max_model_len=config.max_model_len,
                    api_key=config.args.api_key or envs.FD_API_KEY, max_request_bytes=envs.FD_MAX_REQUEST_BYTES,
                    instance_id=config.instance_id, dp_rank=server.replicas[0].config.dp_rank)
    # Our own SIGINT/SIGTERM handlers: a graceful stop, then launch's finally-block cleanup.
    http = create_server(app, config.args.host, config.args.port, handle_signals=False, timeout_graceful_shutdown=3)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, http.request_stop)
        await client.start()
        watchdog = asyncio.create_task(_exit_when_engine_dies(server, http))
        try:
            await http.serve()
        finally:
            watchdog.cancel()
            await client.close()

    logger.info("serving %s on http://%s:%d", config.served_model_name, config.args.host, config.args.port)
    asyncio.run(run())


async def _exit_when_engine_dies(server: Server, http) -> None:
    while server.engines_alive():
        await asyncio.sleep(1.0)
    logger.error("an engine process exited; shutting the server down")
    server.engine_failed = True
    http.request_stop()


def main(argv: list[str] | None = None) -> int:
    setup_logging("api", 0)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        args = parse_args(argv)
        config = build_engine_config(args)
        check_port_free(args.host, args.port)
    except (ConfigError, LaunchError) as exc:
        logger.error("%s", exc)
        return 2
    server = Server(config)
    try:
        server.start_engines()
        server.wait_engines_ready()
        serve_http(server, config)
    except KeyboardInterrupt:
        logger.info("interrupted; shutting down")
    except LaunchError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        server.close()
        logger.info("stopped")
    return 1 if server.engine_failed else 0


if __name__ == "__main__":
    sys.exit(main())
