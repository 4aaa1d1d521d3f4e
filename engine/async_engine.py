"""AsyncEngine: the bridge between an asyncio event loop and ``LLMEngine``.

The engine's ``step()`` is synchronous compute, so it runs in a dedicated
thread (the *engine loop*). The event loop never touches the engine: it sends
commands (add, abort, stats) through a thread-safe queue, and the engine loop
hands outputs back with one ``call_soon_threadsafe`` per step, fanned out to
per-request asyncio queues. The message boundary is the command tuple and the
``RequestOutput``; it could become a process boundary unchanged. One call
crosses outside it: an online arrival tells the engine's preemption policy at
once (thread-safe), so it can interrupt a running offline-only step instead
of waiting for it to end.

Liveness: the engine loop stamps a heartbeat on every iteration (at least once
per ``idle_poll`` when idle). ``health()`` reports dead when the loop raised or
exited, and stalled when the heartbeat is older than ``stall_timeout`` — so a
server built on it never reports healthy while generation is dead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fluidserve.engine.outputs import RequestOutput
from fluidserve.engine.sampling_params import SamplingParams

logger = logging.getLogger("fluidserve.engine")


class EngineDeadError(RuntimeError):
    """The engine loop has died; no request can make progress."""


class RequestFailedError(RuntimeError):
    """The engine failed this one request (not the client's fault)."""


@dataclass(frozen=True)
class Health:
    ok: bool
    reason: str = "ok"
    # Data-parallel replicas: how many serve (``replicas_healthy``, ``replicas_total``).
    detail: dict | None = None


class RequestStream:
    """Outputs of one request, in order. Iterate it; leaving early (or
    ``abort()``) aborts the request in the engine and frees its KV."""

    def __init__(self, owner: "AsyncEngine", request_id: str) -> None:
        self.request_id = request_id
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self.got_output = False
        self.engine = "0"  # the replica serving it (vLLM's ``engine`` label)
        self.admitted: asyncio.Future = asyncio.get_running_loop().create_future()

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


class EngineThread:
    """The thread that builds the engine (``build``) and later runs its loop
    (``AsyncEngine.start``). On CPU, OpenMP gives each thread that computes
    a team of its own; with two teams it counts more threads than cores and
    cuts every idle thread's spin short, so a decode step pays a wake-up on
    every op (SmolLM2, batch 1, two cores: 40.7 ms a step built on the main
    thread against 24.3 ms built on this one, ``benchmarks/omp_teams.py``).
    One thread computing, from the weights' load on, keeps one team."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="fluidserve-engine-loop", daemon=True)
        self.thread.start()

    def build(self, factory: Callable[..., Any], *args: Any) -> Any:
        """``factory(*args)`` run on this thread; its result, or its exception raised here."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((factory, args, done))
        return done.result()

    def hand_over(self, loop: Callable[[], None]) -> None:
        """Run ``loop`` on this thread; the thread ends with it."""
        self._calls.put((loop, (), None))

    def _serve(self) -> None:
        while True:
            fn, args, done = self._calls.get()
            if done is None:
                fn()
                return
            try:
                done.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - the caller of build raises it
                done.set_exception(exc)


class AsyncEngine:
    def __init__(self, engine: Any, *, stall_timeout: float = 60.0, idle_poll: float = 0.25,
                 health_check_interval: float = 1.0,
                 on_death: Callable[[BaseException], None] | None = None,
                 thread: EngineThread | None = None) -> None:
        self.engine = engine
        # The thread the engine was built on, to run its loop (else a new one).
        self._host = thread
        # Called on the event loop once the engine loop has died and every
        # request has been failed (``fluidserve serve`` exits then).
        self.on_death = on_death
        self.stall_timeout = stall_timeout
        self.health_check_interval = health_check_interval
        self.idle_poll = idle_poll
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._beat = time.monotonic()
        self._error: BaseException | None = None
        self.last_stats: Any = None

    # -- lifecycle ----------------------------------------------------------
    def start(self) -> None:
        """Start the engine loop; call from inside the event loop."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._beat = time.monotonic()
        host = self._host or EngineThread()
        self._thread = host.thread
        host.hand_over(self._run)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine loop (in-flight requests are aborted), then the
        engine itself (its executor's workers) once the loop has let go."""
        self._stopping.set()
        self._commands.put(("wake",))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
        self._fail_all(EngineDeadError("engine is shut down"))
        if (self._thread is None or not self._thread.is_alive()) and hasattr(self.engine, "shutdown"):
            await asyncio.to_thread(self.engine.shutdown)

    def health(self) -> Health:
        if self._thread is None:
            return Health(False, "engine loop not started")
        if self._error is not None:
            return Health(False, f"engine loop died: {type(self._error).__name__}: {self._error}")
        if not self._thread.is_alive():
            return Health(False, "engine loop exited")
        idle_for = time.monotonic() - self._beat
        if idle_for > self.stall_timeout:
            return Health(False, f"engine loop stalled: no heartbeat for {idle_for:.1f}s")
        return Health(True)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_queued(self) -> int:
        """Requests admitted that have not produced any output yet."""
        return sum(1 for s in self._streams.values() if not s.got_output)

    # -- requests (event-loop side) ------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        klass: str = "online",
        arrival_time: float | None = None,
        final_only: bool = False,
    ) -> RequestStream:
        """Admit a request; raises ``ValueError`` (bad input, from the engine)
        or ``EngineDeadError``. Returns the stream of its outputs (with
        ``final_only``, of its finished output alone)."""
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        stream = RequestStream(self, request_id)
        admitted = stream.admitted
        self._streams[request_id] = stream
        # Stamped here, not when the engine thread gets to the command: a
        # request that arrives during a long step has been waiting since now
        # (the TTFT budget and the policies' ages count from it).
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self._commands.put(("add", request_id, prompt, params, klass, arrival_time, final_only, admitted))
        if str(getattr(klass, "value", klass)) == "online":
            self._preempt_for()
        try:
            await admitted
        except BaseException:
            # Rejected, or the client left while waiting: make sure the
            # engine holds nothing for it.
            self._streams.pop(request_id, None)
            if not (admitted.done() and not admitted.cancelled() and admitted.exception() is not None):
                self._commands.put(("abort", request_id))
            raise
        return stream

    def _preempt_for(self) -> None:
        """An online arrival may interrupt the offline-only step running now
        (layer-wise preemption): the one call into the engine made from the
        event loop, into its thread-safe preemption policy. The add command
        is queued first, so the engine loop admits the request before it
        plans the next step."""
        policy = getattr(self.engine, "preemption", None)
        if policy is not None:
            policy.on_online_arrival()

    def abort(self, request_id: str) -> None:
        """Abort now: no further outputs are delivered, and the engine loop
        frees the request's KV before its next step."""
        if self._streams.pop(request_id, None) is not None:
            self._commands.put(("abort", request_id))

    async def get_stats(self, timeout: float = 2.0) -> Any:
        """A fresh ``engine.stats()`` taken on the engine loop between steps;
        the last one seen when the loop is dead or busier than ``timeout``."""
        if not self.health().ok:
            return self.last_stats
        fut = asyncio.get_running_loop().create_future()
        self._commands.put(("stats", fut))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return self.last_stats

    async def call(self, method: str, *args: Any) -> Any:
        """``engine.<method>(*args)`` run on the engine loop between steps
        (the engine's state is the loop's alone), its result or its
        exception returned here."""
        self._check_alive()
        fut = asyncio.get_running_loop().create_future()
        self._commands.put(("call", method, args, fut))
        return await fut

    async def read_lora(self, path: str) -> Any:
        """``engine.read_lora(path)`` in a thread of its own: an adapter's
        files are read beside the steps, not between them."""
        return await asyncio.to_thread(self.engine.read_lora, path)

    def _check_alive(self) -> None:
        health = self.health()
        if not health.ok:
            raise EngineDeadError(health.reason)

    # -- deliveries (event-loop side, called from the engine loop) -----------
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            stream.got_output = True
            if out.error is not None:
                stream._put(RequestFailedError(out.error))
                self._streams.pop(out.request_id, None)
                continue
            stream._put(out)
            if out.finished:
                self._streams.pop(out.request_id, None)

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            _resolve(stream.admitted, None, exc)
            stream._put(exc)

    def _post(self, fn: Any, *args: Any) -> None:
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # loop closed between the check and the call
                pass

    # -- the engine loop (its own thread) ------------------------------------
    def _run(self) -> None:
        last_check = time.monotonic()
        try:
            while not self._stopping.is_set():
                self._beat = time.monotonic()
                busy = self.engine.has_unfinished_requests()
                self._apply_commands(block=not busy)
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    if outputs:
                        self._post(self._dispatch, outputs)
                    continue
                idle = getattr(self.engine, "idle", None)
                if idle is not None:
                    idle()
                if self._beat - last_check >= self.health_check_interval:
                    # An idle engine runs no step that would notice a dead
                    # worker: ask the executor, so /health turns 503 anyway.
                    last_check = self._beat
                    check = getattr(self.engine, "check_health", None)
                    if check is not None:
                        check()
        except BaseException as exc:  # noqa: BLE001 - the loop's death must be reported, whatever it is
            logger.exception("engine loop died")
            self._error = exc
            self._post(self._fail_all, EngineDeadError(f"engine loop died: {type(exc).__name__}: {exc}"))
            if self.on_death is not None:
                self._post(self.on_death, exc)

    def _apply_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self.idle_poll) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            self._add(*cmd[1:])
        elif kind == "abort":
            self.engine.abort(cmd[1])
        elif kind == "stats":
            self.last_stats = copy.copy(self.engine.stats())  # a snapshot, not the live object
            self._post(_resolve, cmd[1], self.last_stats, None)
        elif kind == "call":
            _, method, args, fut = cmd
            try:
                result, exc = getattr(self.engine, method)(*args), None
            except Exception as err:  # noqa: BLE001 - the caller's error, not the loop's
                result, exc = None, err
            self._post(_resolve, fut, result, exc)

    def _add(self, request_id: str, prompt: Any, params: SamplingParams, klass: str,
             arrival_time: float | None, final_only: bool, admitted: asyncio.Future) -> None:
        try:
            self.engine.add_request(request_id, prompt, params, klass=klass, arrival_time=arrival_time,
                                    final_only=final_only)
        except (ValueError, TypeError) as exc:
            self._post(_resolve, admitted, None, ValueError(str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - one bad request must not kill the loop
            logger.exception("add_request failed for %s", request_id)
            self._post(_resolve, admitted, None, RequestFailedError(f"{type(exc).__name__}: {exc}"))
            return
        self._post(_resolve, admitted, True, None)


def _resolve(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
