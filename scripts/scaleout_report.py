"""What scale-out costs and how it balances, on virtual CPU devices (not a speed measure):

- the compiled step's collectives under tensor parallelism (count per layer, bytes all-reduced
  per step) for a decode step and the largest step, on the default model at TP 3;
- the data-parallel router's balance (requests and prompt tokens per replica, prefix-cache
  hits) on a mixed workload: groups of requests sharing a system prompt, and requests of their
  own with lengths drawn from a log-uniform distribution, all added at once.

    python scripts/scaleout_report.py [--tp=3] [--dp=2] [--requests=48] [--json=out.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402

import numpy as np  # noqa: E402

from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.core.sampling_params import SamplingParams  # noqa: E402
from jaxserve.engine import LLMEngine, make_engine  # noqa: E402
from jaxserve.engine.memory_plan import largest_shape  # noqa: E402
from jaxserve.runtime.batch import build_batch, warmup_plan  # noqa: E402

BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4}


def collectives(engine: LLMEngine, shape) -> dict:
    """Collectives of the compiled step of `shape` (Buckets.step_shapes)."""
    runner, buckets = engine.runner, engine.buckets
    batch, _, _ = build_batch(warmup_plan(shape, buckets, runner.page_size), buckets,
                              runner.page_size)
    text = runner._step.lower(runner.params, pool=runner.pool, batch=batch,
                              feed=runner._no_feed).compile().as_text()
    reduces = re.findall(r"= (\w+)\[([\d,]*)\][^ ]* all-reduce(?:-start)?\(", text)
    moved = sum(BYTES[dt] * int(np.prod([int(n) for n in dims.split(",") if n]))
                for dt, dims in reduces)
    layers = engine.model_config.num_layers
    return {"tokens": int(batch.token_ids.shape[0]), "all_reduce": len(reduces),
            "all_reduce_per_layer": len(reduces) / layers, "all_reduce_bytes": moved,
            "all_gather": len(re.findall(r" all-gather(?:-start)?\(", text)),
            "all_to_all": len(re.findall(r" all-to-all\(", text))}


def mixed_workload(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Half the requests in 4 groups that share a 48-token system prompt, half of their own;
    user parts log-uniform in 8..256 tokens."""
    rng = np.random.default_rng(seed)
    ids = lambda k: [int(t) for t in rng.integers(10, vocab - 10, k)]  # noqa: E731
    systems = [ids(48) for _ in range(4)]
    work = []
    for i in range(n):
        user = ids(int(np.exp(rng.uniform(np.log(8), np.log(256)))))
        work.append(systems[i % 4] + user if i % 2 == 0 else user)
    rng.shuffle(work)
    return work


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--json")
    args = ap.parse_args()
    common = dict(model=args.model, attention_backend="xla", page_size=16, num_pages=1024,
                  max_num_seqs=16, max_num_batched_tokens=256, huge_pages=False)

    tp = LLMEngine(EngineConfig.from_options(tensor_parallel_size=args.tp, **common))
    shapes = tp.buckets.step_shapes(tp.runner.page_size)
    report = {"tensor_parallel": {
        "tp": args.tp, "layers": tp.model_config.num_layers,
        "decode": collectives(tp, shapes[0]),
        "largest": collectives(tp, largest_shape(tp.buckets, tp.runner.page_size))}}
    del tp

    dp = make_engine(EngineConfig.from_options(data_parallel_size=args.dp, enable_prefix_caching=True,
                                               **common))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(mixed_workload(args.requests, dp.model_config.vocab_size)):
        dp.add_request({"prompt_token_ids": prompt}, params, request_id=str(i))
    while dp.has_unfinished():
        dp.step()
    stats = dp.stats()
    report["data_parallel"] = {"dp": args.dp, "requests": args.requests, "replicas": [
        {k: r[k] for k in ("routed_requests", "routed_tokens", "prefix_cache_hits",
                           "preemptions", "referenced_pages")} for r in stats["replicas"]]}

    t = report["tensor_parallel"]
    for name in ("decode", "largest"):
        c = t[name]
        print(f"TP {t['tp']} {name} step ({c['tokens']} tokens): {c['all_reduce']} all-reduces "
              f"({c['all_reduce_per_layer']:g} a layer over {t['layers']}), "
              f"{c['all_reduce_bytes']} bytes all-reduced, {c['all_gather']} all-gathers, "
              f"{c['all_to_all']} all-to-alls")
    for i, r in enumerate(report["data_parallel"]["replicas"]):
        print(f"DP replica {i}: {r['routed_requests']} requests, {r['routed_tokens']} prompt "
              f"tokens, {r['prefix_cache_hits']} prefix-cache hits, {r['preemptions']} "
              f"preemptions, {r['referenced_pages']} pages left referenced")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
