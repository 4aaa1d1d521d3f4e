"""Running the app on uvicorn with a graceful drain.

On SIGTERM (or the first SIGINT) the server stops accepting connections,
answers new requests on open connections with 503, lets in-flight requests
finish for up to ``drain_timeout`` seconds, stops the engine loop and
returns — so the process exits 0 (stock uvicorn re-raises the signal, which
would make the exit status 143). A second SIGINT forces the exit.

Idle keep-alive connections close at once, TLS ones too: closing a TLS
connection waits for the client's reply to our close_notify, which an idle
client (a pooled connection nobody reads) never sends, and the drain would
then last its whole timeout with no request in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from types import FrameType
from typing import Callable, Iterator

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.auto import AutoHTTPProtocol

logger = logging.getLogger("fluidserve.serve")

# How long the client of an idle TLS connection has to answer our
# close_notify at shutdown before the connection is dropped: a client that
# reads its socket answers in a round trip; asyncio's own wait is 30 s.
TLS_CLOSE_WAIT_S = 1.0


class DrainingHTTP(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol whose shutdown of an idle TLS connection
    drops it once its client has had ``TLS_CLOSE_WAIT_S`` to answer."""

    def shutdown(self) -> None:
        super().shutdown()  # an idle connection closes; one mid-request finishes its response first
        transport: asyncio.Transport = self.transport
        if transport.is_closing() and transport.get_extra_info("sslcontext") is not None:
            self.loop.call_later(TLS_CLOSE_WAIT_S, self._drop_when_written)

    def _drop_when_written(self) -> None:
        """Drop the closing TLS connection once what it holds to send has
        gone (a slow reader keeps the end of its last response); a no-op
        once the client has answered and the connection closed."""
        if self.transport.get_write_buffer_size():
            self.loop.call_later(TLS_CLOSE_WAIT_S, self._drop_when_written)
        else:
            self.transport.abort()


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_drain: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_drain = on_drain

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self._on_signal) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
            return
        if not self.should_exit:
            logger.info("%s received: draining in-flight requests (up to %.0f s)",
                        signal.Signals(sig).name, self.config.timeout_graceful_shutdown or 0)
        self.should_exit = True
        self.on_drain()


def make_server(app: FastAPI, host: str, port: int, *, drain_timeout: float = 30.0,
                log_level: str = "info", access_log: bool = False) -> DrainingServer:
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=access_log,
        timeout_graceful_shutdown=max(1, int(round(drain_timeout))), lifespan="on",
        timeout_keep_alive=30, http=DrainingHTTP,
    )

    def on_drain() -> None:
        app.state.server.state.draining = True

    return DrainingServer(config, on_drain)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 picks a free one (read ``getsockname()``)."""
    # IPPROTO_TCP by name: each accepted socket carries the listener's proto,
    # and asyncio sets TCP_NODELAY only on sockets whose proto says TCP. With
    # proto 0, Nagle's algorithm held a response's body behind its headers
    # until the client's delayed ACK: ~40 ms on every request of a kept-alive
    # connection, which is how the OpenAI client sends them.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
