"""Warm-up compiles ahead of time in threads (runtime/precompile.py); in the background, the
engine is ready once its smallest steps are in, and a step whose shape is still queued or
compiling waits for that one compile (nothing compiles twice). On the tiny random model."""

from __future__ import annotations

import threading
import time

import pytest

from jaxserve.config import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine import LLMEngine
from jaxserve.engine.startup import compile_events
from jaxserve.runtime.precompile import Precompiler
from jaxserve.runtime.runner import release_compiled_steps
from jaxserve.server import AsyncEngine
from tiny_model import tiny_loaded

# cpu packs every chunk: the default warm-up covers every shape traffic can meet
OPTIONS = dict(num_pages=64, max_num_seqs=2, max_num_batched_tokens=16, page_size=8,
               attention_backend="cpu")
PROMPTS = [[5, 6, 7], list(range(10, 34))]


def test_a_job_needed_while_a_thread_compiles_it_is_waited_for():
    started, gate, calls, done = threading.Event(), threading.Event(), [], []

    def compile_fn():
        calls.append(threading.current_thread().name)
        started.set()
        gate.wait(10)
        return "executable"

    pool = Precompiler(1, lambda key, name, seconds: done.append(key))
    assert pool.submit("a", "a", compile_fn)
    assert not pool.submit("a", "a", compile_fn)  # a key compiles once
    assert started.wait(10)
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.wait("a")))
    waiter.start()
    time.sleep(0.2)
    assert got == [] and pool.pending() == 1  # waiting for the thread's compile
    gate.set()
    waiter.join(10)
    assert got == ["executable"] and calls == ["jaxserve-compile"] and done == ["a"]
    assert pool.pending() == 0 and pool.wait("never submitted") is None


def test_without_threads_the_caller_runs_a_queued_job_and_gets_its_error():
    pool = Precompiler(0, lambda *_: None)
    ran = []
    pool.submit("b", "b", lambda: ran.append(threading.current_thread()) or 7)

    def fail():
        raise RuntimeError("compile failed")

    pool.submit("c", "c", fail)
    time.sleep(0.1)
    assert ran == [] and pool.pending() == 2
    assert pool.wait("b") == 7 and ran == [threading.current_thread()]
    with pytest.raises(RuntimeError, match="compile failed"):
        pool.wait("c")


def test_stop_waits_for_the_running_compile_and_starts_no_other():
    """At exit no thread may still be compiling (XLA aborts the process mid-teardown)."""
    started, gate, ran = threading.Event(), threading.Event(), []

    def slow():
        started.set()
        gate.wait(10)
        ran.append("slow")

    pool = Precompiler(1, lambda *_: None)
    pool.submit("slow", "slow", slow)
    pool.submit("next", "next", lambda: ran.append("next"))
    assert started.wait(10)
    stopper = threading.Thread(target=pool.stop)
    stopper.start()
    time.sleep(0.2)
    assert stopper.is_alive()  # waits for the compile under way
    gate.set()
    stopper.join(10)
    assert not stopper.is_alive() and ran == ["slow"]
    assert pool.wait("next") is None and ran == ["slow", "next"]  # a caller still runs it


def greedy(engine: LLMEngine) -> list[list[int]]:
    for prompt in PROMPTS:
        engine.add_request({"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    return [outputs[k] for k in sorted(outputs)]


def test_shapes_left_to_the_background_compile_once_when_a_step_needs_them():
    reference = LLMEngine(EngineConfig.from_options(**OPTIONS), tiny_loaded())
    everything = reference.warmup()
    assert everything["compilations_pending"] == 0
    expected = greedy(reference)
    release_compiled_steps()  # the next engine's jitted step starts empty

    # compile_threads=0: what is left waits for the step that needs it (deterministic here)
    engine = LLMEngine(EngineConfig.from_options(**OPTIONS), tiny_loaded())
    report = engine.warmup(background=True, compile_threads=0)
    pending = report["compilations_pending"]
    assert pending > 0 and report["compilations"] + pending == everything["compilations"]
    assert engine.stats()["compilations"] == report["compilations"]
    before = compile_events().snapshot()[0]
    assert greedy(engine) == expected
    stats = engine.stats()
    done = pending - stats["compilations_pending"]
    assert done > 0  # the steps needed shapes left to the background
    # each compiled once: one XLA compile (or cache load) per shape, none in the steps' calls
    assert compile_events().snapshot()[0] - before == done
    assert stats["compilations"] == report["compilations"] + done


def test_ready_before_every_shape_is_compiled():
    engine = LLMEngine(EngineConfig.from_options(**OPTIONS), tiny_loaded())
    aengine = AsyncEngine(engine)
    try:
        report = aengine.warm_up(compile_threads=0).result(timeout=300)
        assert aengine.readiness() is None
        assert report["compilations_pending"] == engine.stats()["compilations_pending"] > 0
        # only the one-token step and its sampling calls (3 modes, with and without controls)
        assert report["shapes"] == len(engine.buckets.tokens) + len(engine.buckets.copies)
        assert report["compilations"] == 1 + 6
    finally:
        aengine.shutdown()


def test_a_full_warm_up_leaves_no_sampling_call_to_compile_on_a_request():
    """Top logprobs counts, penalties and logit_bias each compiled their sampling call on first
    use, in the step: every stream froze one to three seconds (the long fuzz's neighbour).
    After warmup(full=True) a request of each compiles nothing (penalties over longer texts
    still compile their larger entry bucket on first use)."""
    engine = LLMEngine(EngineConfig.from_options(**OPTIONS), tiny_loaded())
    engine.warmup(full=True)
    before = engine.compilations
    kinds = [dict(temperature=0, logprobs=0), dict(temperature=0.7, logprobs=3),
             dict(temperature=0.7, top_k=5, logprobs=20), dict(temperature=0, logit_bias={7: 5}),
             dict(temperature=0.7, presence_penalty=0.5, logprobs=1),
             dict(temperature=0.7, top_p=0.9, repetition_penalty=1.2, logit_bias={3: -100},
                  logprobs=5)]
    for i, kind in enumerate(kinds):
        for prompt in ([5, 6, 7], [8, 9]):  # one row, then two; penalties' entries: 16 at most
            engine.add_request({"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=3, seed=i, **kind))
        while engine.has_unfinished():
            engine.step()
    assert engine.compilations == before
