"""The router's command line and process: ``python -m router --prefill URL... --decode URL... [--mixed URL...]``.

Owns argument parsing and checking (bad arguments: one ``router: error: ...`` line, exit code 2, like
launch.py; a busy port too), and the process: one httpx client for every backend call, a first health check
of every backend before serving, the periodic checks, uvicorn, and the stop on SIGINT/SIGTERM (a graceful
stop; a second signal forces it). Exit code 0 after a stop.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from urllib.parse import urlsplit

import httpx

import envs
from config.log import setup_logging
from engine.entrypoints.http_server import create_server
from router.app import build_app
from router.backends import Backend, BackendPool, HealthChecker, Role
from router.metrics import RouterMetrics

logger = logging.getLogger("router")


def backend_url(text: str) -> str:
    """``http://host:port`` from ``host:port`` or a URL; argparse's type for backend flags."""
    url = text if "://" in text else "http://" + text
    parts = urlsplit(url.rstrip("/"))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) URL or host:port")
    try:
        port = parts.port
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} has an invalid port") from None
    if parts.path or parts.query:
        raise argparse.ArgumentTypeError(f"{text!r}: give the server's base URL, without a path")
    return f"{parts.scheme}://{parts.hostname}" + (f":{port}" if port else "")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="router", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="OpenAI-compatible router in front of fdserve instances: P/D (prefill then decode) and/or "
                    "least-loaded mixed instances.")
    for role in ("prefill", "decode", "mixed"):
        parser.add_argument(f"--{role}", type=backend_url, nargs="+", action="extend", default=[], metavar="URL",
                            help=f"base URL(s) of launch.py instances started with --splitwise-role {role}")
    parser.add_argument("--host", default="127.0.0.1", help="address the router binds")
    parser.add_argument("--port", type=int, default=8000, help="the router's HTTP port")
    parser.add_argument("--health-interval", type=float, default=2.0, help="seconds between health checks")
    parser.add_argument("--health-timeout", type=float, default=5.0, help="seconds one GET /health may take")
    parser.add_argument("--unhealthy-after", type=int, default=3,
                        help="timed-out health checks in a row that take a backend out (a refusal or an error "
                             "status takes it out at once)")
    parser.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect to a backend")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds a backend may stay silent during a request (between streamed chunks)")
    parser.add_argument("--max-request-bytes", type=int, default=None,
                        help="largest accepted request body (default: FD_MAX_REQUEST_BYTES)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prefill and not args.decode:
        parser.error("--prefill needs at least one --decode backend")
    if not (args.decode or args.mixed):
        parser.error("give at least one --decode (with --prefill) or --mixed backend")
    urls = args.prefill + args.decode + args.mixed
    duplicates = sorted({u for u in urls if urls.count(u) > 1})
    if duplicates:
        parser.error(f"backend URL(s) given twice: {', '.join(duplicates)}")
    if not 1 <= args.port <= 65535:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    for flag in ("health_interval", "health_timeout", "connect_timeout", "request_timeout"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.unhealthy_after < 1:
        parser.error(f"--unhealthy-after must be >= 1, got {args.unhealthy_after}")
    if args.max_request_bytes is None:
        args.max_request_bytes = envs.FD_MAX_REQUEST_BYTES
    if not _port_free(args.host, args.port):
        parser.error(f"--port {args.port} on {args.host} is in use")
    return args


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def build_pool(args: argparse.Namespace) -> BackendPool:
    return BackendPool([Backend(url, role) for role in Role for url in getattr(args, role.value)])


async def serve(args: argparse.Namespace) -> None:
    """Serve until SIGINT/SIGTERM."""
    pool = build_pool(args)
    metrics = RouterMetrics(pool)
    # No connection cap: every client request holds one backend connection for its whole answer. Idle
    # connections are dropped after 2 s, before uvicorn closes them (its keep-alive timeout is 5 s): a request
    # sent on a connection the server is closing fails with "Server disconnected" before reaching it.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=2.0)
    timeout = httpx.Timeout(args.request_timeout, connect=args.connect_timeout)
    # Health checks use a fresh connection each (same race, and a check must not queue behind requests).
    health_limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client, \
            httpx.AsyncClient(limits=health_limits) as health_client:
        checker = HealthChecker(pool, health_client, args.health_interval, args.health_timeout,
                                args.unhealthy_after)
        await checker.check_all()
        checker.start()
        server = create_server(build_app(pool, client, metrics, args.max_request_bytes), args.host, args.port,
                               handle_signals=False)
        loop = asyncio.get_running_loop()

        def on_signal(signum: int) -> None:
            if server.should_exit:
                logger.warning("second %s: forcing the stop", signal.Signals(signum).name)
                server.force_exit = True
            else:
                logger.info("%s: stopping (requests in flight get up to 5 s)", signal.Signals(signum).name)
                server.request_stop()

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, on_signal, signum)
        logger.info("router on http://%s:%d: %s", args.host, args.port,
                    ", ".join(f"{b.role.value} {b.url}" for b in pool.backends))
        try:
            await server.serve()
        finally:
            await checker.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging("router")
    # httpx logs every backend call (health checks included) at INFO.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    asyncio.run(serve(args))
    logger.info("router stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
