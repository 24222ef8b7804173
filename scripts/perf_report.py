"""Measure this machine's limits and jaxserve against them, in one run.

  python scripts/perf_report.py                      # full: 256 requests x (128 in, 128 out)
  python scripts/perf_report.py --num_prompts=64     # quicker

Bounds are computed in the same run, from measurements, never hard-coded:
- compute bound (tokens/s) = measured f32 matmul GFLOP/s / model GFLOP per token;
- single-stream decode bound (tokens/s) = measured read GB/s / weight bytes read per step, the
  read rate being the best of a full reduction and a matrix-vector product over 512 MiB (on
  4 KiB pages and on 2 MiB pages),
  measured at the start and again before each single-stream f32 run (the best of all is the
  bound; each run is also shown against the rate measured just before it).
Reported: offline total throughput (prompt + output tokens/s) vs the compute bound, single-stream
decode for f32 and int8 weights and for int8 KV pages vs the bandwidth bound (and, where the CPU has AMX-BF16, for
`--quantization=bf16`: single-stream and offline, next to f32), and, where `llama_cpp` is importable
(scripts/install_llama_cpp.sh builds it), llama.cpp on the same GGUF in the same run;
host work per step at 64 running requests (and how much of it overlapped a device step: async
scheduling plans step N+1 while step N runs), compilations after warm-up, and the pages a fixed
KV budget holds for each KV dtype (the scales of int8 pages counted).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_prompts", 256, "Offline workload requests.")
flags.DEFINE_integer("input_len", 128, "Prompt tokens per request.")
flags.DEFINE_integer("output_len", 128, "Output tokens per request (ignore_eos).")
flags.DEFINE_integer("max_num_seqs", 256, "Engine max_num_seqs for the offline run.")
flags.DEFINE_integer("max_num_batched_tokens", 1024, "Engine token budget per step.")
flags.DEFINE_integer("decode_tokens", 64, "Tokens timed in the single-stream runs.")
flags.DEFINE_integer("repeats", 3, "Single-stream runs per weight format (interleaved).")
flags.DEFINE_string("json_out", None, "Write the results as JSON.")


def best_of(fn, repeats: int = 5) -> float:
    fn()  # compile / warm
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure_matmul_gflops() -> float:
    import jax
    import jax.numpy as jnp

    n = 2048
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    return 2 * n ** 3 / best_of(lambda: f(a).block_until_ready()) / 1e9


def measure_read_gbps() -> dict:
    """Read rate over 512 MiB of f32, two ways: a full sum, and a matrix-vector product (the
    shape of single-stream decode); each on 4 KiB pages and again on 2 MiB pages (where the
    kernel collapses them: the engine's weights get them too). The bound uses the fastest."""
    import jax
    import jax.numpy as jnp

    from jaxserve.backends.cpu.huge_pages import collapse_into_huge_pages

    x = jnp.ones((32768, 4096), jnp.float32)  # 512 MiB
    v = jnp.ones((4096,), jnp.float32)
    total = jax.jit(jnp.sum)
    matvec = jax.jit(lambda x, v: x @ v)

    def rates(suffix: str) -> dict:
        return {"sum" + suffix: x.nbytes / best_of(lambda: total(x).block_until_ready()) / 1e9,
                "matvec" + suffix: x.nbytes / best_of(lambda: matvec(x, v).block_until_ready()) / 1e9}

    reads = rates("")
    if collapse_into_huge_pages([x]):
        reads.update(rates("_2m"))
    return reads


def make_engine(loaded, **options):
    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine

    return LLMEngine(EngineConfig.from_options(**options), loaded)


def drain(engine) -> dict:
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


# Single-stream variants: weight quantization and KV pool dtype.
VARIANTS = {"none": {}, "int8": {"quantization": "int8"}, "int8_kv": {"kv_cache_dtype": "int8"},
            "bf16": {"quantization": "bf16"}}
KV_BUDGET_BYTES = 1 << 30


def single_stream(loaded, variant: str) -> float:
    from jaxserve.core.sampling_params import SamplingParams

    engine = make_engine(loaded, **VARIANTS[variant], max_num_seqs=1, num_pages=64,
                         enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=FLAGS.decode_tokens, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 132))}
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4))  # compile
    drain(engine)
    engine.add_request(prompt, params)
    out = next(iter(drain(engine).values()))
    m = out.metrics
    return (FLAGS.decode_tokens - 1) / (m.finished_time - m.first_token_time)


def llama_cpp_single_stream(model_path: str):
    """llama.cpp decode tokens/s on the same GGUF and prompt (greedy); None if not importable."""
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=model_path, n_ctx=512, n_threads=os.cpu_count(),
                          verbose=False)

    def run() -> float:
        llm.reset()
        stamps = []
        for tok in llm.generate(list(range(100, 132)), temp=0.0, top_k=1):
            stamps.append(time.perf_counter())  # one decode step between consecutive tokens
            if len(stamps) == FLAGS.decode_tokens:
                break
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    return run


def offline(loaded, num_prompts: int, max_num_seqs: int, quantization: str = "none") -> dict:
    from jaxserve.core.sampling_params import SamplingParams

    pages_per_seq = -(-(FLAGS.input_len + FLAGS.output_len) // 16)
    engine = make_engine(loaded, quantization=quantization, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                         num_pages=1 + max_num_seqs * pages_per_seq,
                         enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=FLAGS.output_len, ignore_eos=True)

    def submit():
        for _ in range(num_prompts):
            prompt = rng.integers(3, 49000, FLAGS.input_len).tolist()
            engine.add_request({"prompt_token_ids": prompt}, params)

    # Warm-up: the same workload once, untimed, so every step shape it reaches is compiled.
    t = time.perf_counter()
    submit()
    drain(engine)
    warm = {"seconds": time.perf_counter() - t, "compilations": engine.stats()["compilations"]}
    compiled = engine.stats()["compilations"]
    pipe = engine.pipeline
    host0, dev0 = pipe.host_seconds, pipe.device_seconds
    over0, steps0 = pipe.host_overlapped_seconds, pipe.num_steps
    t = time.perf_counter()
    submit()
    outs = drain(engine)
    wall = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == FLAGS.output_len for o in outs.values())
    tokens = num_prompts * (FLAGS.input_len + FLAGS.output_len)
    host, dev = pipe.host_seconds - host0, pipe.device_seconds - dev0
    overlapped, steps = pipe.host_overlapped_seconds - over0, pipe.num_steps - steps0
    return {"wall_s": wall, "total_tokens_per_s": tokens / wall,
            "output_tokens_per_s": num_prompts * FLAGS.output_len / wall, "steps": steps,
            "host_ms_per_step": 1e3 * host / steps, "step_ms": 1e3 * wall / steps,
            "host_overlapped_share": overlapped / host,
            "host_share": host / (host + dev),  # of step() wall time, overlapped or not
            "host_exposed_share": (host - overlapped) / wall,  # host work no device step hid
            "warmup": warm,
            "compilations_after_warmup": engine.stats()["compilations"] - compiled}


def pages_per_budget(cfg, budget: int) -> dict:
    """Pages of 16 slots (scratch page 0 included) that `budget` bytes of KV hold per dtype."""
    from jaxserve.config import EngineConfig, ResolvedConfig

    def pages(kv: str) -> int:
        config = EngineConfig.from_options(kv_cache_bytes=budget, kv_cache_dtype=kv)
        resolved = ResolvedConfig.of(config, cfg, dtype="float32", backend="xla",
                                     attention_cost=1.0)
        return resolved.num_pages(config, resolved.kv_bytes_per_token(cfg))

    return {kv: pages(kv) for kv in ("float32", "bfloat16", "int8")}


def main(argv):
    del argv
    import jax

    from jaxserve.backends.cpu import kernels as cpu_kernels
    from jaxserve.weights import load_model, resolve_model_path

    loaded = load_model("smollm2-135m")
    cfg = loaded.config
    gflops = measure_matmul_gflops()
    reads = measure_read_gbps()
    gbps = max(reads.values())
    flops_per_token = cfg.flops_per_token()
    weight_bytes = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(loaded.params))
    compute_bound = gflops * 1e9 / flops_per_token
    # This machine's speed swings by 2-3x from minute to minute: interleave the two weight
    # formats, repeat, and report the best and the median of each.
    gguf_path = resolve_model_path("smollm2-135m")
    llama_cpp_run = llama_cpp_single_stream(gguf_path)
    formats = ("none", "int8", "int8_kv") + (("bf16",) if cpu_kernels.amx_bf16_available() else ())
    runs = {**{q: [] for q in formats}, "llama_cpp": []}
    # Each f32 run is also compared with a read rate measured just before it (the machine's
    # bandwidth drifts within a run too); the headline bound uses the best rate of them all.
    run_bounds, read_runs = [], []
    for _ in range(FLAGS.repeats):
        read_runs.append(max(measure_read_gbps().values()))
        run_bounds.append(read_runs[-1] * 1e9 / weight_bytes)
        for quantization in formats:
            runs[quantization].append(single_stream(loaded, quantization))
        if llama_cpp_run:
            runs["llama_cpp"].append(llama_cpp_run())
    gbps = max([gbps, *read_runs])
    decode_bound = gbps * 1e9 / weight_bytes
    per_run = [r / b for r, b in zip(runs["none"], run_bounds)]
    f32, int8 = max(runs["none"]), max(runs["int8"])
    f32_median, int8_median = float(np.median(runs["none"])), float(np.median(runs["int8"]))
    int8_kv = max(runs["int8_kv"])
    lc = max(runs["llama_cpp"]) if runs["llama_cpp"] else None
    pages = pages_per_budget(cfg, KV_BUDGET_BYTES)
    run = offline(loaded, FLAGS.num_prompts, FLAGS.max_num_seqs)
    at64 = offline(loaded, 64, 64)  # 64 running requests: the host-overhead target
    bf16 = max(runs["bf16"]) if "bf16" in runs else None
    # bf16 weights are half the bytes (the head a bf16 copy; the f32 embedding table is only
    # looked up), so its bound is twice the f32 one.
    bf16_bound = 2 * decode_bound
    bf16_offline = (offline(loaded, FLAGS.num_prompts, FLAGS.max_num_seqs, "bf16")
                    if bf16 else None)
    result = {
        "machine": {"cpus": os.cpu_count(), "backend": jax.default_backend(),
                    "matmul_gflops": gflops, "read_gbps": gbps, "read_gbps_by_method": reads,
                    "read_gbps_before_each_f32_run": read_runs},
        "model": {"gflop_per_token": flops_per_token / 1e9, "weight_bytes_f32": weight_bytes},
        "bounds": {"compute_tokens_per_s": compute_bound, "decode_f32_tokens_per_s": decode_bound},
        "single_stream": {"f32_tokens_per_s": f32, "int8_tokens_per_s": int8,
                          "f32_runs": runs["none"], "int8_runs": runs["int8"],
                          "f32_vs_bound": f32 / decode_bound, "int8_vs_f32": int8 / f32,
                          "f32_run_bounds": run_bounds, "f32_runs_vs_their_bound": per_run,
                          "llama_cpp_gguf": os.path.basename(gguf_path),
                          "llama_cpp_tokens_per_s": lc, "llama_cpp_runs": runs["llama_cpp"],
                          "int8_vs_llama_cpp": int8 / lc if lc else None,
                          "int8_kv_tokens_per_s": int8_kv, "int8_kv_runs": runs["int8_kv"],
                          "int8_kv_vs_llama_cpp": int8_kv / lc if lc else None,
                          "bf16_tokens_per_s": bf16, "bf16_runs": runs.get("bf16"),
                          "bf16_vs_its_bound": bf16 / bf16_bound if bf16 else None},
        "offline": {**run, "vs_compute_bound": run["total_tokens_per_s"] / compute_bound},
        "host_at_64_running": at64,
        "bf16_offline": bf16_offline,
        "kv_pages_per_gib": pages,
    }
    rows = [
        ("f32 matmul (measured)", f"{gflops:.0f} GFLOP/s"),
        ("read bandwidth (measured, best)", f"{gbps:.1f} GB/s (best of {len(read_runs) + 1}; the "
                                            "first: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                                  reads.items()) + ")"),
        ("model FLOPs per token", f"{flops_per_token / 1e9:.3f} GFLOP"),
        ("compute bound", f"{compute_bound:.0f} tok/s"),
        ("single-stream bound (f32 weights)", f"{decode_bound:.1f} tok/s"),
        ("single-stream decode f32, best", f"{f32:.1f} tok/s ({f32 / decode_bound:.0%} of bound;"
         f" median {f32_median:.1f})"),
        ("  each run vs a bound measured just before",
         ", ".join(f"{r:.1f}/{b:.1f} = {r / b:.0%}" for r, b in zip(runs["none"], run_bounds))),
        ("single-stream decode int8, best", f"{int8:.1f} tok/s ({int8 / f32:.2f}x f32;"
         f" median {int8_median:.1f})"),
        ("single-stream decode int8 KV (f32 weights), best",
         f"{int8_kv:.1f} tok/s ({int8_kv / f32:.2f}x f32; median "
         f"{np.median(runs['int8_kv']):.1f})"),
        (f"llama.cpp on {os.path.basename(gguf_path)}, best",
         f"{lc:.1f} tok/s (jaxserve int8 / llama.cpp = {int8 / lc:.2f}x)" if lc
         else "skipped (llama_cpp not importable)"),
        (f"offline {FLAGS.num_prompts} x ({FLAGS.input_len} in, {FLAGS.output_len} out) total",
         f"{run['total_tokens_per_s']:.0f} tok/s ({run['total_tokens_per_s'] / compute_bound:.0%}"
         f" of compute bound)"),
        ("offline output throughput", f"{run['output_tokens_per_s']:.0f} tok/s"),
        ("single-stream decode bf16 (AMX), best",
         f"{bf16:.1f} tok/s ({bf16 / f32:.2f}x f32; {bf16 / bf16_bound:.0%} of a bf16 "
         f"bound of {bf16_bound:.1f}; median {np.median(runs['bf16']):.1f})" if bf16
         else "skipped (no AMX-BF16)"),
        ("offline total, bf16 (AMX)",
         f"{bf16_offline['total_tokens_per_s']:.0f} tok/s "
         f"({bf16_offline['total_tokens_per_s'] / run['total_tokens_per_s']:.2f}x f32; "
         f"compilations after warm-up {bf16_offline['compilations_after_warmup']})"
         if bf16_offline else "skipped (no AMX-BF16)"),
        ("host work per step, 64 running", f"{at64['host_ms_per_step']:.2f} ms of "
         f"{at64['step_ms']:.1f} ms ({at64['host_share']:.1%}; {at64['host_overlapped_share']:.0%}"
         f" overlapped a device step, {at64['host_exposed_share']:.1%} exposed)"),
        ("KV pages of 16 slots in 1 GiB", ", ".join(f"{kv} {n}" for kv, n in pages.items())
         + f" (int8 / float32 = {pages['int8'] / pages['float32']:.2f}x)"),
        ("compilations after warm-up", f"{run['compilations_after_warmup']} "
         f"(64 running: {at64['compilations_after_warmup']})"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    app.run(main)
