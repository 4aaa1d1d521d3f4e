"""Data-parallel replicas: N whole engines behind one ``AsyncEngine``-shaped front.

Each replica is a complete engine — scheduler, KV manager with both tiers,
workers (tensor-parallel ones included) — in a Ray actor of its own, so a
replica that dies takes nothing else with it. The front end runs in the HTTP
server's process and gives ``serve/`` exactly the interface of one
``AsyncEngine`` (``add_request`` returns a ``RequestStream``; ``abort``,
``health``, ``get_stats``), so the routes, streaming, the Batch API and the
metrics are the same code with one replica or many.

::

    HTTP routes ── add_request ──► Router (scheduler/router.py) picks a replica
                                        │
                  ┌─────────────────────┼──────────────────────┐
                  ▼                     ▼                      ▼
            EngineReplica 0       EngineReplica 1   …    EngineReplica N-1   (Ray actors)
            LLMEngine + loop      LLMEngine + loop        LLMEngine + loop
                  │ poll()              │                      │
                  └──── outputs, load, health ────► one poller task per replica

A replica on this process's node takes requests and pushes outputs over a
Unix socket (engine/replica_channel.py): each step's outputs as soon as they
exist, or, every ``POLL_S`` with none, the replica's load for the router and
its health. Elsewhere (or with ``ray_transport="ray-calls"``) requests are
Ray calls and outputs come back by long polling: one ``poll`` call per
replica always pending, returning what the push would have sent. What
crosses is plain data: token ids and ``SamplingParams`` in, ``RequestOutput``
lists out, each after a request's first as what came since the one before
(engine/output_wire.py): the prompt and a completion's whole text and tokens
are not sent again every step.

A replica's death: its channel closes, or its pending ``poll`` fails (Ray
reports the actor's process gone), at once, so the router stops choosing it
within that call; an ``add`` waiting on it goes to another replica. Requests
it held that had produced no token are sent again to another
replica (the client sees nothing but a later first token); streams already
started end with an error the routes turn into OpenAI's error event. Ray
restarts the actor (``max_restarts``); when it answers again it rejoins the
rotation with an empty prefix index. A replica whose engine loop died or
stalled (the actor alive, generation not) is killed so that Ray restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from fluidserve.engine.async_engine import (AsyncEngine, EngineDeadError, Health, RequestFailedError,
                                            RequestStream, _resolve)
from fluidserve.engine.config import EngineConfig
from fluidserve.engine.output_wire import OutputSender, OutputTail, rebuild
from fluidserve.engine.outputs import RequestOutput
from fluidserve.engine.replica_channel import ReplicaGone, ReplicaLink
from fluidserve.engine.sampling_params import SamplingParams
from fluidserve.kvcache.prefix_cache import salted_root

log = logging.getLogger(__name__)

POLL_S = 0.1  # an idle replica still answers this often: its load and health reach the router
RESTART_POLL_S = 0.25  # how often a dead replica is asked whether Ray has restarted it
READY_TIMEOUT_S = 1800.0  # loading weights may take minutes
# A replica's loop that has not beaten for this long is stalled: killed and restarted.
STALL_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ModelFacts:
    """What the front end knows of the served model, taken from replica 0
    (the front end loads no weights): the same attributes ``serve/cli.py``
    reads of a local ``LLMEngine``."""

    model_name: str
    max_model_len: int
    vocab_size: int
    is_tiny_default: bool
    model_dir: str
    tokenizer: Any
    config: EngineConfig
    backlog_cost: Any  # scheduler.router.BacklogCost of the replica's cost model
    kv_blocks: int  # device + host KV blocks of one replica
    pooling: Any = None  # an embedding model's pooling (engine/pooling.py); None: it generates
    classifier: Any = None  # a sequence classifier's head (engine/pooling.py)


@dataclass
class _InFlight:
    """A request the front end has routed: enough to send it again."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    klass: str
    arrival: float  # front end's monotonic clock
    stream: RequestStream
    final_only: bool = False
    replica: int = -1
    sending: bool = False  # an add call is on its way: its sender retries it, not a replica's failure
    output: RequestOutput | None = None  # its last output, whole: what the next one's tail extends


@dataclass
class _Replica:
    index: int
    actor: Any
    healthy: bool = False
    pid: int | None = None
    node_id: str | None = None
    torch_threads: int | None = None  # what its engine's thread computes on
    requests: set[str] = field(default_factory=set)
    stats: Any = None
    restarts: int = 0
    link: Any = None  # its ReplicaLink while requests and outputs take the replica channel
    channel_failed: bool = False  # its channel could not be made: Ray calls until it restarts


def replica_config(config: EngineConfig) -> EngineConfig:
    """One replica's own config: a single engine of the same model."""
    return config.replace(data_parallel_size=1)


def _replica_class():
    """The actor class, made on first use so importing this module needs no Ray."""
    import ray

    @ray.remote
    class EngineReplica:
        """One whole engine and its loop. Its async methods run on the actor's
        event loop (``poll`` waits there while ``add`` and ``abort`` land);
        the engine steps on its own thread, as in the single-engine server."""

        def __init__(self, config: EngineConfig, index: int, torch_threads: int | None) -> None:
            from fluidserve.engine.async_engine import EngineThread

            self.index = index
            # Built on the thread that will step it, as the single-engine
            # server does: one OpenMP team computes, from the weights' load on.
            self.host = EngineThread()
            self.engine, self.threads = self.host.build(_build_replica_engine, config, torch_threads)
            self.front: _OutboxEngine | None = None
            self.outputs = OutputSender()  # what the front holds of each request's output
            self.channel: Any = None  # the FrontChannel serving the front end

        def _front(self) -> "_OutboxEngine":
            if self.front is None:  # first call on the actor's event loop
                self.front = _OutboxEngine(self.engine, stall_timeout=STALL_TIMEOUT_S, thread=self.host)
                self.front.start()
            return self.front

        async def ready(self) -> dict:
            import ray as _ray

            self._front()
            return {"pid": os.getpid(), "node_id": _ray.get_runtime_context().get_node_id(), "index": self.index,
                    "torch_threads": self.threads}

        async def facts(self) -> ModelFacts:
            from fluidserve.scheduler.router import BacklogCost

            e = self.engine
            return ModelFacts(e.model_name, e.max_model_len, e.vocab_size, e.is_tiny_default, str(e.model_dir),
                              e.tokenizer, e.config, BacklogCost.from_cost_model(e.cost_model),
                              e.kv.num_blocks + e.kv.num_host_blocks, e.pooling, e.classifier)

        async def add(self, request_id: str, prompt: list[int], params: SamplingParams, klass: str,
                      waited_s: float, final_only: bool = False) -> None:
            # Clocks differ between processes: the arrival is carried as an age.
            await self._front().add_request(request_id, prompt, params, klass, time.monotonic() - waited_s,
                                            final_only=final_only)

        async def abort(self, request_id: str) -> None:
            self._front().abort(request_id)
            self.outputs.forget(request_id)

        async def poll(self, timeout: float) -> tuple[list[OutputTail], Any, str | None]:
            """Outputs since the last poll (waiting up to ``timeout`` for some),
            as what the front lacks of them, the engine's last stats, and why
            it is unhealthy (None: healthy)."""
            front = self._front()
            outputs = await front.take(timeout)
            front.refresh_stats()
            health = front.health()
            return self.outputs.wire(outputs), front.last_stats, None if health.ok else health.reason

        async def open_channel(self) -> str:
            """Where the front end connects to send requests and take the
            outputs as they come (engine/replica_channel.py) instead of
            calling ``add`` and ``poll``."""
            from fluidserve.engine.replica_channel import FrontChannel, listen_once

            async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                # Two channels' pushers would take outputs from one outbox:
                # a new channel ends the one before.
                self._end_channel()
                self.channel = FrontChannel(reader, writer, add=self.add, abort=self.abort, poll=self.poll,
                                            poll_s=POLL_S)
                await self.channel.serve()

            return await listen_once(serve)

        def _end_channel(self) -> None:
            if self.channel is not None:
                self.channel.close()
                self.channel = None

        async def drop_all(self) -> int:
            """Abort every request this replica holds; returns how many.
            Called as it comes back into rotation: the front end has failed
            or sent elsewhere all it held. A replica Ray restarted holds
            nothing; one that lived on (its channel closed, or a call to it
            failed) would otherwise run them to the end, on KV blocks the
            requests sent to it next need."""
            self._end_channel()  # the front end closed it: no output may go out on it now
            dropped = self._front().abort_all()
            for request_id in dropped:
                self.outputs.forget(request_id)
            return len(dropped)

        async def stats(self) -> Any:
            return await self._front().get_stats()

        async def shutdown(self) -> None:
            if self.front is not None:
                await self.front.shutdown()

    return EngineReplica


def _build_replica_engine(config: EngineConfig, torch_threads: int | None) -> tuple[Any, int]:
    """The engine, and the threads it computes on: torch's count belongs to
    the calling thread, so both are read on the one that will step it."""
    import torch

    from fluidserve.engine.engine import LLMEngine

    if torch_threads:
        torch.set_num_threads(torch_threads)
    return LLMEngine(config), torch.get_num_threads()


class _OutboxEngine(AsyncEngine):
    """An ``AsyncEngine`` whose outputs go to one outbox, drained by ``poll``,
    instead of to per-request streams."""

    def __init__(self, engine: Any, **kwargs: Any) -> None:
        super().__init__(engine, **kwargs)
        self._outbox: list[RequestOutput] = []
        self._ready = asyncio.Event()
        self._stats_task: asyncio.Task | None = None

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.request_id not in self._streams:
                continue  # aborted meanwhile
            if out.finished or out.error is not None:
                self._streams.pop(out.request_id, None)
            self._outbox.append(out)
        self._ready.set()

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            _resolve(stream.admitted, None, exc)  # an add waiting for admission fails now
        self._ready.set()  # the poll returns now and reports the loop's death

    def abort_all(self) -> list[str]:
        """Abort every request held, and drop the outputs not yet taken;
        returns their ids."""
        dropped = list(self._streams)
        for request_id in dropped:
            self.abort(request_id)
        self._outbox.clear()
        return dropped

    async def take(self, timeout: float) -> list[RequestOutput]:
        if not self._outbox:
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        self._ready.clear()
        out, self._outbox = self._outbox, []
        return out

    def refresh_stats(self) -> None:
        """Take fresh stats between steps without holding up the poll: the
        next poll carries them."""
        if self._stats_task is None or self._stats_task.done():
            self._stats_task = asyncio.ensure_future(self.get_stats())


class DataParallelEngine:
    """``data_parallel_size`` replicas behind one front with ``AsyncEngine``'s
    interface. Build it before the event loop runs (it starts the replicas
    and waits until each has loaded its model); ``start`` inside it."""

    def __init__(self, config: EngineConfig, *, routing_policy: str | None = None,
                 torch_threads: int | None = None, max_restarts: int = -1) -> None:
        import ray

        from fluidserve.engine.executor.ray import _connect
        from fluidserve.scheduler.router import make_router

        self.config = config
        self.size = config.data_parallel_size
        self.routing_policy = routing_policy or config.routing_policy
        self._owns_ray = _connect(config.ray_address)
        # Replicas on this node take the replica channel; others Ray calls.
        self._link_node = ray.get_runtime_context().get_node_id() if config.ray_transport == "auto" else None
        self._requests: dict[str, _InFlight] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pollers: list[asyncio.Task] = []
        self._stopping = False
        options = self._actor_options(ray, config, max_restarts)
        cls = _replica_class()
        single = replica_config(config)
        self.replicas = [_Replica(i, cls.options(**options).remote(single, i, torch_threads))
                         for i in range(self.size)]
        try:
            infos = ray.get([r.actor.ready.remote() for r in self.replicas], timeout=READY_TIMEOUT_S)
            self.facts: ModelFacts = ray.get(self.replicas[0].actor.facts.remote())
        except BaseException:
            self._kill_all()
            raise
        # The router weighs backlogs with the replicas' own cost model and
        # sizes its prefix index like their KV pools (both tiers).
        options = ({"balance_threshold_s": config.routing_balance_threshold_ms / 1e3}
                   if self.routing_policy == "prefix-aware" else {})
        self.router = make_router(self.routing_policy, self.size, block_size=config.block_size,
                                  cost=self.facts.backlog_cost, index_blocks=self.facts.kv_blocks, **options)
        for replica, info in zip(self.replicas, infos):
            replica.healthy, replica.pid, replica.node_id = True, info["pid"], info["node_id"]
            replica.torch_threads = info["torch_threads"]
        log.info("%d engine replicas ready (%s routing) on %d node(s), on %s torch threads", self.size,
                 self.routing_policy, len({r.node_id for r in self.replicas}),
                 "/".join(str(r.torch_threads) for r in self.replicas))

    @staticmethod
    def _actor_options(ray: Any, config: EngineConfig, max_restarts: int) -> dict:
        """A replica of one device holds it (``num_gpus``, or a CPU); one
        with tensor-parallel workers holds nothing itself, its workers hold
        the devices, packed on one node by its executor. Replicas spread
        over the cluster's nodes."""
        tp = config.tensor_parallel_size
        gpus = int(ray.cluster_resources().get("GPU", 0))
        on_gpu = config.device == "cuda" or (config.device == "auto" and gpus > 0)
        if tp > 1:
            resources = {"num_cpus": 0}
        elif on_gpu:
            resources = {"num_cpus": 0, "num_gpus": 1}
        else:
            resources = {"num_cpus": 1}
        return dict(resources, max_restarts=max_restarts, max_concurrency=1000, scheduling_strategy="SPREAD")

    # -- the AsyncEngine interface -------------------------------------------
    def start(self) -> None:
        if self._pollers:
            return
        self._loop = asyncio.get_running_loop()
        self._pollers = [asyncio.ensure_future(self._poll_forever(r)) for r in self.replicas]

    async def shutdown(self, timeout: float = 10.0) -> None:
        import ray

        self._stopping = True
        for task in self._pollers:
            task.cancel()
        self._fail_all(EngineDeadError("engine is shut down"))
        for r in self.replicas:
            _close_link(r)
        alive = [r.actor.shutdown.remote() for r in self.replicas if r.healthy]
        if alive:
            await asyncio.to_thread(ray.wait, alive, num_returns=len(alive), timeout=timeout)
        self._kill_all()
        if self._owns_ray:
            ray.shutdown()

    def health(self) -> Health:
        healthy = sum(r.healthy for r in self.replicas)
        detail = {"replicas_healthy": healthy, "replicas_total": self.size}
        if healthy == 0:
            return Health(False, f"no engine replica is healthy (0 of {self.size})", detail)
        return Health(True, "ok", detail)

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    @property
    def num_queued(self) -> int:
        return sum(1 for f in self._requests.values() if not f.stream.got_output)

    async def add_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                          klass: str = "online", arrival_time: float | None = None,
                          final_only: bool = False) -> RequestStream:
        """Route and admit a request; raises ``ValueError`` (bad input, from
        the engine) or ``EngineDeadError`` (no replica serves)."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        klass = str(getattr(klass, "value", klass))
        stream = RequestStream(self, request_id)
        flight = _InFlight(request_id, list(prompt), params, klass,
                           time.monotonic() if arrival_time is None else arrival_time, stream, final_only)
        self._requests[request_id] = flight
        try:
            await self._send(flight, exclude=())
        except BaseException:
            # Rejected, or the client left while it was being admitted: make
            # sure no replica holds anything for it.
            self._requests.pop(request_id, None)
            replica = self._forget(flight)
            if replica is not None and replica.healthy:
                _abort_on(replica, request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        flight = self._requests.pop(request_id, None)
        if flight is None:
            return
        replica = self._forget(flight)
        if replica is not None and replica.healthy:
            _abort_on(replica, request_id)

    async def get_stats(self, timeout: float = 2.0) -> dict[str, Any]:
        """Each replica's engine stats, keyed by its index as vLLM's
        ``engine`` label: fresh where it answers within ``timeout``, else the
        last its poll carried."""
        async def one(r: _Replica) -> None:
            if r.healthy:
                try:
                    r.stats = await asyncio.wait_for(_await_ref(r.actor.stats.remote()), timeout)
                except Exception:  # noqa: BLE001 - dead or busy: the poller sees to it; keep the last
                    pass

        await asyncio.gather(*(one(r) for r in self.replicas))
        return {str(r.index): r.stats for r in self.replicas if r.stats is not None}

    # -- routing and sending ---------------------------------------------------
    async def _send(self, flight: _InFlight, exclude: tuple[int, ...]) -> None:
        """Send ``flight`` to the replica the router picks, trying the others
        when one turns out to be dead on the way."""
        from fluidserve.scheduler.router import NoReplicaError

        tried = set(exclude)
        while True:
            try:
                route = self.router.route(flight.request_id, flight.prompt, offline=flight.klass == "offline",
                                          exclude=tried, root=salted_root(flight.params.cache_salt))
            except NoReplicaError:
                raise EngineDeadError(f"no engine replica is healthy (0 of {self.size})") from None
            replica = self.replicas[route.replica]
            flight.replica, flight.stream.engine = replica.index, str(replica.index)
            replica.requests.add(flight.request_id)
            waited = max(0.0, time.monotonic() - flight.arrival)
            flight.sending = True
            try:
                args = (flight.request_id, flight.prompt, flight.params, flight.klass, waited, flight.final_only)
                if replica.link is not None:
                    await replica.link.add(*args)
                else:
                    await _await_ref(replica.actor.add.remote(*args))
                return
            except BaseException as exc:
                self._forget(flight)
                if _is_actor_death(exc):
                    self._mark_down(replica, f"{type(exc).__name__}")
                    tried.add(replica.index)
                    continue
                cause = _cause(exc)
                if isinstance(cause, (ValueError, TypeError)):
                    raise ValueError(str(cause)) from None
                if isinstance(cause, EngineDeadError):
                    # Its loop is dead: restart it, and let another take the request.
                    self._mark_down(replica, str(cause), kill=True)
                    tried.add(replica.index)
                    continue
                raise
            finally:
                flight.sending = False

    def _forget(self, flight: _InFlight) -> _Replica | None:
        if flight.replica < 0:
            return None
        replica = self.replicas[flight.replica]
        replica.requests.discard(flight.request_id)
        self.router.finished(flight.request_id)
        return replica

    # -- outputs ---------------------------------------------------------------
    async def _poll_forever(self, replica: _Replica) -> None:
        """Take the replica's outputs, pushed over its channel or by long
        polling, until shutdown; a replica that goes is waited for and, back,
        connected anew."""
        while not self._stopping:
            if not replica.healthy:
                await self._await_restart(replica)
                continue
            try:
                if replica.link is None and not replica.channel_failed and replica.node_id == self._link_node:
                    replica.link = await self._connect(replica)
                if replica.link is not None:
                    outputs, stats, unhealthy = await replica.link.next_outputs()
                else:
                    outputs, stats, unhealthy = await _await_ref(replica.actor.poll.remote(POLL_S))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - any failure of the call is the replica's death
                self._mark_down(replica, f"{type(exc).__name__}: {exc}")
                continue
            if outputs:
                self._dispatch(replica, outputs)
            if stats is not None:
                replica.stats = stats
                self.router.report_kv_usage(replica.index, stats.kv_blocks_used / max(1, stats.kv_blocks_total))
            if unhealthy is not None:
                self._mark_down(replica, unhealthy, kill=True)

    async def _connect(self, replica: _Replica) -> ReplicaLink | None:
        """The replica's channel; None (Ray calls, then, until it restarts)
        where the socket cannot be made though the replica lives, say with
        no writable temporary directory. A dead replica's failure propagates."""
        try:
            return await ReplicaLink.connect(await _await_ref(replica.actor.open_channel.remote()))
        except Exception as exc:  # noqa: BLE001 - anything but the replica's death: Ray calls serve it
            if _is_actor_death(exc):
                raise
            cause = _cause(exc)
            log.warning("engine replica %d: its channel failed (%s: %s); Ray calls carry its requests and "
                        "outputs", replica.index, type(cause).__name__, cause)
            replica.channel_failed = True
            return None

    def _dispatch(self, replica: _Replica, tails: list[OutputTail]) -> None:
        for tail in tails:
            flight = self._requests.get(tail.output.request_id)
            if flight is None or flight.replica != replica.index:
                continue  # aborted meanwhile, or sent again elsewhere
            stream = flight.stream
            try:
                out = flight.output = rebuild(flight.output, tail)
            except ValueError as exc:  # the replica's record and the front's disagree: this request fails
                log.error("engine replica %d: %s", replica.index, exc)
                out = RequestOutput(flight.request_id, None, flight.prompt, [], True, str(exc))
                _abort_on(replica, flight.request_id)
            if not stream.got_output:
                stream.got_output = True
                self.router.started(out.request_id)
            if out.error is not None:
                stream._put(RequestFailedError(out.error))
            else:
                stream._put(out)
            if out.finished or out.error is not None:
                self._requests.pop(out.request_id, None)
                self._forget(flight)

    # -- failure -------------------------------------------------------------------
    def _mark_down(self, replica: _Replica, reason: str, kill: bool = False) -> None:
        """Take ``replica`` out of rotation now; send again what it held that
        has not started; fail what has. Ray restarts an actor whose process
        died; one alive with its engine loop dead (``kill``) is killed so
        that Ray restarts it too; one alive otherwise comes back once it has
        dropped what it held (``_await_restart``)."""
        if not replica.healthy:
            return
        replica.healthy = False
        _close_link(replica)  # an add waiting on it fails now, and its sender tries another replica
        self.router.set_healthy(replica.index, False)
        log.warning("engine replica %d is down (%s): out of rotation until it is back", replica.index, reason)
        held = [self._requests[rid] for rid in list(replica.requests)
                if rid in self._requests and not self._requests[rid].sending]
        replica.requests.clear()
        for flight in held:
            self.router.finished(flight.request_id)
            flight.replica = -1
            if flight.stream.got_output:
                self._requests.pop(flight.request_id, None)
                flight.stream._put(RequestFailedError(
                    f"engine replica {replica.index} failed while this request was generating ({reason})"))
            else:
                asyncio.ensure_future(self._resend(flight, replica.index))
        if kill:
            _kill(replica.actor, restart=True)

    async def _resend(self, flight: _InFlight, dead: int) -> None:
        try:
            await self._send(flight, exclude=(dead,))
        except BaseException as exc:  # noqa: BLE001 - whatever it is, the client hears of it
            self._requests.pop(flight.request_id, None)
            err = exc if isinstance(exc, (EngineDeadError, RequestFailedError)) else RequestFailedError(str(exc))
            flight.stream._put(err)

    async def _await_restart(self, replica: _Replica) -> None:
        try:
            info = await asyncio.wait_for(_await_ref(replica.actor.ready.remote()), READY_TIMEOUT_S)
            dropped = await asyncio.wait_for(_await_ref(replica.actor.drop_all.remote()), READY_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except BaseException:  # noqa: BLE001 - not back yet (or restarting): ask again
            await asyncio.sleep(RESTART_POLL_S)
            return
        replica.pid, replica.node_id = info["pid"], info["node_id"]
        replica.torch_threads = info["torch_threads"]
        replica.healthy, replica.stats, replica.channel_failed = True, None, False
        replica.restarts += 1
        self.router.set_healthy(replica.index, True)
        log.info("engine replica %d is back (pid %d): in rotation again%s", replica.index, replica.pid,
                 f"; it dropped the {dropped} request(s) it still held" if dropped else "")

    def _fail_all(self, exc: BaseException) -> None:
        flights, self._requests = self._requests, {}
        for flight in flights.values():
            flight.stream._put(exc)

    def _kill_all(self) -> None:
        for r in self.replicas:
            _kill(r.actor, restart=False)


def _abort_on(replica: _Replica, request_id: str) -> None:
    if replica.link is not None:
        replica.link.abort(request_id)
    else:
        replica.actor.abort.remote(request_id)


def _close_link(replica: _Replica) -> None:
    link, replica.link = replica.link, None
    if link is not None:
        link.close()


def _kill(actor: Any, restart: bool) -> None:
    import ray

    try:
        ray.kill(actor, no_restart=not restart)
    except Exception:  # noqa: BLE001 - already gone (or Ray is): nothing left to stop
        pass


async def _await_ref(ref: Any) -> Any:
    return await ref


def _cause(exc: BaseException) -> BaseException:
    """The exception a replica's method raised, out of Ray's wrapper."""
    return getattr(exc, "cause", None) or exc


def _is_actor_death(exc: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(exc, (RayActorError, ActorDiedError, ActorUnavailableError, ReplicaGone))
