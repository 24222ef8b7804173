"""scan_layers against the unrolled layers (docs/serving.md, scan_layers): for the model on this
host's backend, the compile seconds of one decode shape and one prefill shape of the step (a
fresh compilation cache each process) and the steps' speed (decode tok/s at 1 and 32 rows,
prefill tok/s of a 256-token chunk; the best of --repeats timed runs after an untimed one); and
with --topology, the compile seconds of one step shape for that TPU target (compile-only, the
Pallas TPU backend, bfloat16). One line of JSON per mode. Each mode runs in its own process
(--scan=off / --scan=on), so neither inherits the other's caches:

  python scripts/bench_scan_layers.py --scan=off --attention_backend=cpu
  python scripts/bench_scan_layers.py --scan=on --topology=v6e:2x2
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Model name or path.")
flags.DEFINE_enum("scan", "off", ["off", "on"], "scan_layers.")
flags.DEFINE_string("attention_backend", "cpu", "cpu or xla (this host's runs).")
flags.DEFINE_string("topology", None, "A TPU topology to compile one step shape for instead.")
flags.DEFINE_integer("tpu_tokens", 256, "The TPU step shape's tokens (prefill rows packed).")
flags.DEFINE_integer("repeats", 5, "Timed runs per shape; the best is reported.")


def _tpu(scan: bool) -> dict:
    from jaxserve import backends
    from jaxserve.runtime import abstract, sharding
    from jaxserve.runtime.batch import build_batch, warmup_plan
    from jaxserve.runtime.buckets import Buckets
    from jaxserve.runtime.runner import jitted_step
    from jaxserve.runtime.topology import compile_target, tpu_topology
    from jaxserve.weights.model_config import read_model_config
    import numpy as np

    model = read_model_config(FLAGS.model)
    topology = tpu_topology(FLAGS.topology)
    mesh = sharding.replica_mesh(sharding.make_mesh(1, devices=topology.devices), 0)
    backend = backends.get("pallas-tpu")
    buckets = Buckets.for_engine(64, FLAGS.tpu_tokens, 128, packed=True)
    shape = (0, FLAGS.tpu_tokens, buckets.packed_rows(FLAGS.tpu_tokens))
    batch = build_batch(warmup_plan(shape, buckets, 16), buckets, 16)[0]
    params = abstract.abstract_params(model, mesh, "bfloat16", scan_layers=scan)
    pool = abstract.abstract_pool(model, mesh, 1024, 16, "bfloat16", backend, "bfloat16",
                                  scan_layers=scan)
    step = jitted_step(model, backend, mesh)
    feed = abstract.replicated(np.zeros(buckets.max_sample_rows, np.int32), mesh)
    start = time.perf_counter()
    with compile_target(mesh):
        lowered = step.lower(params, pool=pool, feed=feed, batch=abstract.replicated(
            dataclasses.replace(batch, sampling=None), mesh))
        traced = time.perf_counter() - start
        compiled = lowered.compile()
    m = compiled.memory_analysis()
    return {"topology": FLAGS.topology, "shape": shape, "lower_s": round(traced, 2),
            "compile_s": round(time.perf_counter() - start, 2),
            "temp_bytes": int(m.temp_size_in_bytes)}


def _host(scan: bool) -> dict:
    from jaxserve import backends
    from jaxserve.runtime.buckets import Buckets
    from jaxserve.runtime.runner import ModelRunner
    from jaxserve.weights import load_model

    loaded = load_model(FLAGS.model, lazy=True)
    backend = backends.get(FLAGS.attention_backend)
    runner = ModelRunner(loaded.config, loaded.params, num_pages=512, page_size=16,
                         backend=backend, scan_layers=scan)
    buckets = Buckets.for_engine(64, 256, 128, query_block=backend.query_block,
                                 packed=backend.packed)
    shapes = {"decode_1": (0, 1, 1), "decode_32": (0, 32, 32), "prefill_256": (0, 256, 1)}
    if not backend.packed:
        shapes = {"decode_1": (1, 0, 0), "decode_32": (32, 0, 0), "prefill_256": (0, 256, 1)}
    out = {"backend": backend.name}
    for name, shape in shapes.items():
        batch, rows = runner._shape_batch(shape, buckets)
        start = time.perf_counter()
        runner.step_temp_bytes(shape, buckets)  # lowers and compiles, runs nothing
        if name != "decode_32":
            out[f"compile_{name}_s"] = round(time.perf_counter() - start, 2)
        runner.execute(batch, rows)  # the jitted call's own compile, from the cache above
        times = []
        for _ in range(FLAGS.repeats):
            start = time.perf_counter()
            runner.execute(batch, rows)
            times.append(time.perf_counter() - start)
        tokens = batch.token_ids.shape[0] if name.startswith("prefill") else int(name[7:])
        out[f"{name}_tok_s"] = round(tokens / min(times), 1)
    return out


def main(argv):
    del argv
    scan = FLAGS.scan == "on"
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # fresh: compiles are compiles
        os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="scan-bench-")
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    result = _tpu(scan) if FLAGS.topology else _host(scan)
    print(json.dumps({"model": FLAGS.model, "scan_layers": FLAGS.scan, **result}))


if __name__ == "__main__":
    app.run(main)
