"""Run the app under uvicorn: drain on SIGTERM/SIGINT, exit non-zero if the model fails to load."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

import uvicorn

from jserve.engine.args import EngineArgs
from jserve.heap import freeze_startup_objects
from jserve.server.app import ServerSettings, build_app
from jserve.server.async_engine import AsyncEngine, EngineState

log = logging.getLogger("jserve")

# Requests still in flight this long before the shutdown timeout are ended by the engine, so their streams
# close with an error event; uvicorn, at the timeout, would cut them like a dropped connection.
ABORT_MARGIN_S = 1.0


class DrainingServer(uvicorn.Server):
    """On a stop signal, /health turns 503 and new requests are refused while those in flight finish."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        self.engine.begin_drain(abort_after=max(0.0, self.config.timeout_graceful_shutdown - ABORT_MARGIN_S))
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        """As uvicorn's, minus re-raising the signal after shutdown: a drained server exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(engine_args: EngineArgs, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000,
          shutdown_timeout: float = 30.0) -> int:  # fmt: skip
    """Serve until stopped; returns the process exit code."""
    app = build_app(engine_args, settings)
    engine: AsyncEngine = app.state.engine
    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", timeout_graceful_shutdown=shutdown_timeout, access_log=False
    )
    server = DrainingServer(config, engine)

    def failed() -> None:
        server.should_exit = True

    def ready() -> None:  # this process serves the one engine for its life: what start-up built stays
        log.info("Froze %d start-up objects out of the garbage collector's scans", freeze_startup_objects())

    engine.on_failure, engine.on_ready = failed, ready
    log.info(
        "Serving '%s' on http://%s:%d (loading the model in the background)", settings.served_model_name, host, port
    )
    server.run()
    return 1 if engine.state is EngineState.FAILED else 0
