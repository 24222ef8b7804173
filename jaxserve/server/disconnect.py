"""A non-streaming request's wait: its work's result, unless the client goes away first (the
generation and pooling endpoints alike)."""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine

from fastapi import Request


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(work: Coroutine, request: Request, group) -> asyncio.Future | None:
    """Run `work` until it finishes or the client disconnects, whichever is first; `group`'s
    unfinished requests (engine RequestGroup) are aborted either way. Returns the finished
    future (its result or its exception), None when the client went away first."""
    done: asyncio.Future[Any] = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({done, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not done.done():
            done.cancel()
        group.abort()
    return None if not done.done() or done.cancelled() else done
