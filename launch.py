"""Start an fdserve server: ``python launch.py [--model PATH] [--port 8000] ...``.

The command line of the API server: it parses the arguments, builds the typed config, checks that
the port is free, starts the instance (``engine.entrypoints.server.Server``: the shared-memory
signals and one engine process per DP rank, which spawns the workers), waits until the model is
loaded, serves HTTP, and cleans up on every exit path. The engines are supervised while serving
(``engine.entrypoints.engine_supervisor``): a dead engine process is restarted like the engine
restarts a dead worker (same restart budget; beyond it that rank stays down and answers 503). On
SIGINT/SIGTERM it drains (new requests get 503, requests in flight get ``FD_SHUTDOWN_DRAIN_S`` to
finish, the rest end with an error), stops everything and removes every shared-memory segment,
semaphore and socket file of this instance. Exit codes: 0 stopped cleanly, 1 an engine failed
(at start-up, or a rank stayed down), 2 bad arguments or a busy port.

Bad arguments end with one line on stderr, ``launch.py: error: <what, naming the flag>``, and exit
code 2, never a traceback: argparse's own errors (not a number, unknown choice) and every check of
``config.engine_config.validate_args`` / ``build_engine_config`` (ranges, combinations, the model
files, the model's context, the memory for the KV cache) print the same way.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys

import envs
from config.engine_config import ConfigError, EngineArgs, build_engine_config
from config.log import setup_logging
from engine.entrypoints.engine_supervisor import LaunchError, become_subreaper
from engine.entrypoints.server import Server, serve_http

logger = logging.getLogger("launch")


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" after each flag's help unless the text already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse's exit code 2, but one line: the usage block of ~30 flags would bury the error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _prog() -> str:
    # "launch.py" for `python launch.py`, "fdserve" for the console script.
    name = os.path.basename(sys.argv[0])
    return name if name and not name.startswith("-") else "launch.py"


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(prog=_prog(), description="Serve an LLM over an OpenAI-compatible API.",
                                 formatter_class=_DefaultsHelpFormatter)
    return EngineArgs.add_cli_args(parser)


def parse_args(argv: list[str] | None = None) -> EngineArgs:
    return EngineArgs.from_cli_args(build_parser().parse_args(argv))


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise LaunchError(f"--host/--port: cannot bind {host}:{port}: {exc.strerror}") from exc


def _raise_keyboard_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        setup_logging("api", 0)  # a ValueError if FD_LOG_LEVEL is not a level
        args = parse_args(argv)
        envs.check_all()  # a ValueError naming the variable
        config = build_engine_config(args)
        check_port_free(args.host, args.port)
    except (ConfigError, LaunchError, ValueError) as exc:
        print(f"{_prog()}: error: {exc}", file=sys.stderr)
        return 2
    become_subreaper()
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
    return 1 if server.any_rank_down() else 0


if __name__ == "__main__":
    sys.exit(main())
