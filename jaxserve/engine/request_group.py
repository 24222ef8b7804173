"""RequestGroup: the asyncio side of one API call's engine requests (AsyncEngine.add): it
async-iterates the (prompt index, RequestOutput) pairs the engine loop posts to it, and aborts
what is unfinished when its handler stops listening. Its backlog (the prompts not yet in the
engine) belongs to the loop thread."""

from __future__ import annotations

import asyncio
import collections

from jaxserve.core.outputs import RequestOutput
from jaxserve.engine.commands import Abort


class RequestGroup:
    """The engine requests of one API call; async-iterates (prompt index, RequestOutput)."""

    def __init__(self, engine, group_id: str, size: int):
        """engine: the AsyncEngine, whose loop thread the group's aborts go to."""
        self.engine = engine
        self.id = group_id
        self.size = size
        self.request_ids = [f"{group_id}-{i}" for i in range(size)]
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.unfinished = set(self.request_ids)
        self.backlog: collections.deque = collections.deque()  # loop thread: (index, prompt)
        self.params, self.cache_salt = None, None  # the backlog's, set by AsyncEngine._add

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self.unfinished and self.queue.empty():
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.unfinished.clear()
            raise item
        index, out = item
        if out.finished:
            self.unfinished.discard(out.request_id)
        return index, out

    def abort(self) -> None:
        """Abort every unfinished request of the group (safe to call more than once)."""
        if self.unfinished:
            self.engine._submit(Abort(self, list(self.unfinished)))
            self.unfinished.clear()

    def _deliver(self, item) -> None:  # called on the asyncio loop
        self.queue.put_nowait(item)
