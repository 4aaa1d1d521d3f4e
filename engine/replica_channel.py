"""The replica channel: requests to a data-parallel replica and its outputs
back, over a Unix socket between the front end and the replica's Ray actor
on the same node.

Why: outputs came back by long polling, one Ray call a poll, and a Ray
call's round trip costs ~0.9 ms of host time; a token that was ready while
the poll's answer was on its way waited for the next poll, and every
request's ``add`` was a call too. Over the socket the replica pushes each
step's outputs as soon as they exist and a request is one frame. Ray still
places, starts, restarts and kills the replicas; ``ready``, ``facts``,
``stats`` and ``shutdown`` stay Ray calls (rare ones), and replicas on
other nodes keep the Ray calls for everything.

Frames are the step channel's (an 8-byte length and a pickle;
engine/executor/step_channel.py), and so is the safety: the replica listens
in a fresh directory only its user can enter, takes one connection, the
front end's, and removes the socket's name at once.

    front → replica   ("add", request_id, prompt, params, klass, waited_s, final_only)
                      ("abort", request_id)
    replica → front   ("added", request_id, None | (exception type, message))
                      ("outputs", tails, stats, unhealthy reason | None)   every step's, or every POLL_S

A replica that dies closes its end: the front's read ends at once with
``ReplicaGone``, as does every ``add`` still waiting for its answer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import shutil
from collections.abc import Awaitable, Callable
from typing import Any

from fluidserve.engine.executor.step_channel import ACCEPT_TIMEOUT_S, FRAME, pack, socket_path

log = logging.getLogger(__name__)


class ReplicaGone(ConnectionError):
    """The replica's end of the channel closed (its process ended)."""


async def read_frame(reader: asyncio.StreamReader) -> Any:
    try:
        (size,) = FRAME.unpack(await reader.readexactly(FRAME.size))
        return pickle.loads(await reader.readexactly(size))
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise ReplicaGone("the replica's channel closed") from exc


async def listen_once(on_connect: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]) -> str:
    """Listen on a fresh socket in a directory of this user's alone; the
    first connection goes to ``on_connect`` and ends the listening, as does
    ``ACCEPT_TIMEOUT_S`` without one. Returns the socket's path."""
    path = socket_path("fluidserve-replica-", "replica.sock")
    directory = os.path.dirname(path)
    taken = False

    def stop_listening() -> None:
        server.close()
        shutil.rmtree(directory, ignore_errors=True)

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal taken
        if taken:  # a second connection that came before the name was gone
            writer.close()
            return
        taken = True
        stop_listening()
        await on_connect(reader, writer)

    try:
        server = await asyncio.start_unix_server(accept, path)
    except OSError:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    asyncio.get_running_loop().call_later(ACCEPT_TIMEOUT_S, lambda: None if taken else stop_listening())
    return path


class ReplicaLink:
    """The front end's end of one replica's channel. One task reads it
    (``next_outputs``); ``add`` and ``abort`` may come from any task of the
    same event loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._adds: dict[str, asyncio.Future] = {}
        self._closed = False

    @classmethod
    async def connect(cls, path: str) -> ReplicaLink:
        reader, writer = await asyncio.open_unix_connection(path)
        return cls(reader, writer)

    async def add(self, request_id: str, prompt: list[int], params: Any, klass: str, waited_s: float,
                  final_only: bool) -> None:
        """Admit a request on the replica; raises what its ``add`` raised
        (ValueError, TypeError, EngineDeadError as themselves), or
        ReplicaGone."""
        if self._closed:
            raise ReplicaGone("the replica's channel is closed")
        answer = self._adds[request_id] = asyncio.get_running_loop().create_future()
        self._writer.write(pack(("add", request_id, prompt, params, klass, waited_s, final_only)))
        try:
            error = await answer
        finally:
            self._adds.pop(request_id, None)
        if error is not None:
            raise _rebuilt(*error)

    def abort(self, request_id: str) -> None:
        if not self._closed:
            self._writer.write(pack(("abort", request_id)))

    async def next_outputs(self) -> tuple[list, Any, str | None]:
        """The replica's next (tails, stats, unhealthy reason), answering
        ``add`` calls met on the way. Raises ReplicaGone."""
        while True:
            frame = await read_frame(self._reader)
            if frame[0] == "outputs":
                return frame[1], frame[2], frame[3]
            answer = self._adds.get(frame[1])
            if answer is not None and not answer.done():
                answer.set_result(frame[2])

    def close(self) -> None:
        """Fail every ``add`` still waiting with ReplicaGone and close."""
        if self._closed:
            return
        self._closed = True
        for answer in self._adds.values():
            if not answer.done():
                answer.set_exception(ReplicaGone("the replica's channel closed"))
        self._writer.close()


def _rebuilt(type_name: str, message: str) -> BaseException:
    """The replica's exception on this side: the ones the front end acts on
    as themselves, anything else as a RuntimeError naming its type."""
    from fluidserve.engine.async_engine import EngineDeadError

    known = {"ValueError": ValueError, "TypeError": TypeError, "EngineDeadError": EngineDeadError}
    cls = known.get(type_name)
    return cls(message) if cls is not None else RuntimeError(f"{type_name}: {message}")


class FrontChannel:
    """The replica's end of one channel: each ``add`` runs as a task of its
    own (admission can wait) and answers when done; outputs go out as
    ``poll`` yields them."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 add: Callable[..., Awaitable[None]], abort: Callable[[str], Awaitable[None]],
                 poll: Callable[[float], Awaitable[tuple]], poll_s: float) -> None:
        self._reader, self._writer = reader, writer
        self._add, self._abort, self._poll, self._poll_s = add, abort, poll, poll_s
        self._pusher: asyncio.Task | None = None

    async def serve(self) -> None:
        """Serve until the front end closes the channel (or ``close``)."""
        self._pusher = asyncio.ensure_future(self._push())
        admissions: set[asyncio.Task] = set()
        try:
            while True:
                try:
                    frame = await read_frame(self._reader)
                except ReplicaGone:
                    return
                if frame[0] == "add":
                    task = asyncio.ensure_future(self._admit(*frame[1:]))
                    admissions.add(task)
                    task.add_done_callback(admissions.discard)
                elif frame[0] == "abort":
                    await self._abort(frame[1])
        finally:
            self.close()

    def close(self) -> None:
        """End the channel now. The pusher is cancelled at once, not at the
        reader's next turn: outputs it took after this would be lost with
        the channel, while another channel's pusher could have sent them."""
        if self._pusher is not None:
            self._pusher.cancel()
        self._writer.close()

    async def _push(self) -> None:
        # A push that fails closes the channel: the front end then takes this
        # replica out of rotation, and back once it has dropped what it held.
        try:
            while True:
                self._writer.write(pack(("outputs", *await self._poll(self._poll_s))))
                await self._writer.drain()
        except ConnectionError:  # the front end went: the read loop ends too
            pass
        except Exception:
            log.exception("replica channel: pushing outputs failed; closing the channel")
        finally:
            self._writer.close()

    async def _admit(self, request_id: str, *args: Any) -> None:
        try:
            await self._add(request_id, *args)
            error = None
        except Exception as exc:  # the front end decides what a refusal means
            error = (type(exc).__name__, str(exc))
        if not self._writer.is_closing():
            self._writer.write(pack(("added", request_id, error)))
