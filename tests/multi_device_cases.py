"""Engine runs on several virtual CPU devices, as a script: XLA_FLAGS must name the device count
before JAX starts, so tests/test_multi_device.py runs this in a subprocess and reads its JSON.

    python tests/multi_device_cases.py  ->  {"runs": {name: {"outputs", "stats"}}, "hlo": {...}}

Every run serves the same greedy workload with prefix caching, chunked prefill, forced preemption
(a pool too small for the batch), int8 KV pages and ngram speculative decoding on. Models: the
tiny test model (4 query heads over 2 KV heads: TP 4 repeats them) and a SmolLM2-shaped one
(9 query heads over 3 KV heads, 2 layers: TP 3 shards them). Attention is the xla backend,
and once the TPU-style Pallas kernel in interpret mode.
"""

from __future__ import annotations

import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402

from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.core.sampling_params import SamplingParams  # noqa: E402
from jaxserve.engine import LLMEngine, make_engine  # noqa: E402
from jaxserve.llm import LLM  # noqa: E402
from jaxserve.weights.random_init import SMOLLM2_135M, random_model  # noqa: E402
from tiny_model import tiny_loaded  # noqa: E402

OPTIONS = dict(model="unused", attention_backend="xla", kv_cache_dtype="int8", page_size=4,
               num_pages=16, max_num_seqs=4, max_num_batched_tokens=16,
               enable_prefix_caching=True, enable_chunked_prefill=True,
               speculative_config={"num_speculative_tokens": 3, "adaptive": False,
                                   "prompt_lookup_min": 1},
               huge_pages=False)
SMOL_SHAPED = dataclasses.replace(SMOLLM2_135M, vocab_size=320, hidden_size=72,
                                  intermediate_size=96, num_layers=2, head_dim=8,
                                  max_position_embeddings=256)


def prompts(vocab: int) -> list[list[int]]:
    """A shared 12-token prefix (3 full pages), then repeats (ngram drafts find matches)."""
    rng = np.random.default_rng(1)
    prefix = [int(t) for t in rng.integers(1, vocab - 2, 12)]
    tails = [[int(t) for t in rng.integers(1, vocab - 2, 5)] * 2 for _ in range(4)]
    return [prefix + tail for tail in tails]


def serve(loaded, max_tokens: int = 20, **options) -> dict:
    engine = make_engine(EngineConfig.from_options(**{**OPTIONS, **options}), loaded)
    llm = LLM.from_engine(engine)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    work = prompts(loaded.config.vocab_size)
    first = llm.generate(work[:1], params, use_tqdm=False)  # its pages are then cached
    outs = first + llm.generate(work[1:], params, use_tqdm=False)
    stats = llm.stats()
    drafted = sum(sum(r["spec_drafted_per_position"]) for r in stats.get("replicas", [stats]))
    keep = ("referenced_pages", "preemptions", "prefix_cache_hits", "kv_pool_bytes",
            "kv_pool_bytes_per_device", "weight_bytes", "weight_bytes_per_device")
    return {"outputs": [o.outputs[0].token_ids for o in outs],
            "stats": {**{k: stats[k] for k in keep},
                      "spec_drafted": drafted},
            "engine": engine}


def collectives(engine: LLMEngine) -> dict:
    """Collectives in the compiled step of a decode batch: counts, and bytes of the all-reduced
    values per step (the payload each device contributes)."""
    from jaxserve.runtime.batch import build_batch, warmup_plan

    runner = engine.runner
    shape = engine.buckets.step_shapes(runner.page_size, False)[0]
    batch, _, _ = build_batch(warmup_plan(shape, engine.buckets, runner.page_size),
                              engine.buckets, runner.page_size)
    text = runner._step.lower(runner.params, pool=runner.pool, batch=batch,
                              feed=runner._no_feed).compile().as_text()
    reduces = re.findall(r"= (\w+)\[([\d,]*)\][^ ]* all-reduce(?:-start)?\(", text)
    size = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4}
    moved = sum(size[dt] * int(np.prod([int(n) for n in dims.split(",") if n]))
                for dt, dims in reduces)
    return {"all_reduce": len(reduces), "all_reduce_bytes": moved,
            "all_gather": len(re.findall(r" all-gather(?:-start)?\(", text)),
            "all_to_all": len(re.findall(r" all-to-all\(", text)),
            "tokens": int(batch.token_ids.shape[0])}


PALLAS_TOKENS = 5
MIXED_PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def mixed_work() -> list[tuple[str, list[int]]]:
    """Two groups of 4 prompts that each share a first page, and 4 prompts of their own."""
    rng = np.random.default_rng(2)
    ids = lambda n: [int(t) for t in rng.integers(1, 300, n)]  # noqa: E731
    groups = {"a": ids(8), "b": ids(8)}
    return ([("a", groups["a"] + ids(6)) for _ in range(4)]
            + [("b", groups["b"] + ids(10)) for _ in range(4)]
            + [("own", ids(n)) for n in (3, 7, 20, 40)])


def route(engine) -> dict:
    """The mixed workload added at once to a data-parallel engine, and one request aborted on
    the way: where each went, its outputs, and the router's balance."""
    placed, outputs = {}, {}
    for i, (group, prompt) in enumerate(mixed_work()):
        engine.add_request(prompt, MIXED_PARAMS, request_id=f"mix-{i}")
        placed.setdefault(group, []).append(engine._owner[f"mix-{i}"])
    before = engine.router.requests[:]
    engine.add_request(list(range(1, 31)), MIXED_PARAMS, request_id="victim")
    owner = engine._owner["victim"]
    aborted = engine.abort("victim")
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    stats = engine.stats()
    return {"placed": placed, "aborted": aborted, "victim_replica": owner,
            "victim_routed": [a - b for a, b in zip(engine.router.requests, before)],
            "outputs": [outputs[f"mix-{i}"] for i in range(len(outputs))],
            "routed_requests": [r["routed_requests"] for r in stats["replicas"]],
            "routed_tokens": [r["routed_tokens"] for r in stats["replicas"]],
            "unfinished": [r.num_unfinished for r in engine.replicas],
            "referenced_pages": [r["referenced_pages"] for r in stats["replicas"]],
            "aborted_total": stats["num_aborted_total"]}


def main() -> None:
    # Read when JAX first touches a device (below), not at import.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4")
    runs, hlo = {}, {}
    tiny, smol = tiny_loaded(), random_model(SMOL_SHAPED, seed=3, weight_scale=0.3)
    for name, loaded, tps in (("tiny", tiny, (1, 4)), ("smol", smol, (1, 3))):
        for tp in tps:
            run = serve(loaded, tensor_parallel_size=tp)
            if name == "tiny" and tp == 1:  # the mixed workload's reference
                llm = LLM.from_engine(run["engine"])
                mixed = [o.outputs[0].token_ids for o in llm.generate(
                    [p for _, p in mixed_work()], MIXED_PARAMS, use_tqdm=False)]
            if tp > 1:
                hlo[f"{name}-tp{tp}"] = collectives(run["engine"])
            runs[f"{name}-tp{tp}"] = {k: v for k, v in run.items() if k != "engine"}
    # The TPU-style Pallas kernel (interpreted: slow, so a shorter run) inside shard_map, over
    # the sharded pool.
    run = serve(tiny, max_tokens=PALLAS_TOKENS, tensor_parallel_size=2,
                attention_backend="pallas", pallas_kernels="tpu")
    runs["tiny-tp2-pallas"] = {k: v for k, v in run.items() if k != "engine"}
    # Windows under TP: every layer windowed (pages before the window released), TP 1 and 2;
    # and the draft method at TP 2 (the draft model whole on the replica's first device).
    windowed = dataclasses.replace(tiny, config=dataclasses.replace(tiny.config,
                                                                    sliding_window=6))
    for tp in (1, 2):
        run = serve(windowed, tensor_parallel_size=tp)
        runs[f"window-tp{tp}"] = {k: v for k, v in run.items() if k != "engine"}
    run = serve(tiny, tensor_parallel_size=2, speculative_config={
        "method": "draft", "num_speculative_tokens": 3, "adaptive": False})
    runs["tiny-tp2-draft"] = {k: v for k, v in run.items() if k != "engine"}
    run = serve(tiny, data_parallel_size=2)
    runs["tiny-dp2"] = {k: v for k, v in run.items() if k != "engine"}
    router = route(run["engine"])
    print(json.dumps({"runs": runs, "hlo": hlo, "router": router, "mixed_reference": mixed}))


if __name__ == "__main__":
    main()
