"""`jaxserve compile`: the engine's shapes compiled ahead of time (engine/aot.py).

  --topology v6e:2x2   compile for that TPU topology from any x86 machine with libtpu (no TPU,
                       no weights: a config.json alone will do) and print the memory plan per
                       device and each step shape's estimated cost beside its roofline
                       (engine/roofline.py; --cost=false leaves it out); a model that does not
                       fit is refused (exit 1). A line per executable goes to stderr.
  (no --topology)      build the engine on this host's backend and warm it up, so its compiles
                       land in the persistent compilation cache that `serve`, `generate`,
                       `batch` and `LLM` load from (--cache_dir, or JAX_COMPILATION_CACHE_DIR)

With --topology and --cache_dir the TPU executables are written to that cache as a TPU host with
the same libtpu and JAX would look them up; loading them on a real TPU is untested (no TPU was
lent when this was written). The engine's flags apply (--tensor_parallel_size, --dtype,
--kv_cache_dtype, --quantization, --max_num_seqs, --max_num_batched_tokens, --page_size,
--memory_utilization, ...); on a TPU target dtype auto is bfloat16 and the attention the Pallas
TPU kernels. Bad flags: one line, exit 2.
"""

from __future__ import annotations

import json
import sys

from absl import flags

from jaxserve.cli import engine_flags

flags.DEFINE_string("topology", None,
                    "A TPU topology in JAX's names (v5e:2x2, v6e:2x2, v6e:2x4, v5p:2x2x1, ...): "
                    "compile for it from this machine (libtpu, no TPU, no weights) and plan its "
                    "memory. With --cache_dir its executables are written there for a TPU host "
                    "with the same libtpu and JAX; loading them on a real TPU is untested (no "
                    "TPU has been lent). Default: this host's backend, warmed into the "
                    "compilation cache that serve, generate, batch and LLM load from.")
flags.DEFINE_bool("json", False, "Print one JSON object instead of a table.")
flags.DEFINE_integer("compile_threads", 2, "Executables compiled at once (--topology).")
flags.DEFINE_bool("cost", True, "With --topology: the roofline report of every step shape (XLA's "
                  "cost model beside the necessary flops and bytes at the chip's peaks; a "
                  "scanned step adds two small unscanned compiles per shape). Estimates, not "
                  "measurements.")
flags.DEFINE_alias("cache_dir", "compilation_cache_dir")
FLAGS = flags.FLAGS


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GiB"


def _table(report: dict) -> str:
    d = report["per_device"] or {}
    lines = [f"{report['topology']} ({report['device_kind']}, {_gib(report['hbm_bytes_per_device'])}"
             f" HBM per device), tensor_parallel_size {report['tensor_parallel_size']}, "
             f"{report['dtype']} weights, {report['kv_cache_dtype']} KV, "
             f"{report['attention_backend']}",
             f"  compiled        {report['shapes']} shapes + {report['sampling_calls']} sampling "
             f"calls in {report['compile_seconds']:.1f} s, {len(report['failures'])} failed"]
    if d:
        lines += [f"  {k:<15} {_gib(d[k + '_bytes'])}" for k in
                  ("budget", "weight", "activation_peak", "runtime", "margin", "kv_pool")]
        lines.append(f"  num_pages       {report['num_pages']} of {report['page_size']} tokens")
    lines += [f"  FAILED {f['shape']}: {f['error']}" for f in report["failures"]]
    return "\n".join(lines + _cost_table(report.get("cost")))


def _cost_table(cost: dict | None) -> list[str]:
    """The roofline report's lines: per step shape, XLA's estimate beside the roofline."""
    if not cost or "steps" not in cost:
        return [f"  cost: {cost['error']}"] if cost else []
    chip = cost["chip"]
    lines = [f"  estimated cost per step ({cost['counted_from']}; {chip['flops_per_s'] / 1e12:.0f}"
             f" TFLOP/s, {chip['hbm_bytes_per_s'] / 1e9:.0f} GB/s; compiler estimates, not "
             "measurements)",
             "    tokens  rows  pages   GB accessed  GB needed  ratio   est. ms  roofline ms"]
    for s in cost["steps"]:
        lines.append(f"    {s['tokens']:>6} {s['rows']:>5} {s['pages_per_row']:>6} "
                     f"{s['bytes_accessed'] / 1e9:>12.3f} {s['necessary_bytes'] / 1e9:>10.3f} "
                     f"{s['bytes_ratio']:>6.2f} {s['estimated_seconds'] * 1e3:>9.3f} "
                     f"{s['roofline_seconds'] * 1e3:>12.3f}")
    for kind, t in cost["throughput"].items():
        size = f"{t['rows']} rows" if kind == "decode" else f"{t['tokens']} tokens"
        lines.append(f"  {kind:<8} {t['tokens_per_s']:.0f} tok/s estimated "
                     f"({t['roofline_tokens_per_s']:.0f} at the roofline), {size} at context "
                     f"{t['context']}")
    return lines


def main(argv):
    del argv
    from jaxserve.config import EngineConfig
    from jaxserve.engine import aot

    try:
        config = EngineConfig.from_options(**engine_flags.engine_options())
        if FLAGS.topology is None:
            result = aot.warm_host_cache(config)
        else:
            print(f"compiling for {FLAGS.topology} (minutes for a large "
                  "model; a line per executable)", file=sys.stderr, flush=True)
            report = aot.compile_for_topology(
                config, FLAGS.topology, FLAGS.compile_threads, cost=FLAGS.cost,
                progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True))
            result = report.as_dict()
    except ValueError as e:  # bad flags or model: one line
        print(f"jaxserve compile: error: {e}", file=sys.stderr)
        return 2
    if FLAGS.json:
        print(json.dumps(result))
    elif FLAGS.topology is None:
        print(f"{result['shapes']} shapes warmed on {result['backend']} in "
              f"{result['compile_seconds']:.1f} s ({result['compilations']} compiled, the rest "
              f"loaded); cache {result['cache_dir']}: {result['cache_files']} files")
    else:
        print(_table(result))
        if not report.fits:
            print(f"jaxserve compile: error: {report.refusal()}", file=sys.stderr)
            return 1
        if report.failures:
            return 1
    return 0
