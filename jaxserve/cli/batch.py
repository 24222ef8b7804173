"""`jaxserve batch`: run an OpenAI batch file (JSONL) through one in-process engine."""

from __future__ import annotations

import json
import sys

from absl import flags

from jaxserve.cli import engine_flags  # noqa: F401  (defines the engine flags)

flags.DEFINE_string("input", None, "Input JSONL: custom_id, method, url, body per line.",
                    required=True)
flags.DEFINE_string("output", None, "Output JSONL (results in input order; re-running resumes).",
                    required=True)
flags.DEFINE_integer("max_tokens_limit", None,
                     "Largest max_tokens accepted (default: the context).")
flags.DEFINE_multi_string("served_model_name", None, "Model name(s) bodies may use "
                          "(default: --model).")
flags.DEFINE_bool("progress", True, "Show a tqdm progress bar.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    from jaxserve.batch_file import run_batch
    from jaxserve.config import EngineConfig
    from jaxserve.engine import make_engine
    from jaxserve.server.protocol import ProtocolContext

    try:
        engine = make_engine(EngineConfig.from_options(**engine_flags.engine_options()))
        names = tuple(FLAGS.served_model_name) if FLAGS.served_model_name else None
        ctx = ProtocolContext.for_engine(engine, names, FLAGS.max_tokens_limit)
        summary = run_batch(engine, FLAGS.input, FLAGS.output, ctx=ctx, progress=FLAGS.progress)
    except (ValueError, OSError) as e:
        print(f"jaxserve batch: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"output": FLAGS.output, **summary.__dict__}))
    return 0
