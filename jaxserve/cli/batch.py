"""`jaxserve batch`: run an OpenAI batch file (JSONL) through one in-process engine, or spread it
over Ray replicas (--ray_replicas; jaxserve.integrations.ray, imported only then)."""

from __future__ import annotations

import json
import sys

from absl import flags

from jaxserve.cli import engine_flags  # defines the engine flags
from jaxserve.config.serving import ProtocolConfig

flags.DEFINE_string("input", None, "Input JSONL: custom_id, method, url, body per line.",
                    required=True)
flags.DEFINE_string("output", None, "Output JSONL (results in input order; re-running resumes).",
                    required=True)
flags.DEFINE_bool("progress", True, "Show a tqdm progress bar.")
# Rows are read as serve reads request bodies: the same options (ProtocolConfig's fields).
engine_flags.define_flags(ProtocolConfig)
flags.DEFINE_integer("ray_replicas", 0, "Spread the file over this many Ray actors, each an "
                     "engine with its own devices (the engine flags apply per replica); 0: one "
                     "engine in this process. Needs the ray extra.", lower_bound=0)
flags.DEFINE_string("ray_address", None, "Ray cluster to join (with --ray_replicas); default: "
                    "start a local one for the run.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    from jaxserve.batch_file import run_batch
    from jaxserve.config import EngineConfig
    from jaxserve.engine import make_engine
    from jaxserve.server.protocol import ProtocolContext

    if FLAGS.ray_address and not FLAGS.ray_replicas:
        print("jaxserve batch: error: --ray_address needs --ray_replicas", file=sys.stderr)
        return 2
    try:
        context = engine_flags.config_of(ProtocolConfig).context_options()
        if FLAGS.ray_replicas:
            return _run_on_ray(context)
        engine = make_engine(EngineConfig.from_options(**engine_flags.engine_options()))
        ctx = ProtocolContext.for_engine(engine, **context)
        summary = run_batch(engine, FLAGS.input, FLAGS.output, ctx=ctx, progress=FLAGS.progress)
    except (ValueError, OSError) as e:
        print(f"jaxserve batch: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"output": FLAGS.output, **summary.__dict__}))
    return 0


def _run_on_ray(context: dict) -> int:
    from jaxserve.config import EngineConfig
    from jaxserve.tools import MissingExtra

    options = engine_flags.engine_options()
    EngineConfig.from_options(**options)  # bad options fail here, not in every replica
    try:
        from jaxserve.integrations.ray import RayBatchError, run_batch_on_ray
    except MissingExtra as e:
        print(f"jaxserve batch: error: {e}", file=sys.stderr)
        return 2
    try:
        summary = run_batch_on_ray(options, FLAGS.input, FLAGS.output,
                                   replicas=FLAGS.ray_replicas, address=FLAGS.ray_address,
                                   progress=FLAGS.progress, **context)
    except RayBatchError as e:
        print(f"jaxserve batch: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"output": FLAGS.output, **summary.__dict__}))
    return 0
