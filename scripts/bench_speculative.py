"""Speculative decoding against plain decoding, in one run, greedy, on the default model.

  python scripts/bench_speculative.py                                # k = 8, every workload
  python scripts/bench_speculative.py --num_speculative_tokens=8 --concurrency=1,64
  python scripts/bench_speculative.py --speculative_method=draft --speculative_quantization=int8
                                     # self-speculation: the target's own weights in int8

Workloads (configs/speculative_prompts.json): "grounded" prompts copy, edit or summarise a
document of 100-200 words they contain (prompt lookup's case), "grounded_short" the same tasks
on texts of 20-40 words (outputs of 10-100 tokens, where the prefill and the answer's opening
words weigh more), "open" chat questions. For each workload and concurrency
(requests in flight at once: the prompts repeated to fill it), each engine is warmed up, then
the two run the workload in turn, --repeats times; reported are output tokens per second
(medians), the speed-up of speculation over plain decoding (the median of the pairs' ratios:
a pair shares its moment's load on a shared machine), the share of the speculative engine's
steps that verified drafts (where the adaptive cost model stops speculating, the crossover, it
falls to the rare probes), acceptance (accepted / proposed drafts) and tokens per verification
(accepted drafts + the target's own token), and whether the outputs were identical.

  python scripts/bench_speculative.py --workloads=grounded --concurrency=1,2,4,8,16,32,64
                                     # the crossover: speed-up and steps verifying per batch
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections import Counter

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_enum("speculative_method", "ngram", ["ngram", "draft"],
                  "ngram: prompt lookup; draft: a draft model.")
flags.DEFINE_integer("num_speculative_tokens", 8, "Drafts per sequence and step (k).")
flags.DEFINE_string("speculative_model", None, "Draft model (draft); default: the target's own.")
flags.DEFINE_enum("speculative_quantization", "none", ["none", "int8"],
                  "The draft's weights (draft).")
flags.DEFINE_bool("speculative_adaptive", True, "Drafts per step from measured costs.")
flags.DEFINE_integer("prompt_lookup_min", 2, "Shortest n-gram matched.")
flags.DEFINE_integer("prompt_lookup_max", 4, "Longest n-gram matched.")
flags.DEFINE_list("concurrency", ["1", "64"], "Requests in flight at once.")
flags.DEFINE_list("workloads", ["grounded", "grounded_short", "open"],
                  "Prompt sets of the config file.")
flags.DEFINE_integer("max_tokens", 256, "Greedy output tokens per request (at most): the "
                     "grounded documents run to 150-250 tokens.")
flags.DEFINE_integer("repeats", 3, "Plain and speculative runs per workload, alternating: "
                     "tok/s are medians, the speed-up the median of the pairs' ratios.")
flags.DEFINE_string("model", "smollm2-135m", "Model.")
flags.DEFINE_string("json_out", None, "Write the results as JSON.")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(llm, prompts, concurrency: int) -> tuple[float, list, dict]:
    """Output tokens per second over the prompts repeated to `concurrency` requests, all
    submitted at once; the outputs; the speculation counters of the run."""
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=FLAGS.max_tokens)
    messages = [[{"role": "user", "content": prompts[i % len(prompts)]}]
                for i in range(max(concurrency, len(prompts)))]
    before = llm.stats()
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(messages), concurrency):
        outs += llm.chat(messages[i:i + concurrency], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = llm.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    spec = {k: after.get(k, 0) - before.get(k, 0)
            for k in ("steps", "spec_verifying_steps", "spec_steps", "spec_draft_tokens",
                      "spec_accepted_tokens")}
    return tokens / seconds, [o.outputs[0].token_ids for o in outs], spec


def main(argv):
    del argv
    from jaxserve import LLM
    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine
    from jaxserve.weights import load_model

    def make(**options):
        return LLM.from_engine(LLMEngine(EngineConfig.from_options(**options), loaded))

    with open(os.path.join(ROOT, "configs", "speculative_prompts.json")) as f:
        workloads = json.load(f)
    loaded = load_model(FLAGS.model)
    results = []
    print(f"{'workload':<10}{'conc.':>6}{'plain tok/s':>13}{'spec tok/s':>12}{'speed-up':>10}"
          f"{'verifying':>11}{'accepted':>10}{'tok/verif.':>11}{'identical':>11}")
    for concurrency in map(int, FLAGS.concurrency):
        options = dict(max_num_seqs=max(concurrency, 1), enable_prefix_caching=False,
                       num_pages=max(64, concurrency * 32))
        spec_config = {"method": FLAGS.speculative_method,
                       "num_speculative_tokens": FLAGS.num_speculative_tokens,
                       "adaptive": FLAGS.speculative_adaptive}
        if FLAGS.speculative_method == "ngram":
            spec_config.update(prompt_lookup_min=FLAGS.prompt_lookup_min,
                               prompt_lookup_max=FLAGS.prompt_lookup_max)
        else:
            spec_config.update(model=FLAGS.speculative_model,
                               quantization=FLAGS.speculative_quantization)
        engines = {"plain": make(**options),
                   "spec": make(**options, speculative_config=spec_config)}
        for llm in engines.values():
            llm.engine.warmup()
        for name in FLAGS.workloads:
            prompts = workloads[name]
            for llm in engines.values():  # untimed: the chat shapes and prompt lengths
                run(llm, prompts[:2], min(concurrency, 2))
            # Plain and speculative runs alternate, `repeats` pairs: a pair shares the
            # machine's load of its moment, so the median of the pairs' ratios is the speed-up.
            pairs, counts, identical = [], Counter(), True
            for _ in range(FLAGS.repeats):
                plain, plain_out, _ = run(engines["plain"], prompts, concurrency)
                spec, spec_out, spec_counts = run(engines["spec"], prompts, concurrency)
                pairs.append((plain, spec))
                counts.update(spec_counts)
                identical &= plain_out == spec_out
            plain, spec = (statistics.median(p[i] for p in pairs) for i in (0, 1))
            drafts = counts["spec_draft_tokens"]
            row = {"workload": name, "concurrency": concurrency, "plain_tok_s": plain,
                   "spec_tok_s": spec, "speedup": statistics.median(s / p for p, s in pairs),
                   "pairs": pairs,
                   "verifying_steps": counts["spec_verifying_steps"] / counts["steps"],
                   "acceptance_rate": counts["spec_accepted_tokens"] / drafts if drafts else 0.0,
                   "tokens_per_verification": ((counts["spec_accepted_tokens"]
                                                + counts["spec_steps"]) / counts["spec_steps"]
                                               if counts["spec_steps"] else 0.0),
                   "identical": identical, **counts, **spec_config}
            results.append(row)
            print(f"{name:<10}{concurrency:>6}{plain:>13.1f}{spec:>12.1f}{row['speedup']:>9.2f}x"
                  f"{100 * row['verifying_steps']:>10.0f}%{100 * row['acceptance_rate']:>9.0f}%"
                  f"{row['tokens_per_verification']:>11.2f}"
                  f"{str(row['identical']):>11}", flush=True)
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    app.run(main)
