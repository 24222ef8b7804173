"""`jaxserve serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn)."""

from __future__ import annotations

import os
import sys

from absl import flags

from jaxserve.cli import engine_flags  # noqa: F401  (defines the engine flags)

flags.DEFINE_string("host", "127.0.0.1", "Address to bind (loopback unless told otherwise).")
flags.DEFINE_integer("port", 8000, "TCP port.")
flags.DEFINE_string("api_key", None, "Require 'Authorization: Bearer <key>' on /v1 and /debug "
                    "(default: env JAXSERVE_API_KEY).")
flags.DEFINE_integer("max_body_bytes", 4 * 1024 * 1024, "Largest request body accepted.")
flags.DEFINE_integer("max_tokens_limit", None,
                     "Largest max_tokens accepted (default: the context).")
flags.DEFINE_multi_string("served_model_name", None,
                          "Model name(s) clients use (default: --model).")
flags.DEFINE_enum("compile_warmup", "none", ["none", "default", "full"],
                  "Compile step shapes before serving: default = pure decode and prefill buckets; "
                  "full = every bucket combination (slow on CPU).")
flags.DEFINE_enum("log_level", "info", ["critical", "error", "warning", "info", "debug"],
                  "uvicorn log level.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    import uvicorn

    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine
    from jaxserve.server import ServerConfig, build_app

    try:
        server_config = ServerConfig(
            api_key=FLAGS.api_key or os.environ.get("JAXSERVE_API_KEY") or None,
            max_body_bytes=FLAGS.max_body_bytes, max_tokens_limit=FLAGS.max_tokens_limit,
            served_model_names=tuple(FLAGS.served_model_name) if FLAGS.served_model_name else None)
        engine = LLMEngine(EngineConfig.from_options(**engine_flags.engine_options()))
    except ValueError as e:
        print(f"jaxserve serve: error: {e}", file=sys.stderr)
        return 2
    if FLAGS.compile_warmup != "none":
        report = engine.warmup(full=FLAGS.compile_warmup == "full")
        print(f"jaxserve serve: compiled {report['compilations']} step shapes in "
              f"{report['seconds']:.1f} s", file=sys.stderr)
    app = build_app(engine, server_config)
    uvicorn.run(app, host=FLAGS.host, port=FLAGS.port, log_level=FLAGS.log_level)
    return 0
