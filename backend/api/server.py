"""Running the app with uvicorn: in the foreground (``serve``) or in a thread (tests, embedding)."""
from __future__ import annotations

import socket
import threading
import time

CLIENT_TIMEOUT_S = 60.0


def slow_client_protocol(timeout_s: float = CLIENT_TIMEOUT_S):
    """uvicorn's HTTP protocol, but a client gets ``timeout_s`` to send a request's headers (on a new
    connection, or after a keep-alive pause); one that trickles them in (slowloris) is disconnected.
    uvicorn itself only times out idle keep-alive connections. The body's own bound is BodyLimit's."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class SlowClientTimeout(AutoHTTPProtocol):
        _header_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the first bytes of the next request on a kept-alive connection
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # the headers are in: the request is the app's now

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return SlowClientTimeout


def serve(app, host: str = "127.0.0.1", port: int = 7860, log_level: str = "info", on_exit=(),
          client_timeout: float = CLIENT_TIMEOUT_S) -> None:
    """Serve in the foreground until SIGINT/SIGTERM, then return (so callers' cleanup runs).

    ``on_exit``: callables run on the server's event loop as soon as the signal arrives, to end
    the requests that would otherwise stay open (a wait for a job, a browser tab's event stream):
    uvicorn gives open connections ``timeout_graceful_shutdown`` seconds, then cancels them and
    logs each one's CancelledError as a traceback."""
    import asyncio
    import signal
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:  # the first signal; a second one force-quits as usual
                try:
                    loop = asyncio.get_running_loop()  # a signal handler runs in the loop's thread
                except RuntimeError:  # not serving yet
                    loop = None
                for callback in on_exit:
                    loop.call_soon_threadsafe(callback) if loop else callback()
            super().handle_exit(sig, frame)

    def _stop(signum, frame):
        raise SystemExit(0)

    # uvicorn shuts down gracefully on SIGTERM, then re-raises it under the handler it found:
    # ours turns that into SystemExit, so `finally:` blocks (stopping the worker) still run.
    previous = signal.signal(signal.SIGTERM, _stop) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                              http=slow_client_protocol(client_timeout))).run()
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class ThreadedServer:
    """uvicorn in a background thread; ``stop()`` shuts it down."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.host = host
        self.port = port or free_port(host)
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level=log_level))
        self.thread = threading.Thread(target=self.server.run, name="lora-studio-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ThreadedServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def start_in_thread(app, host: str = "127.0.0.1", port: int = 0) -> ThreadedServer:
    return ThreadedServer(app, host, port).start()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
