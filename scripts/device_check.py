"""The device check: one command for a lent GPU (about 8 minutes on an H200), in stages that
each write what they measured before the next starts, so a broken setup costs one minute.

  1 smoke       versions, devices, one compiled ragged_paged_attention call against the reference
  2 kernels     tests/test_gpu_kernels.py, compiled (the tests interpret only off the GPU)
  3 parity      greedy tokens of a seeded random model of SmolLM2-135M's shape, float32 at
                highest matmul precision, Pallas and XLA backends, against tokens computed on a
                CPU in float32 (scripts/device_check_reference.json)
  4 bandwidth   decode attention (bf16 pool, 8 KV heads, head dim 128, page 16, 64 rows x 2048
                context) as a fraction of a copy kernel's bandwidth measured in the same run,
                beside JAX's own Pallas paged_attention (decode only) as a peer
  5 throughput  engine output tokens/s at 1, 64 and 256 concurrent requests (bf16, 128 + 128)
  6 tpu_plan    no device: the default model compiled for v5e:2x2 and v6e:2x2 without a TPU
                (`jaxserve compile --topology`), shapes, seconds and the memory plan per chip;
                not in the default stages: `--stages tpu_plan` on any machine with libtpu

  PYTHONPATH=. python scripts/device_check.py --out $OUT      # on the device
  python scripts/device_check.py --write_reference             # on a CPU: the reference tokens
  python scripts/device_check.py --quick                       # a small dry run on any machine

Writes device_check.json (every stage's numbers, errors included) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
REFERENCE = os.path.join(ROOT, "scripts", "device_check_reference.json")
# Parity prompts: token ids of the random model (its text is meaningless), lengths around
# page boundaries and a prompt long enough for several pages and a chunked prefill.
PARITY_LENS = (1, 15, 16, 17, 100, 300)
PARITY_TOKENS = 24
# A greedy token counts as a mismatch only where the reference's top-2 logprob gap exceeds
# this: below it, float32 evaluation order alone may flip the choice.
TIE_GAP = 1e-4

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def timed(fn, *args, repeats: int = 20) -> float:
    """Median seconds per call of a jitted fn, compile excluded."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def family():
    """The GPU kernels: compiled on a GPU, interpreted elsewhere (a dry run)."""
    from pallas_kernels import gpu as kernels

    return kernels, jax.default_backend() != "gpu"


# ----------------------------------------------------------------------------------- stages
def smoke(args) -> dict:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from attention_cases import call, mixed_rows, ragged_case

    from pallas_kernels.reference import ref_ragged_paged_attention_f64

    kernels, interpret = family()
    case = ragged_case(0, mixed_rows(16, long=100), page_size=16, num_kv_heads=2, group=3,
                       head_dim=64)
    out = call(kernels.ragged_paged_attention, case, sm_scale=0.125, interpret=interpret)
    ref = ref_ragged_paged_attention_f64(case["q"], case["k_pages"], case["v_pages"],
                                         case["page_tables"], case["seq_lens"],
                                         case["query_start"], sm_scale=0.125)
    err = float(np.max(np.abs(np.asarray(out, np.float64) - ref)))
    return {"jax": jax.__version__, "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()], "kernel_max_abs_err_vs_f64": err,
            "ok": err < 1e-4}


def kernel_tests(args) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "tests/test_gpu_kernels.py"]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=args.kernel_test_timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "summary": f"timed out after {args.kernel_test_timeout} s"}
    lines = done.stdout.strip().splitlines()
    failures = [line for line in lines if line.startswith("FAILED")]
    return {"ok": done.returncode == 0, "summary": lines[-1] if lines else done.stderr[-500:],
            "failed": failures[:20]}


def _engine(loaded, **options):
    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine

    return LLMEngine(EngineConfig.from_options(enable_prefix_caching=False, **options), loaded)


def _greedy(engine, prompts, max_tokens: int, logprobs: int | None = None):
    from jaxserve.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=logprobs)
    ids = [engine.add_request(p, params).request_id for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    return [done[i] for i in ids]


def parity_prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [[int(t) for t in rng.integers(3, vocab, n)] for n in PARITY_LENS]


def write_reference(args) -> None:
    from jaxserve.weights.random_init import random_model

    loaded = random_model(dtype="float32")
    prompts = parity_prompts(loaded.config.vocab_size)
    engine = _engine(loaded, dtype="float32", attention_backend="xla", num_pages=128,
                     max_num_seqs=8, max_num_batched_tokens=128)
    outs = _greedy(engine, prompts, PARITY_TOKENS, logprobs=2)
    gaps = [[float(np.subtract(*sorted(lp.values(), reverse=True)[:2])) for lp in o.logprobs]
            for o in outs]
    with open(REFERENCE, "w") as f:
        json.dump({"model": "jaxserve.weights.random_init.random_model(seed=0), float32",
                   "computed_on": f"{jax.default_backend()}, jax {jax.__version__}, xla",
                   "prompt_lens": list(PARITY_LENS), "tokens": [o.token_ids for o in outs],
                   "top2_gaps": [[round(g, 6) for g in row] for row in gaps]}, f)
        f.write("\n")
    print(f"wrote {REFERENCE}; smallest top-2 gap {min(min(g) for g in gaps):.2e}")


def parity(args) -> dict:
    from jaxserve.weights.random_init import random_model

    with open(REFERENCE) as f:
        ref = json.load(f)
    loaded = random_model(dtype="float32")
    prompts = parity_prompts(loaded.config.vocab_size)
    result = {}
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        for backend in ("pallas", "xla"):
            engine = _engine(loaded, dtype="float32", attention_backend=backend,
                             pallas_kernels="gpu", num_pages=128, max_num_seqs=8,
                             max_num_batched_tokens=128)
            outs = _greedy(engine, prompts, PARITY_TOKENS)
            mismatched = close_calls = 0
            for out, want, gaps in zip(outs, ref["tokens"], ref["top2_gaps"]):
                for got, exp, gap in zip(out.token_ids, want, gaps):
                    if got != exp:
                        if gap > TIE_GAP:
                            mismatched += 1
                        else:
                            close_calls += 1
                        break  # later tokens follow a different prefix
            result[engine.backend.name] = {"sequences": len(prompts), "mismatched": mismatched,
                                      "diverged_at_a_near_tie": close_calls}
    finally:
        jax.config.update("jax_default_matmul_precision", None)
    result["ok"] = all(r["mismatched"] == 0 for r in result.values() if isinstance(r, dict))
    return result


def bandwidth(args) -> dict:
    kernels, interpret = family()
    rows, context, page, kv_heads, head_dim, group = (
        (4, 256, 16, 2, 128, 4) if args.quick else (64, 2048, 16, 8, 128, 4))
    pages_per_row = context // page
    num_pages = rows * pages_per_row + 1
    key = jax.random.PRNGKey(0)
    k = jax.random.normal(key, (kv_heads, num_pages, page, head_dim), jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 1), k.shape, jnp.bfloat16)
    q = jax.random.normal(jax.random.fold_in(key, 2), (rows, kv_heads * group, head_dim),
                          jnp.bfloat16)
    perm = np.random.default_rng(0).permutation(np.arange(1, num_pages))
    tables = jnp.asarray(perm.reshape(rows, pages_per_row), jnp.int32)
    lens = jnp.full((rows,), context, jnp.int32)
    starts = jnp.arange(rows + 1, dtype=jnp.int32)
    kv_bytes = 2 * rows * context * kv_heads * head_dim * 2
    ours = jax.jit(lambda q, k, v, t, s, qs: kernels.ragged_paged_attention(
        q, k, v, t, s, qs, sm_scale=head_dim ** -0.5, interpret=interpret))
    t_ours = timed(ours, q, k, v, tables, lens, starts)
    copy = jax.jit(lambda x: x + jnp.ones((), x.dtype))  # reads and writes every byte once
    t_copy = timed(copy, k)
    copy_bw = 2 * k.nbytes / t_copy
    result = {"shape": f"{rows} rows x {context} context, {kv_heads} KV heads, G={group}, "
                       f"D={head_dim}, page {page}, bf16",
              "ours_ms": 1e3 * t_ours, "ours_GBps": kv_bytes / t_ours / 1e9,
              "copy_GBps": copy_bw / 1e9, "fraction_of_copy": kv_bytes / t_ours / copy_bw}
    if jax.default_backend() == "gpu":
        try:
            from jax.experimental.pallas.ops.gpu import paged_attention as peer

            peer_fn = jax.jit(lambda q, k, v, t, s: peer.paged_attention(q, k, v, t, s))
            t_peer = timed(peer_fn, q, k, v, tables, lens)
            result.update(peer_ms=1e3 * t_peer, peer_GBps=kv_bytes / t_peer / 1e9)
        except Exception as e:  # the peer's signature moves between jax versions
            result["peer_error"] = f"{type(e).__name__}: {e}"[:300]
    result["ok"] = result["fraction_of_copy"] >= 0.7 or args.quick
    return result


def throughput(args) -> dict:
    from jaxserve.weights.random_init import random_model

    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    loaded = random_model(dtype=dtype)
    levels = (1, 4) if args.quick else (1, 64, 256)
    in_len, out_len = (16, 8) if args.quick else (128, 128)
    engine = _engine(loaded, max_num_seqs=max(levels), max_num_batched_tokens=2048,
                     num_pages=1 + max(levels) * -(-(in_len + out_len) // 16))
    rng = np.random.default_rng(2)
    result = {"backend": engine.backend.name, "dtype": engine.resolved.dtype}
    for n in levels:
        prompts = [[int(t) for t in rng.integers(3, loaded.config.vocab_size, in_len)]
                   for _ in range(n)]
        # A rehearsal compiles exactly the shapes this level meets (cheaper than warming up
        # every bucket); the timed run then compiles nothing (reported).
        t0 = time.perf_counter()
        _greedy(engine, prompts, out_len)
        rehearsal, before = time.perf_counter() - t0, engine.runner.compilations
        t0 = time.perf_counter()
        outs = _greedy(engine, prompts, out_len)
        seconds = time.perf_counter() - t0
        result[f"concurrency_{n}"] = {
            "output_tok_s": sum(len(o.token_ids) for o in outs) / seconds, "seconds": seconds,
            "rehearsal_s": rehearsal,
            "compilations_in_timed_run": engine.runner.compilations - before}
    result["ok"] = True
    return result


def tpu_plan(args) -> dict:
    """No device needed: the default model's warm-up shapes compiled for v5e:2x2 and v6e:2x2
    through libtpu's compile-only topologies (`jaxserve compile --topology`), with each plan."""
    result = {"ok": True}
    small = ["--max_num_seqs=8", "--max_num_batched_tokens=64"] if args.quick else []
    for topology in ("v5e:2x2", "v6e:2x2"):
        proc = subprocess.run([sys.executable, "-m", "jaxserve.cli.main", "compile", "--json",
                               f"--topology={topology}", *small], cwd=ROOT,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                              text=True, timeout=1800)
        if proc.returncode != 0:
            result.update(ok=False, error=f"{topology}: {proc.stderr.strip()[-1000:]}")
            return result
        r = json.loads(proc.stdout)
        d = r["per_device"]
        result[topology] = {k: r[k] for k in ("shapes", "sampling_calls", "num_pages", "fits",
                                              "compile_seconds")}
        result[topology].update(failures=len(r["failures"]), **{
            k: d[k] for k in ("weight_bytes", "kv_pool_bytes", "activation_peak_bytes")})
        result["ok"] &= r["fits"] and not r["failures"]
    return result


STAGES = {"smoke": smoke, "kernels": kernel_tests, "parity": parity, "bandwidth": bandwidth,
          "throughput": throughput, "tpu_plan": tpu_plan}
DEVICE_STAGES = ("smoke", "kernels", "parity", "bandwidth", "throughput")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--stages", default=",".join(DEVICE_STAGES),
                        help=f"of {', '.join(STAGES)}; tpu_plan needs no device")
    parser.add_argument("--quick", action="store_true", help="small shapes (a dry run)")
    parser.add_argument("--kernel_test_timeout", type=int, default=150)
    parser.add_argument("--write_reference", action="store_true")
    args = parser.parse_args()
    if args.write_reference:
        write_reference(args)
        return 0
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "device_check.json")
    report = {}
    for name in args.stages.split(","):
        t0 = time.perf_counter()
        try:
            report[name] = STAGES[name](args)
        except Exception as e:
            report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc()[-2000:]}
        report[name]["seconds"] = round(time.perf_counter() - t0, 1)
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"[{name}] {'ok' if report[name].get('ok') else 'FAILED'} "
              f"({report[name]['seconds']} s)", flush=True)
        if name == "smoke" and not report[name].get("ok"):
            break  # a broken setup: stop after a minute
    print(f"\n{'stage':<12} {'ok':<4} result")
    for name, r in report.items():
        shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                 if k not in ("ok", "traceback", "failed", "devices")}
        print(f"{name:<12} {str(r.get('ok')):<4} {json.dumps(shown, default=str)[:400]}")
    print(f"\nwrote {path}")
    return 0 if all(r.get("ok") for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
