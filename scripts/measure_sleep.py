"""Weights updated in place and memory given back (docs/rl.md), measured on the default model:
the time of update_weights from the model's own weights in Hugging Face names (the form a
trainer sends), and the device memory held awake, asleep at levels 1 and 2, and woken up. On
the CPU, device memory is process memory: the resident set (runtime/memory.in_use, after
malloc_trim) and the bytes of JAX's live buffers are both printed.

    python scripts/measure_sleep.py [--model smollm2-135m] [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import time

import jax
import numpy as np

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.llm import LLM
from jaxserve.runtime import memory
from jaxserve.weights import load_model
from jaxserve.weights.named_update import hf_named

MIB = 2**20


def held(what: str) -> None:
    gc.collect()
    buffers = {x.unsafe_buffer_pointer(): x.nbytes for x in jax.live_arrays()
               if not x.is_deleted()}  # distinct buffers: the CPU's arrays may alias
    print(f"{what:<24} in use {memory.in_use() / MIB:8.1f} MiB   live buffers "
          f"{sum(buffers.values()) / MIB:8.1f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    llm = LLM(args.model, num_pages=512)
    greedy = SamplingParams(max_tokens=16, temperature=0)
    prompt = "The capital of France is"
    before = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    loaded = load_model(args.model)  # the same weights, eagerly on the host
    named = list(hf_named(loaded.config, loaded.params))
    compilations = llm.engine.compilations
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        llm.update_weights(named)
        times.append(time.perf_counter() - t0)
    after = llm.generate([prompt], greedy, use_tqdm=False)[0]
    print(f"update_weights ({len(named)} tensors, HF names): "
          f"{' '.join(f'{t * 1e3:.0f}' for t in times)} ms; best {min(times) * 1e3:.0f} ms; "
          f"compilations after: {llm.engine.compilations - compilations}; same greedy tokens: "
          f"{after.outputs[0].token_ids == before}; weights_version {after.weights_version}")
    # The engine's own layout (params_like): device arrays as a JAX trainer holds them (used
    # without a copy), and the same on the host (placed on the shardings).
    for form, copy in (("device arrays", lambda x: x + 0), ("host numpy", np.array)):
        tree = jax.tree_util.tree_map(copy, llm.engine.runner.params)
        jax.block_until_ready(tree)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            llm.update_weights(tree)
            times.append(time.perf_counter() - t0)
        del tree
        same = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids == before
        print(f"update_weights (engine layout, {form}): "
              f"{' '.join(f'{t * 1e3:.1f}' for t in times)} ms; same greedy tokens: {same}")
    stats = llm.stats()
    print(f"KV pool {stats['kv_pool_bytes'] / MIB:.1f} MiB, weights "
          f"{stats['weight_bytes'] / MIB:.1f} MiB")
    held("awake")
    llm.sleep(level=1)
    held("asleep, level 1")
    llm.wake_up()
    held("woken up")
    llm.sleep(level=2)
    held("asleep, level 2")
    llm.wake_up()
    held("woken up, no weights")
    llm.update_weights(named)
    again = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    held("after update_weights")
    print(f"same greedy tokens after sleep(level=2) and update: {again == before}; "
          f"compilations since the first generate: {llm.engine.compilations - compilations}")


if __name__ == "__main__":
    main()
