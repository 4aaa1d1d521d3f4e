"""RayExecutor: one Ray actor per device, each hosting one tensor-parallel
rank's Worker.

A step::

    engine ── ModelInput ────────────────► rank 0 … rank N-1   every rank swaps its own KV
                                                                    shard, then runs the step
                                           ◄──── all-reduce / gather ────►  torch.distributed:
    engine ◄── StepResult (tokens) ────── rank 0                NCCL on GPU, gloo on CPU
           ◄── StepResult (no tokens) ─── ranks 1..N-1

Activations never pass through the engine: the ranks exchange them among
themselves. Steps reach the actors over a Unix socket each
(engine/executor/step_channel.py) where the ranks share the engine's node,
as Ray calls where they do not: a Ray call costs ~0.9 ms a step, the socket
~0.07 ms. What crosses to and from the actors is plain data — the
ModelInput's lists and ints, the SampledTokens' ids and logprobs. Block
tables cross as what each rank lacks of them (engine/block_tables.py's
sender): a decode step sends the blocks its rows gained, not whole tables,
which for 256 rows of 512-32k tokens would be 1.3 MB to pickle, and ~14 ms
to pickle and unpickle, every step. The sampler rows cross to rank 0 alone,
the one that samples, and as what it lacks of them too
(engine/sample_specs.py): parameters and prompts once, outputs by the
tokens a step added.

Failure: a rank that dies makes its step's result an error at once (its
socket closes, or Ray reports the actor's death); a rank that hangs is caught by the step timeout.
Either way ``execute`` raises ``ExecutorError`` within ``step_timeout_s``,
the executor stays failed (``check_health`` raises too) and the surviving
actors are killed — their process group is broken beyond repair.

Safety: when this process starts Ray itself, the cluster listens on the
loopback interface only, with no dashboard and no Ray client server (and the
token authentication Ray enables by default). ``ray_address`` joins a cluster
someone else started and secured; nothing the HTTP side receives is ever
unpickled — only the engine talks to the actors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import tempfile
import time
import uuid
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fluidserve.engine.batch import ModelInput, StepResult
from fluidserve.engine.block_tables import BlockTableSender
from fluidserve.engine.config import EngineConfig
from fluidserve.engine.loader import build_model, load_hf_config
from fluidserve.engine.parallel import TensorParallel, destroy_tensor_parallel, init_tensor_parallel
from fluidserve.engine.sample_specs import SampleSpecSender
from fluidserve.engine.worker import Worker
from fluidserve.engine.executor.base import Executor, ExecutorError
from fluidserve.engine.executor.step_channel import RankError, StepLink, StepListener, gather, pack

log = logging.getLogger(__name__)

# A step of a healthy worker takes milliseconds on a GPU; one that has not
# answered after this long is hung. Kept under 10 s so /health turns 503, and
# in-flight requests fail, within 10 s of a hang.
STEP_TIMEOUT_S = 8.0
HEALTH_TIMEOUT_S = 5.0
# Loading weights may take minutes; a worker dying meanwhile is still noticed at once.
STARTUP_TIMEOUT_S = 1800.0
PLACEMENT_TIMEOUT_S = 60.0
DEATH_CAUSE_WAIT_S = 2.0
# Ray's own switch for a loopback-only node (named for the platforms where it
# is the default): its processes then bind 127.0.0.1.
_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


@ray.remote(concurrency_groups={"control": 1})
class RayWorker:
    """Hosts one rank's Worker. Calls run one at a time, in order, on one
    thread (the default concurrency group), except ``interrupt`` and
    ``ping``, which have a thread of their own so that they land while a
    step runs, or while ``serve_steps`` holds the default thread for good;
    a step that hangs is the step timeout's to catch."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self._listener: StepListener | None = None

    def rendezvous_address(self, loopback: bool) -> str:
        """Where the process group meets (asked of rank 0). On a loopback-only
        node a file, so nothing listens on the network; else ``tcp://ip:port``."""
        if loopback:
            return f"file://{tempfile.gettempdir()}/fluidserve-tp-{uuid.uuid4().hex}"
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return f"tcp://{ip}:{port}"

    def setup(self, config: EngineConfig, model_dir: str, rank: int, size: int,
              init_method: str, loopback: bool) -> int | None:
        """Join the process group, build this rank's share of the model;
        returns the model's EOS token id."""
        if loopback:  # the collectives' own sockets stay on loopback too
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        backend = "nccl" if config.device == "cuda" else "gloo"
        tp = init_tensor_parallel(rank, size, init_method, backend)
        self.worker = Worker(config, model_dir, tp)
        return self.worker.eos_token_id

    def available_kv_blocks(self) -> int:
        return self.worker.available_kv_blocks()

    def bytes_per_block(self) -> int:
        return self.worker.bytes_per_block()

    def available_host_blocks(self) -> int:
        return self.worker.available_host_blocks()

    def init_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        self.worker.init_cache(num_blocks, num_host_blocks)

    def warm_up(self) -> None:
        self.worker.warm_up()

    def execute(self, inp: ModelInput) -> StepResult:
        return self.worker.execute(inp)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def open_step_channel(self) -> str | None:
        """Where the engine connects for its steps (step_channel.py); None
        where no socket can be made here."""
        try:
            self._listener = StepListener()
        except OSError as exc:
            log.warning("tensor-parallel worker: no step channel (%s)", exc)
            return None
        return self._listener.path

    def close_step_channel(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def serve_steps(self) -> None:
        """Run every step the engine sends over the channel, until it closes
        the channel; holds this actor's default thread till then."""
        listener, self._listener = self._listener, None
        listener.serve(self.worker.execute)

    @ray.method(concurrency_group="control")
    def interrupt(self, step_id: int) -> None:
        """Runs beside ``execute``: sets the flag its layer loop reads."""
        if self.worker is not None:
            self.worker.interrupt(step_id)

    @ray.method(concurrency_group="control")
    def ping(self) -> int:
        """Alive: this worker's process id (tests kill it by pid)."""
        return os.getpid()

    def close(self) -> None:
        destroy_tensor_parallel()


def start_local_ray(num_cpus: int | None = None) -> None:
    """Start a single-node Ray instance reachable from this machine only:
    every Ray process bound to 127.0.0.1, no dashboard, no client server, no
    usage reporting. A new one even where another Ray instance runs on this
    machine: Ray's own default joins the one started last (or
    ``RAY_ADDRESS``'s), another server's or another user's; joining one is
    what ``ray_address`` asks for."""
    from ray._private import ray_constants

    saved_env = {k: os.environ.get(k) for k in _LOOPBACK_ENV}
    os.environ.update(_LOOPBACK_ENV)  # inherited by the processes Ray starts
    # The node-IP lookup reads this at call time; the variable above only
    # counts for processes that import Ray afresh.
    saved_flag = getattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                 configure_logging=False)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    address = ray.get_runtime_context().gcs_address
    if not address.startswith("127.0.0.1:"):
        log.warning("Ray started on %s, not on the loopback interface", address)


class RayExecutor(Executor):
    """``tensor_parallel_size`` Ray actors, one per GPU (or CPU worker)."""

    def __init__(self, config: EngineConfig, model_dir: str, *, step_timeout_s: float = STEP_TIMEOUT_S,
                 health_timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        self.size = config.tensor_parallel_size
        self.step_timeout_s = step_timeout_s
        self.health_timeout_s = health_timeout_s
        self.workers: list[Any] = []
        self._failure: str | None = None
        self._pg = None
        self._rendezvous_file: str | None = None
        self._tables = BlockTableSender()  # every rank takes every step, in order: one sender serves them all
        self._samples = SampleSpecSender()  # rank 0's rows
        self._links: list[StepLink] = []  # one a rank, when steps take the step channel
        self._serving: list = []  # each rank's serve_steps call: it fails when the rank dies
        # A bad size is a ValueError here, not a dead actor later.
        _check_shapes(model_dir, self.size, config.hf_overrides)
        self._owns_ray = _connect(config.ray_address)
        try:
            device = self._device(config)
            self._pg = self._reserve(device)
            self._start(dataclasses.replace(config, device=device), str(model_dir))
            # The sockets need the ranks on this process's node.
            if config.ray_transport == "auto" and self._ranks_share_this_node():
                self._open_step_channels()
            log.info("Ray executor: steps reach the ranks over %s", self.step_transport)
        except BaseException:
            self.shutdown()
            raise

    # -- startup -------------------------------------------------------------
    def _device(self, config: EngineConfig) -> str:
        gpus = int(ray.cluster_resources().get("GPU", 0))
        if config.device == "cuda" or (config.device == "auto" and gpus > 0):
            if gpus < self.size:
                raise ValueError(
                    f"tensor_parallel_size: {self.size} GPU workers asked for, the Ray cluster has {gpus} GPU(s)"
                )
            return "cuda"
        return "cpu"

    def _reserve(self, device: str):
        """One bundle per rank, all on one node (every layer all-reduces:
        ranks on one node talk over NVLink or shared memory, not the
        network). Data-parallel replicas are what spreads over nodes."""
        bundle = {"GPU": 1, "CPU": 1} if device == "cuda" else {"CPU": 1}
        pg = placement_group([dict(bundle) for _ in range(self.size)], strategy="STRICT_PACK")
        try:
            ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            remove_placement_group(pg)
            raise ValueError(
                f"tensor_parallel_size: the Ray cluster cannot place {self.size} workers of {bundle} "
                f"(available: {ray.available_resources()})"
            ) from None
        return pg

    def _start(self, config: EngineConfig, model_dir: str) -> None:
        gpu = config.device == "cuda"
        for rank in range(self.size):
            self.workers.append(RayWorker.options(
                num_cpus=1, num_gpus=1 if gpu else 0, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank),
            ).remote())
        loopback = _on_loopback()
        (init_method,) = self._call([self.workers[0].rendezvous_address.remote(loopback)], STARTUP_TIMEOUT_S,
                                    "startup")
        if init_method.startswith("file://"):
            self._rendezvous_file = init_method[len("file://"):]
        eos = self._call([w.setup.remote(config, model_dir, rank, self.size, init_method, loopback)
                          for rank, w in enumerate(self.workers)], STARTUP_TIMEOUT_S, "model load")
        self.eos_token_id = eos[0]
        # Every rank must hold the same number of blocks: one block table
        # addresses them all.
        blocks = self._call([w.available_kv_blocks.remote() for w in self.workers], STARTUP_TIMEOUT_S, "KV sizing")
        self.num_kv_blocks = min(blocks)
        host = self._call([w.available_host_blocks.remote() for w in self.workers], STARTUP_TIMEOUT_S, "KV sizing")
        self.num_host_blocks = min(host)
        per_rank = self._call([self.workers[0].bytes_per_block.remote()], STARTUP_TIMEOUT_S, "KV sizing")[0]
        self.bytes_per_block = per_rank * self.size
        self._call([w.init_cache.remote(self.num_kv_blocks, self.num_host_blocks) for w in self.workers],
                   STARTUP_TIMEOUT_S, "KV allocation")
        # Compiles the kernels and exercises every collective once, so that
        # neither counts against the first real step's timeout.
        self._call([w.warm_up.remote() for w in self.workers], STARTUP_TIMEOUT_S, "warm-up")
        log.info("Ray executor ready: %d %s worker(s), %d KV blocks each", self.size, config.device,
                 self.num_kv_blocks)

    @property
    def step_transport(self) -> str:
        """How steps reach the ranks: ``"unix sockets"`` or ``"ray calls"``."""
        return "unix sockets" if self._links else "ray calls"

    def _ranks_share_this_node(self) -> bool:
        here = ray.get_runtime_context().get_node_id()
        nodes = self._call([w.node_id.remote() for w in self.workers], STARTUP_TIMEOUT_S, "startup")
        return all(node == here for node in nodes)

    def _open_step_channels(self) -> None:
        paths = self._call([w.open_step_channel.remote() for w in self.workers], STARTUP_TIMEOUT_S, "startup")
        if None in paths:  # a worker cannot make a socket (its log says why): all steps take Ray calls
            self._call([w.close_step_channel.remote() for w in self.workers], STARTUP_TIMEOUT_S, "startup")
            return
        for w, path in zip(self.workers, paths):
            self._serving.append(w.serve_steps.remote())
            self._links.append(StepLink(path))

    # -- steps ---------------------------------------------------------------
    def execute(self, inp: ModelInput) -> StepResult:
        self._raise_if_failed()
        wire = self._tables.wire(inp)
        # Rank 0 alone samples: it gets the rows it lacks, the others none.
        first = self._samples.wire(wire)
        rest = dataclasses.replace(wire, samples=[]) if wire.samples and self.size > 1 else wire
        if self._links:
            results = self._step_over_channels(first, rest)
        else:  # by value, not ray.put: a put object costs every rank a fetch from here (~1.7 ms a step at TP=2)
            results = self._call([w.execute.remote(first if rank == 0 else rest)
                                  for rank, w in enumerate(self.workers)], self.step_timeout_s, "step")
        stops = {r.abandoned_at_layer for r in results}
        if len(stops) > 1:  # the safepoint vote failed: the ranks' KV and collectives no longer line up
            raise self._fail(f"tensor-parallel ranks stopped an interrupted step at different layers: "
                             f"{[r.abandoned_at_layer for r in results]}")
        # Rank 0 samples; every rank swapped its own head shard of the same blocks.
        results[0].swap_stall_s = max(r.swap_stall_s for r in results)
        return results[0]

    def _step_over_channels(self, first: ModelInput, rest: ModelInput) -> list[StepResult]:
        frames = [pack(first)] + ([pack(rest)] if self.size > 1 else [])
        deadline = time.monotonic() + self.step_timeout_s
        try:
            for rank, link in enumerate(self._links):
                try:
                    link.send_packed(frames[min(rank, 1)], max(deadline - time.monotonic(), 0.001))
                except TimeoutError:
                    raise RankError(rank, "hung", "did not take its step in") from None
                except OSError as exc:  # its end is gone: the rank died
                    raise RankError(rank, "closed", str(exc)) from None
            return gather(self._links, max(deadline - time.monotonic(), 0.001))
        except RankError as err:
            raise self._rank_failed(err) from None

    def _rank_failed(self, err: RankError) -> ExecutorError:
        if err.kind == "hung":
            return self._fail(f"tensor-parallel worker rank(s) [{err.rank}] did not finish the step "
                              f"within {self.step_timeout_s:g} s (hung?)")
        if err.kind == "failed":
            return self._fail(f"tensor-parallel worker rank {err.rank} failed the step: {err.detail}")
        # Closed: the process is gone. Ray says why once it has noticed,
        # which takes it about a second; not worth waiting longer for.
        cause = "its step channel closed"
        try:
            ray.get(self._serving[err.rank], timeout=DEATH_CAUSE_WAIT_S)
        except RayActorError as exc:
            cause = _summary(exc)
        except RayError:
            pass
        return self._fail(f"tensor-parallel worker rank {err.rank} died during the step: {cause}")

    def interrupt(self, step_id: int) -> None:
        # Every rank gets it; they agree at the safepoint (one all-reduce of
        # the flag), so ranks that see it at different layers still stop at
        # the same one. Fire and forget: a late one finds the step ended.
        for w in self.workers:
            w.interrupt.remote(step_id)

    def check_health(self) -> None:
        self._raise_if_failed()
        self._call([w.ping.remote() for w in self.workers], self.health_timeout_s, "health check")

    def worker_pids(self) -> list[int]:
        """Process id of each rank's actor (for operators and tests)."""
        return self._call([w.ping.remote() for w in self.workers], self.health_timeout_s, "health check")

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise ExecutorError(self._failure)

    def _call(self, refs: list, timeout_s: float, what: str) -> list:
        """The results of one call per rank, in rank order. Raises
        ExecutorError as soon as any rank has died or failed, or once
        ``timeout_s`` has passed without every rank answering."""
        results: list = [None] * len(refs)
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left > 0 and len(pending) > 1:
                # One at a time: a dead rank's error is ready at once even
                # while a surviving rank still waits in a collective for it.
                ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            else:  # the last one (or the only one, with one GPU): a plain blocking get
                ready, pending = pending, []
            for ref in ready:
                rank = refs.index(ref)
                results[rank] = self._get(ref, rank, max(left, 0.0), timeout_s, what)
            if pending and time.monotonic() >= deadline:
                ranks = [refs.index(ref) for ref in pending]
                raise self._fail(f"tensor-parallel worker rank(s) {ranks} did not finish the {what} "
                                 f"within {timeout_s:g} s (hung?)")
        return results

    def _get(self, ref, rank: int, left: float, timeout_s: float, what: str) -> Any:
        """One rank's result, its failure turned into ExecutorError."""
        try:
            return ray.get(ref, timeout=left)
        except GetTimeoutError:
            raise self._fail(f"tensor-parallel worker rank {rank} did not finish the {what} "
                             f"within {timeout_s:g} s (hung?)") from None
        except RayActorError as exc:
            raise self._fail(f"tensor-parallel worker rank {rank} died during the {what}: "
                             f"{_summary(exc)}") from None
        except RayError as exc:
            raise self._fail(f"tensor-parallel worker rank {rank} failed the {what}: {_summary(exc)}") from None

    def _fail(self, reason: str) -> ExecutorError:
        """Record the failure and stop the survivors: their process group has
        lost a member (or a member hangs), so no later step can succeed."""
        log.error("Ray executor failed: %s", reason)
        self._failure = reason
        self._close_links()
        self._kill_workers()
        return ExecutorError(reason)

    # -- teardown ------------------------------------------------------------
    def _kill_workers(self) -> None:
        workers, self.workers = self.workers, []
        for w in workers:
            with contextlib.suppress(Exception):  # already gone is fine
                ray.kill(w, no_restart=True)

    def _close_links(self) -> None:
        links, self._links = self._links, []
        for link in links:
            link.close()  # the rank's serve_steps returns, its default thread free again

    def shutdown(self) -> None:
        self._close_links()
        if self.workers and self._failure is None:
            with contextlib.suppress(RayError):  # a clean exit of process groups that still work
                ray.get([w.close.remote() for w in self.workers], timeout=self.health_timeout_s)
        self._kill_workers()
        if self._rendezvous_file is not None:
            with contextlib.suppress(OSError):
                os.remove(self._rendezvous_file)
            self._rendezvous_file = None
        if self._pg is not None:
            with contextlib.suppress(Exception):  # the cluster may be gone already
                remove_placement_group(self._pg)
            self._pg = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False


def _connect(address: str | None) -> bool:
    """Use the Ray instance this process already joined, join ``address``, or
    start a loopback-only one. True when this process called ``ray.init``
    (and so must call ``ray.shutdown``)."""
    if ray.is_initialized():
        if address:
            log.warning("ray_address %s ignored: this process is already connected to Ray", address)
        return False
    if address:
        ray.init(address=address, configure_logging=False)
    else:
        start_local_ray()
    return True


def _check_shapes(model_dir: str, size: int, hf_overrides: str | None = None) -> None:
    """Build rank 0's model on the meta device (no memory, no weights): raises
    the model's own ValueError when ``size`` does not split its heads or
    features."""
    hf_config = load_hf_config(model_dir, hf_overrides)
    build_model(hf_config, torch.float32, torch.device("meta"), TensorParallel(0, size))


def _on_loopback() -> bool:
    """Whether the Ray instance is a loopback-only single node (all ranks
    then share this machine)."""
    return ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")


def _summary(exc: BaseException) -> str:
    """One line: the worker's own exception, or the first line of Ray's (long) text."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and not isinstance(cause, RayError):
        return f"{type(cause).__name__}: {cause}"
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
