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


class Server:
    """The processes and shared resources of one running instance; ``close`` releases them all."""

    def __init__(self, config: EngineConfig) -> None:
        from engine.engine_process import EngineAddresses
        from inter_communicator.instance_signals import InstanceSignals
        from inter_communicator.shm import sweep_stale

        self.config = config
        removed = sweep_stale(config.instance_id)
        if removed:
            logger.warning("removed %d stale shared-memory names of instance %s", len(removed), config.instance_id)
        config.ipc_dir = ipc_dir_for(config.instance_id)
        shutil.rmtree(config.ipc_dir, ignore_errors=True)
        os.makedirs(config.ipc_dir, mode=0o700)
        self.addresses = EngineAddresses.in_dir(config.ipc_dir, config.dp_rank)
        self.signals = InstanceSignals(config, create=True)
        self.kvcache_lock = None
        if envs.FD_USE_KVCACHE_LOCK:
            from inter_communicator.kvcache_lock import KVCacheLock

            self.kvcache_lock = KVCacheLock.create(config.instance_id, config.dp_rank, role="launch")
        self.engine_proc: multiprocessing.process.BaseProcess | None = None
        self.engine_failed = False

    def start_engine(self) -> None:
        from engine.engine_process import run_engine

        spawn = multiprocessing.get_context("spawn")
        self.engine_proc = spawn.Process(target=run_engine, name="fdserve-engine", args=(self.config, self.addresses))
        self.engine_proc.start()

    def engine_alive(self) -> bool:
        return self.engine_proc is not None and self.engine_proc.is_alive()

    def wait_engine_ready(self) -> None:
        while not self.signals.engine_ready.value[0]:
            if not self.engine_alive():
                raise LaunchError(f"the engine process exited during start-up (code {self.engine_proc.exitcode}); "
                                  "see the log above")
            time.sleep(0.1)

    def close(self) -> None:
        from inter_communicator.shm import sweep_stale

        self._stop_engine()
        self.signals.close()
        self.signals.unlink()
        if self.kvcache_lock is not None:
            self.kvcache_lock.close()
            self.kvcache_lock.unlink()
        leftovers = sweep_stale(self.config.instance_id)
        if leftovers:
            logger.info("removed %d shared-memory names left by child processes", len(leftovers))
        shutil.rmtree(self.config.ipc_dir, ignore_errors=True)

    def _stop_engine(self) -> None:
        proc = self.engine_proc
        if proc is None or proc.exitcode is not None:
            return
        proc.terminate()  # SIGTERM: the engine stops its workers, then exits
        proc.join(ENGINE_STOP_TIMEOUT_S)
        if proc.is_alive():
            logger.warning("engine did not stop in %.0f s; killing it", ENGINE_STOP_TIMEOUT_S)
            proc.kill()
            proc.join(2.0)
        for child in multiprocessing.active_children():
            child.kill()


def _raise_keyboard_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def serve_http(server: Server, config: EngineConfig) -> None:
    from engine.api_server import build_app, create_server
    from engine.engine_client import EngineClient
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.args.model)
    client = EngineClient(tokenizer, server.addresses.requests, server.addresses.outputs, server.signals,
                          server.engine_alive)
    app = build_app(client, served_model_name=config.served_model_name, max_model_len=config.max_model_len,
                    api_key=config.args.api_key or envs.FD_API_KEY, max_request_bytes=envs.FD_MAX_REQUEST_BYTES)
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
    while server.engine_alive():
        await asyncio.sleep(1.0)
    logger.error("the engine process exited (code %s); shutting the server down", server.engine_proc.exitcode)
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
        server.start_engine()
        server.wait_engine_ready()
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
