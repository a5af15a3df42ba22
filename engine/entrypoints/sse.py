"""Server-sent events responses of the API server.

Owns: ``SSEResponse``, the streaming response that stops as soon as the client leaves and closes
its event generator at once, so the generator's clean-up (the engine abort) runs now.
The event framing itself (``sse_event``, ``SSE_DONE``) is in ``protocol``.
"""
from __future__ import annotations

import logging
from typing import Awaitable, Callable

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)


class SSEResponse(StreamingResponse):
    """A streaming response that stops (and closes its generator) as soon as the client leaves.

    Starlette only watches for disconnects under some ASGI spec versions; here it is always
    done, and the event generator is closed explicitly so its ``finally`` (engine abort) runs
    now rather than whenever the generator is garbage-collected.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as task_group:
                async def run_then_stop(func: Callable[[], Awaitable[None]]) -> None:
                    await func()
                    task_group.cancel_scope.cancel()

                task_group.start_soon(run_then_stop, lambda: self.stream_response(send))
                task_group.start_soon(run_then_stop, lambda: self.listen_for_disconnect(receive))
        except OSError:
            logger.info("client disconnected while a response was streamed")
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
