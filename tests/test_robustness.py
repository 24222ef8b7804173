"""No request can hurt another through the offline API: bad input is refused before anything is
queued, a request whose own row fails (batch building, output processing) fails alone, a failed
device step fails the requests whose KV it held and the engine goes on with a fresh pool; after
every case the engine holds no page and a normal greedy generation gives the same tokens.
Uses the tiny random model (tests/tiny_model.py)."""

from __future__ import annotations

import math

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from tiny_model import failing_on, tiny_loaded

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["the cat sat on", "hello world", "0123456789" * 3, "a"]


@pytest.fixture(scope="module")
def llm():
    engine = LLMEngine(EngineConfig.from_options(num_pages=64, page_size=8, max_num_seqs=2,
                                                 max_num_batched_tokens=64,
                                                 attention_backend="xla"), tiny_loaded())
    return LLM.from_engine(engine)


@pytest.fixture(scope="module")
def reference(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def assert_clean_and_working(llm, reference):
    stats = llm.stats()
    assert not llm.engine.has_unfinished()
    assert stats["referenced_pages"] == 0 and stats["running"] == stats["waiting"] == 0
    llm.engine.scheduler.check_invariants()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def run_to_end(engine, max_steps: int = 500) -> dict:
    """Step until nothing is unfinished (a bounded number of steps: no hang); the final
    RequestOutput of each request by id."""
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return finals
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    raise AssertionError(f"the engine did not finish in {max_steps} steps")


BAD_PARAMS = [dict(top_k=2**31), dict(top_k=2**63), dict(temperature=math.nan),
              dict(top_p=math.nan), dict(min_p=math.nan), dict(temperature=math.inf),
              dict(max_tokens=2**31), dict(n=0), dict(n=True), dict(logprobs=21),
              dict(seed=2**64), dict(stop=["a\ud800"]), dict(stop_token_ids=[-1]),
              dict(priority=2**40), dict(top_p=0.0), dict(min_p=1.5)]


@pytest.mark.parametrize("bad", BAD_PARAMS, ids=[str(b) for b in BAD_PARAMS])
def test_bad_sampling_params_are_refused_and_nothing_sticks(llm, reference, bad):
    with pytest.raises(ValueError):
        llm.generate(PROMPTS[:2], SamplingParams(**bad))
    assert_clean_and_working(llm, reference)


BAD_PROMPTS = [{"prompt_token_ids": [1.7, 2.2]}, {"prompt_token_ids": [True, 2]},
               {"prompt_token_ids": [5, 10**6]}, {"prompt_token_ids": [-1]}, [1.5, 2],
               "a\ud800b", {"prompt": "x\udfff"}, {"prompt_token_ids": "12"}]


@pytest.mark.parametrize("bad", BAD_PROMPTS, ids=[repr(b) for b in BAD_PROMPTS])
def test_bad_prompts_are_refused_and_nothing_sticks(llm, reference, bad):
    with pytest.raises((ValueError, TypeError)):
        llm.generate([PROMPTS[0], bad], GREEDY)
    assert_clean_and_working(llm, reference)


@pytest.mark.parametrize("key", [" 12 ", "1_0", "\u0661\u0662", "-1", "0x1"])
def test_logit_bias_keys_are_ascii_decimal_token_ids(llm, reference, key):
    """Python's int() takes all of these; a token id is written in ASCII decimal digits."""
    with pytest.raises(ValueError, match="logit_bias keys must be token ids") as e:
        llm.generate(PROMPTS[:1], SamplingParams(logit_bias={key: 5.0}))
    assert e.value.param == "logit_bias"
    assert_clean_and_working(llm, reference)


def test_max_tokens_past_the_context_is_refused_as_the_server_does(llm, reference):
    """max_tokens=10**6 used to run to the context's end (minutes on the real model)."""
    limit = llm.engine.max_model_len
    with pytest.raises(ValueError, match=rf"prompt 1: .* exceed max_model_len {limit}"):
        llm.generate(PROMPTS[:2], [GREEDY, SamplingParams(max_tokens=10**6)])
    assert_clean_and_working(llm, reference)


def test_a_parameter_that_is_not_sampling_params_names_its_index(llm, reference):
    with pytest.raises(TypeError, match=r"sampling_params\[1\] is NoneType"):
        llm.generate(PROMPTS[:2], [GREEDY, None])
    assert_clean_and_working(llm, reference)


@pytest.mark.parametrize("params", [
    dict(structured_outputs={"choice": ["yes", "no"]}),
    dict(repetition_penalty=1e-38),
], ids=["grammar", "tiny-repetition-penalty"])
def test_logprobs_are_finite_and_masked_tokens_leave_the_top_lists(llm, params):
    """A grammar masks all but a few tokens: top_logprobs=20 used to list masked tokens at -inf
    (and a repetition penalty of 1e-38 overflowed logits to NaN logprobs), which no JSON holds."""
    sp = SamplingParams(temperature=0, max_tokens=4, logprobs=20, prompt_logprobs=5, **params)
    out = llm.generate(PROMPTS[:1], sp)[0]
    entries = out.outputs[0].logprobs + [e for e in out.prompt_logprobs if e is not None]
    assert entries and all(math.isfinite(lp) for e in entries for lp in e.values())
    assert math.isfinite(out.outputs[0].cumulative_logprob)
    if "structured_outputs" in params:  # only tokens the grammar allows are listed
        assert all(len(e) < 20 for e in out.outputs[0].logprobs)


def test_invalid_unicode_in_chat_is_refused(llm, reference):
    with pytest.raises(ValueError, match="not valid Unicode"):
        llm.chat([{"role": "user", "content": "hi \ud800"}], GREEDY)
    assert_clean_and_working(llm, reference)


def test_a_top_p_that_masks_everything_keeps_the_top_token(llm, reference):
    """top_p = 1e-40 is flushed to 0 in float32: without the guard every token was masked and
    token 0 came out forever. The top token always stays, so this samples greedily."""
    tiny = SamplingParams(temperature=1.0, top_p=1e-40, max_tokens=12, ignore_eos=True, seed=3)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, tiny)]
    assert got == reference
    low = SamplingParams(temperature=1.0, min_p=1.0, max_tokens=12, ignore_eos=True, seed=3)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, low)] == reference


def test_a_row_that_cannot_be_built_fails_alone(llm, reference):
    """A value that passed validation but breaks the batch builder (forced here past the
    validation) fails its request alone; the others finish with their usual tokens."""
    engine = llm.engine
    requests = [engine.add_request(p, GREEDY) for p in PROMPTS]
    requests[1].sampling_params.top_k = 2**40  # overflows the int32 top_k array
    finals = run_to_end(engine)
    bad = finals[requests[1].request_id]
    assert bad.error and "building its batch row failed" in bad.error
    assert bad.outputs[0].finish_reason == "error"
    for i in (0, 2, 3):
        assert finals[requests[i].request_id].outputs[0].token_ids == reference[i]
        assert finals[requests[i].request_id].error is None
    assert engine.stats()["num_failed_total"] >= 1
    assert_clean_and_working(llm, reference)


def test_a_row_whose_output_cannot_be_processed_fails_alone(llm, reference, monkeypatch):
    engine = llm.engine
    real = engine.outputs._process_row

    def broken(seq, row, out, now):
        if seq.request.request_id == victim:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(seq, row, out, now)

    monkeypatch.setattr(engine.outputs, "_process_row", broken)
    requests = [engine.add_request(p, GREEDY) for p in PROMPTS]
    victim = requests[2].request_id
    finals = run_to_end(engine)
    assert "processing its output failed" in finals[victim].error
    for i in (0, 1, 3):
        assert finals[requests[i].request_id].outputs[0].token_ids == reference[i]
    monkeypatch.undo()
    assert_clean_and_working(llm, reference)


@pytest.mark.parametrize("where", ["dispatch", "fetch"])
def test_a_failed_device_step_fails_its_requests_and_the_engine_recovers(
        llm, reference, monkeypatch, where):
    """The step had the pool donated, so the running requests fail with the cause; the engine
    starts a fresh pool, empties the prefix cache, and serves the next requests exactly."""
    engine = llm.engine
    monkeypatch.setattr(engine.runner, where, failing_on(
        3, getattr(engine.runner, where), RuntimeError("injected device failure")))
    requests = [engine.add_request(p, GREEDY) for p in PROMPTS]
    finals = run_to_end(engine)
    failed = [r for r in requests if finals[r.request_id].error]
    assert failed and all("injected device failure" in finals[r.request_id].error
                          for r in failed)
    for i, r in enumerate(requests):  # the others (not yet admitted) finished normally
        if finals[r.request_id].error is None:
            assert finals[r.request_id].outputs[0].token_ids == reference[i]
    monkeypatch.undo()
    assert_clean_and_working(llm, reference)


def test_an_interrupted_generate_leaves_nothing_behind(llm, reference, monkeypatch):
    """KeyboardInterrupt (or any exception) inside generate() aborts that call's requests."""
    engine = llm.engine
    monkeypatch.setattr(engine, "step", failing_on(2, engine.step, KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY)
    monkeypatch.undo()
    assert_clean_and_working(llm, reference)


def test_prompt_logprobs_that_cannot_be_recorded_fail_alone(llm, reference, monkeypatch):
    from jaxserve.core import output_processor

    real = output_processor._record_chunk_prompt_logprobs

    def broken(chunk, first, k, out):
        if chunk.seq.request.request_id == victim:
            raise IndexError("injected")
        return real(chunk, first, k, out)

    monkeypatch.setattr(output_processor, "_record_chunk_prompt_logprobs", broken)
    engine = llm.engine
    scoring = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=2)
    requests = [engine.add_request(p, scoring) for p in PROMPTS]
    victim = requests[0].request_id
    finals = run_to_end(engine)
    assert "recording its prompt logprobs failed" in finals[victim].error
    for i in (1, 2, 3):
        out = finals[requests[i].request_id]
        assert out.error is None and out.outputs[0].token_ids == reference[i]
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    monkeypatch.undo()
    assert_clean_and_working(llm, reference)


def test_a_max_model_len_past_the_models_context_is_capped_with_a_warning(caplog):
    """--max_model_len=100000 on a model of 8192 positions became 8192 without a word."""
    from jaxserve.config.resolved import ResolvedConfig

    model = tiny_loaded().config  # 256 positions
    config = EngineConfig.from_options(max_model_len=1000, attention_backend="xla")
    with caplog.at_level("WARNING", logger="jaxserve.engine"):
        resolved = ResolvedConfig.of(config, model, dtype="float32", backend="xla",
                                     attention_cost=1.0)
    assert resolved.max_model_len == 256
    (record,) = [r for r in caplog.records if "max_model_len" in r.getMessage()]
    assert "max_model_len=1000" in record.getMessage() and "capped to 256" in record.getMessage()
    caplog.clear()
    ResolvedConfig.of(EngineConfig.from_options(max_model_len=200, attention_backend="xla"),
                      model, dtype="float32", backend="xla", attention_cost=1.0)
    assert not caplog.records
