"""Single-stream greedy decode of one engine configuration, as one line: total tok/s (prompt
processing included) and decode tok/s (the first token's time taken out), each the best of
--repeats runs in this process after one untimed run (compilations).

It imports `jaxserve` from wherever Python finds it, so two trees are compared by running it
under each (whole-process pairs, alternated, so that both sides share the machine's load):

  python scripts/bench_single_stream.py --attention_backend=xla --quantization=int8
  PYTHONPATH=/path/to/other/tree python scripts/bench_single_stream.py --attention_backend=xla ...
"""

from __future__ import annotations

import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Model name or path.")
flags.DEFINE_string("attention_backend", "auto", "auto, cpu, xla or pallas.")
flags.DEFINE_string("quantization", "none", "none, int8 or bf16.")
flags.DEFINE_string("kv_cache_dtype", None, "KV page dtype (default: the engine's).")
flags.DEFINE_integer("prompt_tokens", 32, "Prompt length (token ids 1000, 1001, ...).")
flags.DEFINE_integer("decode_tokens", 128, "Tokens generated (ignore_eos).")
flags.DEFINE_integer("repeats", 3, "Runs per length; the best is reported.")


def main(argv):
    del argv
    from jaxserve import LLM, SamplingParams

    options = dict(quantization=FLAGS.quantization, attention_backend=FLAGS.attention_backend,
                   max_num_seqs=1, num_pages=64, enable_prefix_caching=False)
    if FLAGS.kv_cache_dtype:
        options["kv_cache_dtype"] = FLAGS.kv_cache_dtype
    llm = LLM(model=FLAGS.model, **options)
    prompt = [{"prompt_token_ids": list(range(1000, 1000 + FLAGS.prompt_tokens))}]

    def best(tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        times = []
        for _ in range(FLAGS.repeats):
            start = time.perf_counter()
            out = llm.generate(prompt, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
            assert len(out[0].outputs[0].token_ids) == tokens
        return min(times)

    llm.generate(prompt, SamplingParams(max_tokens=FLAGS.decode_tokens, temperature=0,
                                        ignore_eos=True), use_tqdm=False)  # compiles
    first, whole = best(1), best(FLAGS.decode_tokens)
    n = FLAGS.decode_tokens
    print(f"total_tok_s={n / whole:.1f} decode_tok_s={(n - 1) / (whole - first):.1f}")


if __name__ == "__main__":
    app.run(main)
