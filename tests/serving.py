"""Serve an ASGI app on a free loopback port in a thread, for tests, and read what the OpenAI
client streams back from it."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn


@contextlib.contextmanager
def serve_app(app, **options):
    """Yields the base URL while uvicorn serves `app` on 127.0.0.1; options: uvicorn.Config's."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    options = {"log_level": "warning", "timeout_graceful_shutdown": 2, **options}
    server = uvicorn.Server(uvicorn.Config(app, **options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def read_chat_stream(stream) -> tuple[str, list[tuple[str, str]], str | None]:
    """An OpenAI client's chat stream put together: (content, [(tool name, arguments)],
    finish_reason). A call's first delta (the one with its id) must come at the next index,
    typed "function"; later deltas add to its arguments."""
    content, calls, finish = "", [], None
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            if call.id is not None:
                assert call.index == len(calls) and call.type == "function"
                calls.append([call.function.name, ""])
            calls[call.index][1] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(c) for c in calls], finish
