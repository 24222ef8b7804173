"""What tool_choice "auto"'s grammar costs per decode step (server/tool_grammar.py: free text,
then a call constrained once it opens), on the default model's tokenizer and model.

  python scripts/bench_tool_grammar.py                      # mask timings and the decode runs
  python scripts/bench_tool_grammar.py --decode_rounds=0    # mask timings only

  python scripts/bench_tool_grammar.py --formats=pythonic  # one tool-call format

1. Mask time per step: the engine's own fill_masks (llguidance, MASK_THREADS threads) for 1 and
   8 rows, step by step along a typical answer of each format (hermes: text, a call, text;
   pythonic: a text answer, and a call list, which is the whole answer when it calls), split
   into the steps in free text and inside the call; beside it the same call under a forced
   tool_choice ("required") grammar and unconstrained decoding (no mask: 0).
2. Time per output token of whole requests (LLM.generate, the chat prompt with the tools
   rendered in, temperature 0.8, fixed seeds, ignore_eos) with each format's tool grammar and
   without, interleaved rounds at each concurrency. The model mostly writes text under the
   formats' own grammars, so those runs weigh the free-text masks; "py call" is the pythonic
   grammar without its text alternative, so every step after the first is inside a call (a
   request ends when its call list closes, before max_tokens).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
import types

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Model.")
flags.DEFINE_integer("repeats", 5, "Passes over the answer for the mask timings.")
flags.DEFINE_integer("decode_rounds", 2, "Interleaved rounds of whole requests (0: none).")
flags.DEFINE_list("concurrency", ["1", "8"], "Requests at once in the decode runs.")
flags.DEFINE_integer("max_tokens", 64, "Tokens per request in the decode runs.")
flags.DEFINE_list("formats", ["hermes", "pythonic"], "Tool-call formats (--tool_call_parser).")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
         "days": {"type": "integer", "minimum": 1, "maximum": 14}},
         "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"},
                                         "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["query"]}}}]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}'
ANSWER = f"Let me look that up for you.\n<tool_call>\n{CALL}\n</tool_call>\nOne moment."
PY_CALL = '[get_weather(city="Paris", unit="celsius", days=3), search(query="rain", tags=["eu"])]'
PY_TEXT = "Let me look that up for you. It will be sunny in Paris for the next three days."
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


def _answers(fmt: str, tok) -> list[tuple[list[int], list[bool]]]:
    """(tokens, which steps are inside the call) of the format's typical answers."""
    if fmt == "pythonic":
        return [(tok.encode(PY_TEXT, add_special_tokens=False), None),
                (tok.encode(PY_CALL, add_special_tokens=False), None)]
    tokens = tok.encode(ANSWER, add_special_tokens=False)
    # which steps are inside the call: from the token after the trigger to </tool_call>
    starts = [len(tok.decode(tokens[:i])) for i in range(len(tokens) + 1)]
    opened, closed = ANSWER.index("<tool_call>") + len("<tool_call>"), ANSWER.index("</tool_call>")
    return [(tokens, [opened <= starts[i] < closed + len("</tool_call>")
                      for i in range(len(tokens))])]


def _spec(ctx, **body):
    from jaxserve.server.protocol import parse_request

    parsed = parse_request("chat", {"messages": MESSAGES, "tools": TOOLS, **body}, ctx)
    return parsed.params.structured_outputs, parsed.prompts[0]["prompt_token_ids"]


def mask_times(compiler, spec, tokens: list[int], rows: int, repeats: int) -> list[float]:
    """Seconds of fill_masks for `rows` sequences in the state before each token (min over
    repeats)."""
    import numpy as np

    from jaxserve.core.structured_output import bitmask_words, fill_masks

    proto = compiler.compile(spec)
    best = [float("inf")] * len(tokens)
    mask = np.full((rows, bitmask_words(compiler.vocab_size)), -1, np.int32)
    for _ in range(repeats):
        seqs = [types.SimpleNamespace(request=types.SimpleNamespace(grammar=proto),
                                      matcher=None, output_token_ids=[]) for _ in range(rows)]
        for i, token in enumerate(tokens):
            t0 = time.perf_counter()
            fill_masks([(r, seq, []) for r, seq in enumerate(seqs)], mask)
            best[i] = min(best[i], time.perf_counter() - t0)
            for seq in seqs:
                assert seq.matcher.consume_token(token), "the answer does not fit the grammar"
    return best


def decode_run(llm, spec, prompt_ids, concurrency: int, seed: int) -> tuple[float, float]:
    """(mean time per output token after the first, mean output tokens) of `concurrency`
    requests at once."""
    from jaxserve import SamplingParams

    params = [SamplingParams(temperature=0.8, max_tokens=FLAGS.max_tokens, ignore_eos=True,
                             seed=seed + i, structured_outputs=spec)
              for i in range(concurrency)]
    outs = llm.generate([{"prompt_token_ids": prompt_ids}] * concurrency, params,
                        use_tqdm=False)
    return (statistics.mean((o.metrics.finished_time - o.metrics.first_token_time)
                            / max(len(o.outputs[0].token_ids) - 1, 1) for o in outs),
            statistics.mean(len(o.outputs[0].token_ids) for o in outs))


def _mean_ms(times: list[float]) -> str:
    return f"{1e3 * statistics.mean(times):.3f}" if times else "-"


def main(argv):
    del argv
    from jaxserve import LLM
    from jaxserve.config import EngineConfig
    from jaxserve.core.structured_output import MASK_THREADS, GrammarCompiler
    from jaxserve.engine import LLMEngine
    from jaxserve.server.protocol import ProtocolContext
    from jaxserve.weights import load_model

    loaded = load_model(FLAGS.model)
    tok, vocab = loaded.tokenizer, loaded.config.vocab_size
    compiler = GrammarCompiler(tok.backend.to_str(), vocab, list(tok.eos_token_ids))
    specs, prompts = {}, {}
    for fmt in FLAGS.formats:
        ctx = ProtocolContext(model_names=("m",), tokenizer=tok, max_model_len=8192,
                              vocab_size=vocab, tool_call_parser=fmt)
        specs[fmt], prompts[fmt] = _spec(ctx)
        t0 = time.perf_counter()
        compiler.compile(specs[fmt])
        print(f"{fmt}: the tool grammar admitted (compiled, first mask, probes) in "
              f"{1e3 * (time.perf_counter() - t0):.1f} ms")
    forced, _ = _spec(ctx, tool_choice="required")
    if "pythonic" in specs:  # the call list without its text alternative: decoding writes calls
        grammar = specs["pythonic"].grammar
        assert grammar.count(" | PLAIN\n") == 1
        specs["py call"] = dataclasses.replace(specs["pythonic"],
                                               grammar=grammar.replace(" | PLAIN\n", "\n"))
        prompts["py call"] = prompts["pythonic"]
    print(f"llguidance mask threads {MASK_THREADS} of {os.cpu_count()} cores, vocabulary {vocab}")
    # a forced call is written as the auto grammar writes one (tool_grammar.forced_call_grammar)
    call_tokens = tok.encode(CALL, add_special_tokens=False)
    print(f"{'grammar':>22}{'rows':>6}{'free text ms':>14}{'in call ms':>12}{'steps':>7}")
    for rows in (1, 8):
        for fmt in FLAGS.formats:
            free, call, steps = [], [], 0
            for tokens, inside in _answers(fmt, tok):
                times = mask_times(compiler, specs[fmt], tokens, rows, FLAGS.repeats)
                if inside is None:  # a pythonic answer is all text or all calls
                    inside = [tok.decode(tokens).startswith("[")] * len(tokens)
                free += [t for t, k in zip(times, inside) if not k]
                call += [t for t, k in zip(times, inside) if k]
                steps += len(times)
            print(f"{'auto ' + fmt:>22}{rows:>6}{_mean_ms(free):>14}{_mean_ms(call):>12}"
                  f"{steps:>7}")
        times = mask_times(compiler, forced, call_tokens, rows, FLAGS.repeats)
        print(f"{'required (forced)':>22}{rows:>6}{'-':>14}{_mean_ms(times):>12}{len(times):>7}")
    print(f"{'unconstrained':>22}{'any':>6}{0:>14.3f}{0:>12.3f}")

    if FLAGS.decode_rounds <= 0:
        return
    top = max(int(c) for c in FLAGS.concurrency)
    llm = LLM.from_engine(LLMEngine(EngineConfig.from_options(
        max_num_seqs=top, num_pages=max(64, top * 24)), loaded))
    print("warm-up:", llm.engine.warmup())
    results, kinds = {}, [None, *specs]
    prompts[None] = prompts[FLAGS.formats[0]]  # plain decoding: the first format's prompt
    for c in map(int, FLAGS.concurrency):  # untimed first pass: prompt shapes, grammar cache
        for kind in kinds:
            decode_run(llm, specs.get(kind), prompts[kind], c, 0)
    for r in range(FLAGS.decode_rounds):
        for c in map(int, FLAGS.concurrency):
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                results.setdefault((c, kind), []).append(
                    decode_run(llm, specs.get(kind), prompts[kind], c, 100 * r))
    print(f"{'conc.':>6}{'grammar':>10}{'ms/token':>10}{'overhead':>10}{'tokens':>8}")
    for c in map(int, FLAGS.concurrency):
        plain = statistics.mean(ms for ms, _ in results[(c, None)])
        for kind in kinds:
            ms = statistics.mean(ms for ms, _ in results[(c, kind)])
            tokens = statistics.mean(n for _, n in results[(c, kind)])
            print(f"{c:>6}{kind or 'none':>10}{1e3 * ms:>10.2f}{100 * (ms / plain - 1):>9.1f}%"
                  f"{tokens:>8.1f}")


if __name__ == "__main__":
    app.run(main)
