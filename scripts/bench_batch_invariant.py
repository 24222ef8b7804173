"""What batch_invariant costs (docs/rl.md): offline LLM.generate of mixed-length prompts with the
option off and on, per backend, output tokens per second after a warm-up run.

    python scripts/bench_batch_invariant.py [--backends cpu,xla] [--prompts 32] [--max_tokens 64]
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.llm import LLM
from jaxserve.runtime.runner import release_compiled_steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="cpu,xla")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    words = "the a of to and in is it that for on with as was at by an be this".split()
    prompts = [" ".join(rng.choice(words, rng.integers(8, 128))) for _ in range(args.prompts)]
    params = [SamplingParams(temperature=1.0, seed=i, ignore_eos=True,
                             max_tokens=int(rng.integers(args.max_tokens // 4, args.max_tokens)))
              for i in range(args.prompts)]
    tokens = sum(p.max_tokens for p in params)
    print(f"{args.prompts} prompts of 8-128 words, {tokens} output tokens in all")
    for backend in args.backends.split(","):
        for invariant in (False, True):
            llm = LLM(attention_backend=backend, batch_invariant=invariant, num_pages=2048)
            llm.generate(prompts[:4], params[:4], use_tqdm=False)  # compiles the shapes
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                times.append(time.perf_counter() - t0)
            print(f"{backend:4s} batch_invariant={invariant!s:5s}: best {min(times):6.2f} s, "
                  f"{tokens / min(times):7.1f} output tok/s "
                  f"(runs: {', '.join(f'{t:.2f}' for t in times)})", flush=True)
            del llm
            gc.collect()
            release_compiled_steps()


if __name__ == "__main__":
    main()
