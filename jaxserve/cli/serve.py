"""`jaxserve serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

import uvicorn
from absl import flags

from jaxserve.cli import engine_flags  # noqa: F401  (defines the engine flags)

flags.DEFINE_string("host", "127.0.0.1", "Address to bind (loopback unless told otherwise).")
flags.DEFINE_integer("port", 8000, "TCP port.")
flags.DEFINE_multi_string("api_key", None,
                          "Require 'Authorization: Bearer <key>' on /v1, /debug, /metrics and "
                          "the docs; repeat for several keys, each its own tenant (default: env "
                          "JAXSERVE_API_KEY).")
flags.DEFINE_string("api_key_file", None,
                    "A file of 'key tenant' lines ('#' at a line's start: a comment): each "
                    "tenant's prefix-cache salt is derived from its name, so tenants share no "
                    "cached pages. A file with no key refuses to start.")
flags.DEFINE_bool("public_metrics", False,
                  "With keys, leave /metrics open (by default it needs a key too: it shows "
                  "every tenant's traffic).")
flags.DEFINE_float("shutdown_timeout", 30.0,
                   "On SIGINT/SIGTERM: stop accepting, let live requests finish for this many "
                   "seconds, then fail the rest with errors and exit 0. A second signal exits "
                   "at once.")
flags.DEFINE_integer("max_body_bytes", 4 * 1024 * 1024, "Largest request body accepted.")
flags.DEFINE_integer("max_tokens_limit", None,
                     "Largest max_tokens accepted (default: the context).")
flags.DEFINE_multi_string("served_model_name", None,
                          "Model name(s) clients use (default: --model).")
flags.DEFINE_enum("tool_call_parser", "auto", ["auto", "hermes", "llama3_json", "mistral",
                                               "pythonic"],
                  "How tool calls are read from the text when a request offers tools with "
                  "tool_choice 'auto' (or none): auto = the format the chat template's markup "
                  "shows, hermes when it shows none.")
flags.DEFINE_enum("reasoning_parser", "none", ["none", "qwen3", "deepseek_r1"],
                  "Split <think>...</think> reasoning into message.reasoning_content.")
flags.DEFINE_enum("compile_warmup", "default", ["none", "default", "full"],
                  "Compile step shapes before taking traffic (/health/ready answers 503 "
                  "meanwhile): default = every shape of a packed backend (cpu), the pure decode "
                  "and prefill buckets of the others; full = every bucket combination; none = "
                  "compile on first use.")
flags.DEFINE_enum("log_level", "info", ["critical", "error", "warning", "info", "debug"],
                  "uvicorn log level.")
FLAGS = flags.FLAGS


def _warmed_up(future) -> None:
    if future.exception() is not None:
        print(f"jaxserve serve: warm-up failed: {future.exception()!r}", file=sys.stderr)
        return
    report = future.result()
    print(f"jaxserve serve: ready: compiled {report['compilations']} step shapes in "
          f"{report['seconds']:.1f} s", file=sys.stderr)


class DrainingServer(uvicorn.Server):
    """The first SIGINT/SIGTERM drains (no new requests; live ones get shutdown_timeout seconds,
    then OpenAI-shaped errors); a second fails what is left and exits at once."""

    def __init__(self, config, aengine, shutdown_timeout: float):
        super().__init__(config)
        self.aengine, self.shutdown_timeout = aengine, shutdown_timeout

    @contextlib.contextmanager
    def capture_signals(self):
        """SIGINT and SIGTERM go to handle_exit while serving; unlike uvicorn's own, the signal
        is not raised again afterwards: a drained shutdown exits 0."""
        original = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame):
        if not self.should_exit:
            print(f"jaxserve serve: shutting down, waiting up to {self.shutdown_timeout:g} s for "
                  "live requests (a second signal exits at once)", file=sys.stderr)
            self.aengine.drain(self.shutdown_timeout)
            self.should_exit = True
        else:  # every live request answered now; uvicorn then closes its idle connections
            self.aengine.abort_all("the server is shutting down")


def main(argv):
    del argv

    from jaxserve.config import EngineConfig
    from jaxserve.engine import make_engine
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.server import ServerConfig, build_app
    from jaxserve.server.app import resolve_api_keys

    try:
        keys = resolve_api_keys(FLAGS.api_key, FLAGS.api_key_file,
                                os.environ.get("JAXSERVE_API_KEY"))
        server_config = ServerConfig(
            api_keys=keys, public_metrics=FLAGS.public_metrics,
            max_body_bytes=FLAGS.max_body_bytes, max_tokens_limit=FLAGS.max_tokens_limit,
            tool_call_parser=FLAGS.tool_call_parser, reasoning_parser=FLAGS.reasoning_parser,
            served_model_names=tuple(FLAGS.served_model_name) if FLAGS.served_model_name else None)
        engine = make_engine(EngineConfig.from_options(**engine_flags.engine_options()))
    except (ValueError, OSError) as e:
        print(f"jaxserve serve: error: {e}", file=sys.stderr)
        return 2
    aengine = AsyncEngine(engine)
    if FLAGS.compile_warmup != "none":  # in the background: /health/ready says so meanwhile
        aengine.warm_up(full=FLAGS.compile_warmup == "full").add_done_callback(_warmed_up)
    app = build_app(aengine, server_config)
    config = uvicorn.Config(app, host=FLAGS.host, port=FLAGS.port, log_level=FLAGS.log_level,
                            timeout_graceful_shutdown=FLAGS.shutdown_timeout + 5)
    DrainingServer(config, aengine, FLAGS.shutdown_timeout).run()
    for sig in (signal.SIGINT, signal.SIGTERM):  # one more while winding down: exit at once
        signal.signal(sig, lambda *_: os._exit(0))
    aengine.shutdown()
    return 0
