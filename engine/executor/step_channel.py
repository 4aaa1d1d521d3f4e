"""The step channel: each step's input to a tensor-parallel rank, and its
result back, over a Unix socket between the engine and that rank's Ray actor.

Why not a Ray call a step: an actor call's round trip costs ~0.9 ms of host
time on top of the step (a few KB each way, measured by
``benchmarks/ray_overhead.py``), every step, once per rank; the same bytes
over a Unix socket take ~0.07 ms. A decode step of an 8B model on one GPU
takes 5 ms, so the Ray call alone would be a fifth of it. Ray still places,
starts, watches and kills the actors; only the steps take this way.

The rank's side (``StepListener``) listens in a fresh directory only its
user can enter, takes exactly one connection — the engine's — and removes
the socket's name at once, so nothing else can connect afterwards. A frame
is an 8-byte length and a pickle; only the engine, which built the actors,
is ever on the other end (nothing the HTTP side receives is unpickled).

A rank that dies closes its end, so the engine's wait ends at once with
``ChannelClosed``; one that hangs is the engine's step timeout to catch.
A step that raises on the rank answers with the exception, and the rank
goes on listening.
"""

from __future__ import annotations

import os
import pickle
import select
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Callable
from typing import Any

FRAME = struct.Struct("<Q")
ACCEPT_TIMEOUT_S = 60.0  # the engine connects right after asking for the path
FAILURE_GRACE_S = 0.5  # how long a failed step waits to learn that a peer died


class ChannelClosed(ConnectionError):
    """The other end closed the channel (its process ended)."""


class RankError(Exception):
    """What ended a wait on the ranks: rank ``rank`` closed its channel
    (``"closed"``), answered that its step raised (``"failed"``, ``detail``
    the exception as ``"TypeName: message"``), or did not answer in time
    (``"hung"``)."""

    def __init__(self, rank: int, kind: str, detail: str) -> None:
        super().__init__(f"rank {rank} {kind}: {detail}")
        self.rank, self.kind, self.detail = rank, kind, detail


def pack(obj: Any) -> bytes:
    """One frame: ``send_packed`` it to as many ranks as take the same input."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return FRAME.pack(len(data)) + data


def _read_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except ConnectionResetError:  # ended with data unread: killed mid-step, say
            k = 0
        if k == 0:
            raise ChannelClosed("the channel's other end closed it")
        got += k
    return buf


def receive(sock: socket.socket) -> Any:
    """One whole frame, unpickled. Blocks under the socket's own timeout."""
    (size,) = FRAME.unpack(_read_exact(sock, FRAME.size))
    return pickle.loads(_read_exact(sock, size))


# A Unix socket's path must fit in sockaddr_un (108 bytes on Linux, 104 on
# macOS); a deep TMPDIR would not leave room.
MAX_SOCKET_PATH = 100


def socket_path(prefix: str, name: str) -> str:
    """A path for a socket in a fresh directory only this user can enter
    (mode 0700), under the temporary directory, or under /tmp where that
    one's path is too long for a socket."""
    directory = tempfile.mkdtemp(prefix=prefix)
    path = os.path.join(directory, name)
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        os.rmdir(directory)
        path = os.path.join(tempfile.mkdtemp(prefix=prefix, dir="/tmp"), name)
    return path


class StepListener:
    """The rank's end: bound at construction (so the engine can be told the
    path), serving once ``serve`` runs."""

    def __init__(self) -> None:
        self.path = socket_path("fluidserve-step-", "rank.sock")
        self._dir = os.path.dirname(self.path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(self.path)
            self._listener.listen(1)
        except OSError:
            self.close()
            raise

    def serve(self, handle: Callable[[Any], Any]) -> None:
        """Answer each frame with ``("ok", handle(frame))`` or, where
        ``handle`` raised, ``("error", "TypeName: message")``, until the
        engine closes the channel."""
        self._listener.settimeout(ACCEPT_TIMEOUT_S)
        try:
            conn, _ = self._listener.accept()
        finally:
            self.close()  # one engine only: nobody else can connect from here on
        with conn:
            conn.settimeout(None)
            while True:
                try:
                    request = receive(conn)
                except ChannelClosed:
                    return
                try:  # a result that cannot be pickled fails its step too
                    reply = pack(("ok", handle(request)))
                except Exception as exc:  # the engine decides what a failed step means
                    reply = pack(("error", f"{type(exc).__name__}: {exc}"))
                conn.sendall(reply)

    def close(self) -> None:
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class StepLink:
    """The engine's end of one rank's channel."""

    def __init__(self, path: str, timeout_s: float = ACCEPT_TIMEOUT_S) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(path)

    def send_packed(self, frame: bytes, timeout_s: float | None = None) -> None:
        """Raises TimeoutError where the rank takes in less than the frame
        within ``timeout_s`` (a hung rank with its socket's buffer full)."""
        self.sock.settimeout(timeout_s)
        self.sock.sendall(frame)

    def close(self) -> None:
        self.sock.close()


def gather(links: list[StepLink], timeout_s: float) -> list[Any]:
    """Every link's answer, in order, or ``RankError`` for the first rank
    that closed its channel (at once, even while the others still wait, say
    in a collective for it), answered with a failure, or left ``timeout_s``
    pass without answering."""
    results: list[Any] = [None] * len(links)
    pending = {link.sock: rank for rank, link in enumerate(links)}
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        ready = select.select(list(pending), [], [], left)[0] if left > 0 else []
        if not ready:
            raise RankError(min(pending.values()), "hung", f"no answer within {timeout_s:g} s")
        for sock in ready:
            rank = pending.pop(sock)
            # A rank writes its answer whole, so once it is readable the rest
            # follows at once; the deadline still bounds a frame cut short.
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                status, value = receive(sock)
            except ChannelClosed as exc:
                raise RankError(rank, "closed", str(exc)) from None
            except TimeoutError:
                raise RankError(rank, "hung", f"its answer was cut short for {timeout_s:g} s") from None
            if status == "error":
                raise _dead_peer(pending, FAILURE_GRACE_S) or RankError(rank, "failed", value)
            results[rank] = value
    return results


def _dead_peer(pending: dict[socket.socket, int], grace_s: float) -> RankError | None:
    """A rank whose collective failed has most likely lost a peer: the peer
    that closed its channel within ``grace_s`` is the failure to report."""
    deadline = time.monotonic() + grace_s
    while pending and (left := deadline - time.monotonic()) > 0:
        for sock in select.select(list(pending), [], [], left)[0]:
            rank = pending.pop(sock)
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                receive(sock)
            except ChannelClosed:
                return RankError(rank, "closed", "the channel's other end closed it")
            except TimeoutError:
                pass
    return None
