"""`jaxserve batch`: run an OpenAI batch file (JSONL) through one in-process engine, or spread it
over Ray replicas (--ray_replicas; jaxserve.integrations.ray, imported only then)."""

from __future__ import annotations

import json
import sys

from absl import flags

from jaxserve.cli import engine_flags  # noqa: F401  (defines the engine flags)
from jaxserve.config.serving import REASONING_PARSERS, TOOL_CALL_PARSERS

flags.DEFINE_string("input", None, "Input JSONL: custom_id, method, url, body per line.",
                    required=True)
flags.DEFINE_string("output", None, "Output JSONL (results in input order; re-running resumes).",
                    required=True)
flags.DEFINE_integer("max_tokens_limit", None,
                     "Largest max_tokens accepted (default: the context).")
flags.DEFINE_multi_string("served_model_name", None, "Model name(s) bodies may use "
                          "(default: --model).")
flags.DEFINE_bool("progress", True, "Show a tqdm progress bar.")
# Chat rows with tools or thoughts are read as serve reads them (the same choices).
flags.DEFINE_enum("tool_call_parser", "auto", TOOL_CALL_PARSERS, "As serve's: how tool calls are "
                  "read from chat rows that offer tools with tool_choice 'auto' (or none).")
flags.DEFINE_enum("reasoning_parser", "none", REASONING_PARSERS, "As serve's: split "
                  "<think>...</think> into message.reasoning_content.")
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

    names = tuple(FLAGS.served_model_name) if FLAGS.served_model_name else None
    if FLAGS.ray_address and not FLAGS.ray_replicas:
        print("jaxserve batch: error: --ray_address needs --ray_replicas", file=sys.stderr)
        return 2
    try:
        parsers = {"tool_call_parser": FLAGS.tool_call_parser,
                   "reasoning_parser": FLAGS.reasoning_parser}
        if FLAGS.ray_replicas:
            return _run_on_ray(names, parsers)
        engine = make_engine(EngineConfig.from_options(**engine_flags.engine_options()))
        ctx = ProtocolContext.for_engine(engine, names, FLAGS.max_tokens_limit, **parsers)
        summary = run_batch(engine, FLAGS.input, FLAGS.output, ctx=ctx, progress=FLAGS.progress)
    except (ValueError, OSError) as e:
        print(f"jaxserve batch: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"output": FLAGS.output, **summary.__dict__}))
    return 0


def _run_on_ray(names, parsers: dict) -> int:
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
                                   progress=FLAGS.progress, model_names=names,
                                   max_tokens_limit=FLAGS.max_tokens_limit, **parsers)
    except RayBatchError as e:
        print(f"jaxserve batch: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"output": FLAGS.output, **summary.__dict__}))
    return 0
