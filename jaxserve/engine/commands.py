"""The commands the asyncio side sends the AsyncEngine's loop thread: one dataclass each, so
the loop matches on their types (vLLM's engine-core request types play this part). Those that
answer carry a future the loop resolves; the others are fire-and-forget."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Wake:
    """Nothing to do: wakes an idle loop (shutdown)."""


@dataclasses.dataclass(frozen=True)
class Abort:
    """Abort these requests of a group, and drop its backlog."""
    group: Any  # request_group.RequestGroup
    request_ids: list[str]


@dataclasses.dataclass(frozen=True)
class FailAll:
    """Fail every live request with EngineDead(reason)."""
    reason: str


@dataclasses.dataclass(frozen=True)
class Call:
    """Run fn(engine) on the loop thread; the future holds its result or its exception."""
    fn: Callable[[Any], Any]
    future: concurrent.futures.Future


@dataclasses.dataclass(frozen=True)
class Add:
    """Queue a group's prompts (one SamplingParams); the future is set once they are taken
    (None) or refused (the exception)."""
    group: Any  # request_group.RequestGroup
    prompts: list[dict]
    params: Any  # SamplingParams
    cache_salt: str | None
    future: concurrent.futures.Future


Command = Wake | Abort | FailAll | Call | Add
Answered = (Call, Add)  # the commands that carry a future
