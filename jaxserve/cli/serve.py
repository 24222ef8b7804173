"""`jaxserve serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn). Its flags are
ServingConfig's fields (jaxserve/config/serving.py) and the engine's."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

import uvicorn
from absl import flags

from jaxserve.cli import engine_flags  # defines the engine flags
from jaxserve.config.serving import ProtocolConfig, ServingConfig

engine_flags.define_flags(ServingConfig)
engine_flags.define_flags(ProtocolConfig)
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

    try:
        serving = engine_flags.config_of(ServingConfig)
        server_config = ServerConfig.of(serving, engine_flags.config_of(ProtocolConfig),
                                        os.environ.get("JAXSERVE_API_KEY"))
        engine = make_engine(EngineConfig.from_options(**engine_flags.engine_options()))
    except (ValueError, OSError) as e:
        print(f"jaxserve serve: error: {e}", file=sys.stderr)
        return 2
    aengine = AsyncEngine(engine)
    if serving.compile_warmup != "none":  # in the background: /health/ready says so meanwhile
        aengine.warm_up(full=serving.compile_warmup == "full").add_done_callback(_warmed_up)
    app = build_app(aengine, server_config)
    config = uvicorn.Config(app, host=serving.host, port=serving.port,
                            log_level=serving.log_level,
                            timeout_graceful_shutdown=serving.shutdown_timeout + 5)
    DrainingServer(config, aengine, serving.shutdown_timeout).run()
    for sig in (signal.SIGINT, signal.SIGTERM):  # one more while winding down: exit at once
        signal.signal(sig, lambda *_: os._exit(0))
    aengine.shutdown()
    return 0
