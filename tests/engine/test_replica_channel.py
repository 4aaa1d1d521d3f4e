"""The replica channel between the data-parallel front end and a replica,
over a real Unix socket, with a stand-in replica whose ``add``, ``abort``
and ``poll`` behave as the engine's do: admissions answered (refusals as
the front end's own exceptions), outputs pushed as they come, aborts
delivered, a replica that goes failing every waiting call at once, and
nobody but the first front end reaching the replica."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import socket
import stat
import time

import pytest

from fluidserve.engine.async_engine import EngineDeadError
from fluidserve.engine.replica_channel import FrontChannel, ReplicaGone, ReplicaLink, listen_once

pytestmark = pytest.mark.timeout(30)


class StandIn:
    """A replica's methods: ``add`` refuses some prompts as the engine
    does, or waits for a release (admission under load); each admitted
    request yields one output through ``poll``."""

    def __init__(self) -> None:
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.aborted: list[str] = []
        self.release = asyncio.Event()

    async def add(self, request_id, prompt, params, klass, waited_s, final_only=False) -> None:
        if prompt == ["bad"]:
            raise ValueError("prompt: not a token id")
        if prompt == ["dead"]:
            raise EngineDeadError("engine loop died")
        if prompt == ["other"]:
            raise KeyError("no such thing")
        if prompt == ["wait"]:
            await self.release.wait()
        await self.outbox.put((request_id, params, klass, final_only))

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def poll(self, timeout: float):
        if self.aborted == ["break the engine"]:
            raise RuntimeError("the engine's poll broke")
        try:
            out = [await asyncio.wait_for(self.outbox.get(), timeout)]
        except asyncio.TimeoutError:
            out = []
        return out, {"stats": len(out)}, None


async def connected(replica: StandIn) -> tuple[ReplicaLink, str]:
    path = await listen_once(lambda r, w: FrontChannel(r, w, add=replica.add, abort=replica.abort,
                                                       poll=replica.poll, poll_s=0.05).serve())
    return await ReplicaLink.connect(path), path


async def next_nonempty(link: ReplicaLink):
    while True:
        outputs, stats, unhealthy = await link.next_outputs()
        if outputs:
            return outputs, stats, unhealthy


def test_requests_are_admitted_and_their_outputs_pushed():
    async def scenario():
        replica = StandIn()
        link, _ = await connected(replica)
        reader = asyncio.ensure_future(next_nonempty(link))
        await link.add("r1", [1, 2], {"temperature": 0}, "online", 0.0, True)
        outputs, stats, unhealthy = await reader
        assert outputs == [("r1", {"temperature": 0}, "online", True)]
        assert stats == {"stats": 1} and unhealthy is None
        link.abort("r1")
        for _ in range(100):
            if replica.aborted:
                break
            await asyncio.sleep(0.01)
        assert replica.aborted == ["r1"]
        link.close()

    asyncio.run(scenario())


def test_a_refused_request_raises_the_front_ends_own_exception():
    async def scenario():
        link, _ = await connected(StandIn())
        reader = asyncio.ensure_future(_drain(link))  # the reader answers the adds
        with pytest.raises(ValueError, match="prompt: not a token id"):
            await link.add("a", ["bad"], None, "online", 0.0, False)
        with pytest.raises(EngineDeadError, match="engine loop died"):
            await link.add("b", ["dead"], None, "online", 0.0, False)
        with pytest.raises(RuntimeError, match="KeyError"):
            await link.add("c", ["other"], None, "online", 0.0, False)
        await link.add("d", [1], None, "online", 0.0, False)  # and the channel serves on
        reader.cancel()
        link.close()

    asyncio.run(scenario())


async def _drain(link: ReplicaLink) -> None:
    while True:
        await link.next_outputs()


def test_a_replica_whose_outputs_cannot_be_taken_closes_its_channel(caplog):
    """Its engine's poll raised: the replica says so in its log and closes
    the channel, which the front end takes for the replica going."""
    async def scenario():
        replica = StandIn()
        link, _ = await connected(replica)
        link.abort("break the engine")
        with pytest.raises(ReplicaGone):
            await asyncio.wait_for(_drain(link), 5)
        link.close()

    with caplog.at_level("ERROR", logger="fluidserve.engine.replica_channel"):
        asyncio.run(scenario())
    assert "pushing outputs failed" in caplog.text and "the engine's poll broke" in caplog.text


def _replica_process(paths) -> None:
    async def main() -> None:
        replica = StandIn()
        paths.put(await listen_once(lambda r, w: FrontChannel(r, w, add=replica.add, abort=replica.abort,
                                                              poll=replica.poll, poll_s=0.05).serve()))
        await asyncio.Event().wait()

    asyncio.run(main())


def test_a_replica_that_dies_fails_its_waiting_admission_and_the_reader_at_once():
    ctx = multiprocessing.get_context("spawn")
    paths = ctx.Queue()
    proc = ctx.Process(target=_replica_process, args=(paths,), daemon=True)
    proc.start()

    async def scenario():
        link = await ReplicaLink.connect(paths.get(timeout=30))
        reader = asyncio.ensure_future(_drain(link))
        waiting = asyncio.ensure_future(link.add("w", ["wait"], None, "online", 0.0, False))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # admission still pending on the replica
        proc.kill()
        started = time.monotonic()
        with pytest.raises(ReplicaGone):
            await asyncio.wait_for(reader, 5)
        assert time.monotonic() - started < 2
        link.close()  # what the front end does on ReplicaGone: the waiting add fails with it
        with pytest.raises(ReplicaGone):
            await asyncio.wait_for(waiting, 5)
        with pytest.raises(ReplicaGone):
            await link.add("late", [1], None, "online", 0.0, False)

    try:
        asyncio.run(scenario())
    finally:
        proc.kill()
        proc.join(5)


def test_only_the_first_front_end_reaches_the_replica():
    async def scenario():
        link, path = await connected(StandIn())
        reader = asyncio.ensure_future(_drain(link))
        await link.add("r", [1], None, "online", 0.0, False)  # answered: the replica has taken the connection
        assert not os.path.exists(path)  # the name is gone once the front end is in
        with pytest.raises(OSError), socket.socket(socket.AF_UNIX) as other:
            other.connect(path)
        reader.cancel()
        link.close()

    asyncio.run(scenario())


def test_the_listening_directory_is_this_users_alone():
    async def scenario():
        path = await listen_once(lambda r, w: asyncio.sleep(0))
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        _, writer = await asyncio.open_unix_connection(path)
        writer.close()

    asyncio.run(scenario())


def test_an_output_made_as_a_channel_ends_goes_out_on_the_next_one():
    """The replica ends its channel (it drops what it held, or a new front
    end connection replaces it): its pusher stops at once, so an output made
    in the same turn waits for the next channel instead of being lost with
    the old one."""
    async def scenario():
        replica = StandIn()
        channels: list[FrontChannel] = []

        async def serve(reader, writer):
            channels.append(FrontChannel(reader, writer, add=replica.add, abort=replica.abort,
                                         poll=replica.poll, poll_s=0.05))
            await channels[-1].serve()

        old = await ReplicaLink.connect(await listen_once(serve))
        reader = asyncio.ensure_future(next_nonempty(old))  # it answers the add too
        await old.add("r1", [1], {}, "online", 0.0, False)
        assert (await reader)[0] == [("r1", {}, "online", False)]
        await asyncio.sleep(0.01)  # the pusher waits for the next output
        channels[0].close()
        replica.outbox.put_nowait(("r2", {}, "online", False))
        seen = []
        with pytest.raises(ReplicaGone):
            while True:
                seen += (await old.next_outputs())[0]
        assert seen == []
        new = await ReplicaLink.connect(await listen_once(serve))
        outputs, _, _ = await asyncio.wait_for(next_nonempty(new), 5)
        assert outputs == [("r2", {}, "online", False)]
        new.close()

    asyncio.run(scenario())
