"""`jaxserve generate`: one prompt in, the completion out (text, or JSON with --json)."""

from __future__ import annotations

import json
import sys
import time

from absl import flags

from jaxserve.cli import engine_flags  # noqa: F401  (defines the engine flags)

flags.DEFINE_string("prompt", None, "The prompt text.", required=True)
flags.DEFINE_bool("chat", False, "Wrap the prompt as a user message in the model's chat template.")
flags.DEFINE_string("system", None, "System message (with --chat).")
flags.DEFINE_integer("max_tokens", 64, "Most tokens to generate.")
flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass in (0, 1].")
flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0 = off).")
flags.DEFINE_float("min_p", 0.0, "Drop tokens below min_p times the top probability.")
flags.DEFINE_integer("sample_seed", None, "Sampling seed.")
flags.DEFINE_bool("ignore_eos", False, "Keep generating past end-of-sequence.")
flags.DEFINE_bool("json", False, "Print a JSON object with ids, text, finish reason, timings.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.runtime.distributed import PeerLostError

    try:
        params = SamplingParams(max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature,
                                top_p=FLAGS.top_p, top_k=FLAGS.top_k, min_p=FLAGS.min_p,
                                seed=FLAGS.sample_seed, ignore_eos=FLAGS.ignore_eos)
        t0 = time.perf_counter()
        from jaxserve.llm import LLM

        llm = LLM(**engine_flags.engine_options())
        if FLAGS.process_id != 0:  # another process runs the front end: run its steps here
            llm.engine.follow()
            return 0
        t_load = time.perf_counter() - t0
        t1 = time.perf_counter()
        if FLAGS.chat:
            messages = ([{"role": "system", "content": FLAGS.system}] if FLAGS.system else [])
            messages.append({"role": "user", "content": FLAGS.prompt})
            out = llm.chat(messages, params)[0]
        else:
            out = llm.generate(FLAGS.prompt, params)[0]
        t_gen = time.perf_counter() - t1
        llm.engine.stop_followers()
    except ValueError as e:  # bad input: a clear message, no traceback
        print(f"jaxserve generate: error: {e}", file=sys.stderr)
        return 2
    except PeerLostError as e:  # another process of a multi-host run died
        print(f"jaxserve generate: error: {e}", file=sys.stderr)
        return 1
    completion = out.outputs[0]
    if FLAGS.json:
        m = out.metrics
        print(json.dumps({
            "prompt_token_ids": out.prompt_token_ids, "token_ids": completion.token_ids,
            "text": completion.text, "finish_reason": completion.finish_reason,
            "timings": {"load_s": round(t_load, 3), "generate_s": round(t_gen, 3),
                        "ttft_s": round(m.ttft, 4) if m.ttft is not None else None,
                        "e2e_s": round(m.e2e, 4) if m.e2e is not None else None,
                        "output_tokens_per_s": round(len(completion.token_ids) / t_gen, 2)},
        }))
    else:
        print(completion.text)
    return 0
