"""`jaxserve serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn). Its flags are
ServingConfig's fields (jaxserve/config/serving.py) and the engine's."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
import traceback

import uvicorn
from absl import flags

from jaxserve.cli import engine_flags  # defines the engine flags
from jaxserve.config.serving import ProtocolConfig, ServingConfig
from jaxserve.server import listen
from jaxserve.server.health import StartingApp

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
    then OpenAI-shaped errors); a second fails what is left and exits at once. Before the
    engine is built (aengine None) a signal just exits."""

    def __init__(self, config, shutdown_timeout: float):
        super().__init__(config)
        self.aengine, self.shutdown_timeout = None, shutdown_timeout

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
        if self.aengine is None:
            self.should_exit = True
        elif not self.should_exit:
            print(f"jaxserve serve: shutting down, waiting up to {self.shutdown_timeout:g} s for "
                  "live requests (a second signal exits at once)", file=sys.stderr)
            self.aengine.drain(self.shutdown_timeout)
            self.should_exit = True
        else:  # every live request answered now; uvicorn then closes its idle connections
            self.aengine.abort_all("the server is shutting down")


def _build(server: DrainingServer, front: StartingApp, engine_config, serving: ServingConfig,
           server_config, failure: list) -> None:
    """In a thread while the socket already answers health: build the engine, start its
    warm-up, then hand the socket to the app. A failure is one line and stops the server."""
    try:
        from jaxserve.engine import make_engine
        from jaxserve.server import AsyncEngine, build_app

        aengine = AsyncEngine(make_engine(engine_config), stall_timeout=serving.stall_timeout,
                              ready_after=serving.ready_after, max_waiting=serving.max_waiting)
        aengine.start()  # uvicorn runs no lifespan (StartingApp): the loop starts here
        if serving.compile_warmup != "none":  # in the background: /health/ready says so
            aengine.warm_up(full=serving.compile_warmup == "full").add_done_callback(_warmed_up)
        server.aengine = aengine
        app = build_app(aengine, server_config)
        # The engine, the model and the imports live as long as the process: left out of every
        # later garbage collection, which stops all threads, the event loop's too (a full one
        # over them held it 0.6 to 2.4 s in the long fuzz). The process's own choice, so here
        # and not in build_app, which tests and notebooks call many times in one process.
        gc.collect()
        gc.freeze()
        front.serve(app)
    except Exception as e:  # noqa: BLE001 - exit 2; a bad model or flag in one line
        if not isinstance(e, (ValueError, OSError)):
            traceback.print_exc()
        print(f"jaxserve serve: error: {e}", file=sys.stderr)
        front.failed(str(e))
        failure.append(e)
        server.should_exit = True


def main(argv):
    del argv

    from jaxserve.config import EngineConfig
    from jaxserve.server import ServerConfig

    try:
        serving = engine_flags.config_of(ServingConfig)
        server_config = ServerConfig.of(serving, engine_flags.config_of(ProtocolConfig),
                                        os.environ.get("JAXSERVE_API_KEY"))
        engine_config = EngineConfig.from_options(**engine_flags.engine_options())
    except (ValueError, OSError) as e:
        print(f"jaxserve serve: error: {e}", file=sys.stderr)
        return 2
    try:  # before the model loads: a port in use is found at once
        sock = listen.bind(serving.host, serving.port)
    except OSError as e:
        print(f"jaxserve serve: error: cannot listen on {serving.host}:{serving.port}: "
              f"{e.strerror or e}", file=sys.stderr)
        return 2
    front = StartingApp()  # /health/live answers from now on; the engine is built meanwhile
    config = uvicorn.Config(front, lifespan="off", log_level=serving.log_level,
                            http=listen.read_timeout_protocol(serving.read_timeout),
                            timeout_graceful_shutdown=serving.shutdown_timeout + 5)
    server, failure = DrainingServer(config, serving.shutdown_timeout), []
    threading.Thread(target=_build, args=(server, front, engine_config, serving, server_config,
                                          failure), name="jaxserve-build", daemon=True).start()
    server.run(sockets=[sock])
    for sig in (signal.SIGINT, signal.SIGTERM):  # one more while winding down: exit at once
        signal.signal(sig, lambda *_: os._exit(0))
    if server.aengine is not None:
        server.aengine.shutdown()
    return 2 if failure else 0
