"""Readiness, limits and the socket, as orchestrators, careless operators and hostile clients
meet them (issue 54 rows 1, 11 and 14): /health/ready turns 503 when the engine loop stalls and
says how many shapes still compile (ready_after="all" waits for them); a body of too many
prompts, or of more than max_waiting, is a 400 naming the limit; a client that does not finish
sending its request within the read timeout gets 408 and its connection closed; the placeholder
served while the engine is built answers health. On the tiny random model."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
from fastapi import FastAPI

from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.server import AsyncEngine, ServerConfig, build_app
from jaxserve.server.health import StartingApp
from jaxserve.server.listen import read_timeout_protocol
from serving import serve_app
from tiny_model import tiny_loaded

httpx = pytest.importorskip("httpx")

MODEL = "tiny"
BODY = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def aengine():
    engine = LLMEngine(EngineConfig.from_options(num_pages=64, page_size=8, max_num_seqs=4,
                                                 max_num_batched_tokens=64,
                                                 attention_backend="xla"), tiny_loaded())
    aengine = AsyncEngine(engine)
    # no compile threads: the shapes past the first stay pending until a step needs them
    aengine.warm_up(compile_threads=0).result(timeout=300)
    yield aengine
    aengine.shutdown()


@pytest.fixture(scope="module")
def url(aengine):
    app = build_app(aengine, ServerConfig(served_model_names=(MODEL,), max_prompts_per_request=3))
    with serve_app(app) as url:
        yield url


def wait_for(check, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.05)


def test_ready_says_what_still_compiles_and_ready_after_all_waits_for_it(aengine, url):
    pending = aengine.compilations_pending
    assert pending > 0
    r = httpx.get(url + "/health/ready")
    assert r.status_code == 200 and r.json() == {"status": "ok", "compilations_pending": pending}
    aengine.ready_after = "all"
    try:
        r = httpx.get(url + "/health/ready")
        assert r.status_code == 503 and f"{pending} step shapes still compiling" in \
            r.json()["reason"] and r.json()["compilations_pending"] == pending
    finally:
        aengine.ready_after = "start"


def test_ready_turns_503_while_the_engine_loop_is_stuck(aengine, url):
    """Issue 54 row 1: an abort held the loop for 13 minutes while ready said 200."""
    release = threading.Event()
    saved, aengine.stall_timeout = aengine.stall_timeout, 0.3
    try:
        holder = threading.Thread(target=asyncio.run,  # a call that holds the loop
                                  args=(aengine.call(lambda engine: release.wait(60)),))
        holder.start()
        wait_for(lambda: httpx.get(url + "/health/ready").status_code == 503)
        body = httpx.get(url + "/health/ready").json()
        assert body["status"] == "unavailable" and body["reason"].startswith("stalled: the "
                                                                             "engine loop")
        assert httpx.get(url + "/health/live").status_code == 200  # alive, only stuck
        for path in ("/debug/stats", "/metrics"):  # read on the loop: a 503 at once, not a hang
            r = httpx.get(url + path, timeout=10)
            assert r.status_code == 503 and "stalled" in r.json()["error"]["message"], r.text
        release.set()
        wait_for(lambda: httpx.get(url + "/health/ready").status_code == 200)
    finally:
        release.set()
        aengine.stall_timeout = saved


def test_a_body_of_too_many_prompts_is_400_naming_the_limit(url):
    r = httpx.post(url + "/v1/completions", json={**BODY, "prompt": ["a"] * 4}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and "max_prompts_per_request=3" in error["message"]
    r = httpx.post(url + "/v1/completions", json={**BODY, "prompt": [5] * 40}, timeout=60)
    assert r.status_code == 200, r.text  # token ids: one prompt
    r = httpx.post(url + "/v1/completions", json={**BODY, "prompt": ["a", "b", "c"]}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 3


def test_more_prompts_than_may_ever_wait_is_400_and_a_full_queue_503(aengine, url):
    """Issue 54 row 11: with max_waiting=2 a request of 3 prompts can never be queued (it was
    a 503 "retry later"); 2 prompts behind 1 waiting (in a group's backlog) are a 503."""
    from jaxserve.core.sampling_params import SamplingParams

    saved = aengine.max_waiting, aengine.group_quota
    aengine.max_waiting, aengine.group_quota = 2, 1
    group = None
    try:
        r = httpx.post(url + "/v1/completions", json={**BODY, "prompt": ["a", "b", "c"]},
                       timeout=60)
        assert r.status_code == 400 and "max_waiting=2" in r.json()["error"]["message"], r.text
        long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        group = asyncio.run(aengine.add([{"prompt_token_ids": [5, 6], "prompt": None}] * 2,
                                        long))  # one runs for 200 steps, one waits behind it
        r = httpx.post(url + "/v1/completions", json={**BODY, "prompt": ["a", "b"]}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
        assert "1 requests are waiting" in r.json()["error"]["message"]
        assert r.headers["retry-after"]
    finally:
        if group is not None:
            group.abort()
        aengine.max_waiting, aengine.group_quota = saved


def _exchange(port: int, data: bytes, hold: float = 0.0) -> bytes:
    """Send `data`, then read until the server closes (10 s at most)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_a_request_not_sent_within_the_read_timeout_gets_408_and_is_closed(aengine, caplog):
    """Issue 54 row 14: a connection holding half its headers (or body) was held for good."""
    app = build_app(aengine, ServerConfig(served_model_names=(MODEL,)))
    with serve_app(app, http=read_timeout_protocol(0.5), timeout_keep_alive=60) as url:
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps({**BODY, "max_tokens": 1}).encode()
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body))
        for data in (b"", head, head + b"\r\n" + body[:10]):
            answer = _exchange(port, data)
            assert answer.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in answer, answer
        # whole requests in time are answered, two on one connection; a third sent by half
        # then times out in its turn
        answers = _exchange(port, (head + b"\r\n" + body) * 2 + head).split(b"HTTP/1.1 ")[1:]
        assert [a[:3] for a in answers] == [b"200", b"200", b"408"], answers
    # a body cut off by the timeout is no server error
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_the_placeholder_answers_health_until_the_app_is_handed_over(url):
    front = StartingApp()
    with serve_app(front, lifespan="off") as front_url:
        assert httpx.get(front_url + "/health/live").status_code == 200
        r = httpx.get(front_url + "/health/ready")
        assert r.status_code == 503 and r.json()["reason"].startswith("starting")
        r = httpx.post(front_url + "/v1/completions", json=BODY)
        assert r.status_code == 503 and r.json()["error"]["code"] == "starting"
        front.failed("no such model")
        assert "no such model" in httpx.get(front_url + "/health").json()["reason"]
        front.serve(FastAPI())  # everything goes to the app now
        assert httpx.get(front_url + "/health/live").status_code == 404


def test_a_later_request_queues_behind_a_groups_quota_not_all_of_it(aengine):
    """Issue 54 row 1: a neighbour waited behind every prompt of a huge request. A group now
    has max_num_seqs (4) prompts in the engine at once; the rest follow as those finish."""
    from jaxserve.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, i + 7], "prompt": None} for i in range(24)]

    async def run():
        big = await aengine.add(prompts, params)
        small = await aengine.add(prompts[:1], params)
        order = []

        async def drain(group, name):
            async for _, out in group:
                if out.finished:
                    order.append(name)

        await asyncio.gather(drain(big, "big"), drain(small, "small"))
        # a group dropped with its backlog full leaves nothing behind
        dropped = await aengine.add(prompts, params)
        dropped.abort()
        return order

    order = asyncio.run(run())
    print(f"the neighbour finished after {order.index('small')} of the group's 24")
    assert order.count("big") == 24 and order.index("small") <= 8
    wait_for(lambda: aengine._backlogged == 0 and not asyncio.run(
        aengine.call(lambda e: e.has_unfinished())))
