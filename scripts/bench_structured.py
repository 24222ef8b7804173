"""Structured outputs' cost: time per output token with and without a JSON-schema constraint,
at each concurrency, interleaved in one run on one engine (the default model).

  python scripts/bench_structured.py                       # configs/bench_structured.json
  python scripts/bench_structured.py --concurrency=1,32 --rounds=2

The workload (configs/bench_structured.json): chat prompts asking for a value of each schema of
configs/structured_schemas.json, sampled at the config's temperature; the constrained run sends
the schema as its structured output, the plain run does not and decodes as many tokens per
request (ignore_eos, max_tokens = the constrained output's length). Rounds alternate which
goes first.
Reported per concurrency and mode: mean time per output token of a request (its decode time
over its tokens after the first), wall time per engine step, aggregate output tokens per second, steps planned ahead of the
previous step's read-back (async scheduling; a constrained step's sampling then waits for its
masks while its forward pass runs), and the share of constrained outputs that are valid JSON of
their schema (all must be, or were cut by max_tokens).
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "configs/bench_structured.json", "Workload file.")
flags.DEFINE_list("concurrency", None, "Requests at once (default: the config's).")
flags.DEFINE_integer("rounds", None, "Interleaved rounds (default: the config's).")
flags.DEFINE_string("model", "smollm2-135m", "Model.")
flags.DEFINE_string("json_out", None, "Write the results as JSON.")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(llm, cfg, schemas, concurrency: int, constrained: bool, lengths=None) -> dict:
    """One run of `concurrency` requests at once. Seeds are fixed per request, so a constrained
    request gives the same output every round; a plain run is given those output lengths
    (`lengths`, with ignore_eos) so both modes decode the same tokens per request."""
    from jaxserve import SamplingParams
    from jaxserve.core.structured_output import StructuredOutputsParams

    names = sorted(schemas)
    picks = [names[i % len(names)] for i in range(concurrency)]
    messages = [[{"role": "user", "content": cfg["prompt"].format(
        schema=json.dumps(schemas[name]))}] for name in picks]
    params = [SamplingParams(temperature=cfg["temperature"],
                             max_tokens=lengths[i] if lengths else cfg["max_tokens"],
                             ignore_eos=bool(lengths), seed=cfg["seed"] + i,
                             structured_outputs=StructuredOutputsParams(json=schemas[name])
                             if constrained else None) for i, name in enumerate(picks)]
    prompts = [llm.engine.tokenizer.apply_chat_template(m) for m in messages]
    before = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = llm.stats()
    tpots, tokens, valid = [], 0, 0
    for out, name in zip(outs, picks):
        c, m = out.outputs[0], out.metrics
        tokens += len(c.token_ids)
        if len(c.token_ids) > 1:
            tpots.append((m.finished_time - m.first_token_time) / (len(c.token_ids) - 1))
        if constrained:
            valid += c.finish_reason == "length" or _valid(c.text, schemas[name])
    return {"lengths": [len(o.outputs[0].token_ids) for o in outs],
            "tpot_s": sum(tpots) / len(tpots), "seconds": seconds, "tok_s": tokens / seconds, "tokens": tokens,
            "valid": valid / len(outs) if constrained else None,
            "steps": after["steps"] - before["steps"],
            "ahead": after["num_scheduled_ahead"] - before["num_scheduled_ahead"]}


def _valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main(argv):
    del argv
    from jaxserve import LLM
    from jaxserve.config import EngineConfig
    from jaxserve.core.structured_output import MASK_THREADS
    from jaxserve.engine import LLMEngine
    from jaxserve.weights import load_model

    with open(os.path.join(ROOT, FLAGS.config)) as f:
        cfg = json.load(f)
    with open(os.path.join(ROOT, os.path.dirname(FLAGS.config), cfg["schemas"])) as f:
        schemas = json.load(f)
    concurrency = [int(c) for c in FLAGS.concurrency or cfg["concurrency"]]
    rounds = FLAGS.rounds or cfg["rounds"]
    loaded = load_model(FLAGS.model)
    top = max(concurrency)
    llm = LLM.from_engine(LLMEngine(EngineConfig.from_options(
        max_num_seqs=top, num_pages=max(64, top * 24)), loaded))
    print("warm-up:", llm.engine.warmup())
    print(f"llguidance mask threads: {MASK_THREADS} (of {os.cpu_count()} cores)")
    lengths = {}
    for c in concurrency:  # untimed: the prompt shapes, and the constrained output lengths
        lengths[c] = run(llm, cfg, schemas, c, True)["lengths"]
        run(llm, cfg, schemas, c, False, lengths[c])
    totals = {}
    for r in range(rounds):
        for c in concurrency:
            for constrained in ((False, True) if r % 2 == 0 else (True, False)):
                res = run(llm, cfg, schemas, c, constrained, None if constrained else lengths[c])
                totals.setdefault((c, constrained), []).append(res)
    results = []
    print(f"{'conc.':>6}{'mode':>12}{'ms/token':>10}{'ms/step':>9}{'tok/s':>9}{'overhead':>10}"
          f"{'valid':>7}{'planned ahead':>15}")
    for c in concurrency:
        plain = None
        for constrained in (False, True):
            runs = totals[(c, constrained)]
            tpot = sum(x["tpot_s"] for x in runs) / len(runs)
            tok_s = sum(x["tokens"] for x in runs) / sum(x["tokens"] / x["tok_s"] for x in runs)
            plain = tpot if not constrained else plain
            step_ms = 1e3 * sum(x["seconds"] for x in runs) / sum(x["steps"] for x in runs)
            row = {"concurrency": c, "constrained": constrained, "tpot_ms": 1e3 * tpot,
                   "step_ms": step_ms,
                   "tok_s": tok_s, "overhead": tpot / plain - 1,
                   "valid": (sum(x["valid"] for x in runs) / len(runs)) if constrained else None,
                   "steps_ahead": sum(x["ahead"] for x in runs),
                   "steps": sum(x["steps"] for x in runs), "rounds": len(runs)}
            results.append(row)
            valid = f"{100 * row['valid']:.0f}%" if constrained else "-"
            print(f"{c:>6}{'json schema' if constrained else 'plain':>12}{1e3 * tpot:>10.2f}"
                  f"{step_ms:>9.2f}"
                  f"{tok_s:>9.1f}{100 * row['overhead']:>9.1f}%{valid:>7}"
                  f"{row['steps_ahead']:>8}/{row['steps']}", flush=True)
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump({"mask_threads": MASK_THREADS, "results": results}, f, indent=2)


if __name__ == "__main__":
    app.run(main)
