"""LLMEngine: the iteration-level loop. Owns the live requests and turns each
step's StepPlan into a ModelInput, runs it on the executor, and hands the
sampled tokens to its OutputProcessor (stop checks, detokenization,
RequestOutputs; engine/output_processor.py).

A step, read aloud: the scheduler plans (what runs, which KV moves), the
executor runs it, the output processor appends each sampled token to its
sequence and builds the outputs, and the scheduler is told what ran and
what stopped.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from fluidserve.kernels.ops import kernel_path
from fluidserve.kvcache.manager import slot_of, slots
from fluidserve.kvcache.prefix_cache import salted_root
from fluidserve.scheduler.cost_model import cost_model_for_engine
from fluidserve.scheduler.plan import StepOutcome, StepPlan
from fluidserve.scheduler.request_state import RequestClass, SeqState, SeqStatus
from fluidserve.scheduler.scheduler import Scheduler
from fluidserve.engine.batch import ModelInput, PoolSpec, PromptLogprobSpec, SampleSpec, StepFailed, StepResult
from fluidserve.engine.config import EngineConfig
from fluidserve.engine.cpu_share import CpuShare
from fluidserve.engine.detokenizer import TextStream, byte_table
from fluidserve.engine.executor import make_executor
from fluidserve.engine.executor.local import LocalExecutor
from fluidserve.engine.lora import Adapter, AdapterRegistry, Loaded
from fluidserve.engine.loader import (eos_token_ids, is_tiny_model, load_hf_config, load_tokenizer,
                                      model_context_length, resolve_model_dir)
from fluidserve.engine.output_processor import OutputProcessor
from fluidserve.engine.outputs import RequestOutput
from fluidserve.engine.pooling import (
    check_dimensions,
    is_classifier,
    load_classifier,
    model_pooling,
    pool_range,
    resolve_runner,
)
from fluidserve.engine.preemption import PreemptionPolicy, safepoint_shares
from fluidserve.engine.request import Request, Sequence
from fluidserve.engine.sampler import device_only, reads_outputs
from fluidserve.engine.sampling_params import SamplingParams
from fluidserve.engine.draft_policy import Acceptance, DraftPolicy
from fluidserve.engine.grammar_drafts import GrammarDrafts
from fluidserve.engine.speculative import (NgramDrafter, PredictionDrafter, PredictionIndex, accepted, draft_limit,
                                          parse_speculative_config)
from fluidserve.engine.structured import GrammarCompiler, xgrammar
from fluidserve.engine.tiny_model import default_tiny_model_dir
from fluidserve.engine.runtime import pick_device, runtime_for

log = logging.getLogger(__name__)


# vLLM's buckets of tokens per engine step (upper bounds, inclusive).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# A failed step fails its own requests and the engine serves on; this many
# in a row say the fault is not in any request, and the engine stops.
MAX_FAILED_STEPS_IN_A_ROW = 4

# Async scheduling with drafts: a step queued before the last one's tokens
# are read carries no drafts (a draft continues the token not yet read), so
# such steps follow one another only after a proposal that kept none, and
# only while no sequence's n-gram recurs that would be verified; at most
# this many before drafts are proposed again from the tokens read.
MAX_BLIND_STEPS = 16


class StepsKeepFailingError(RuntimeError):
    """Steps keep failing whatever they run: the engine cannot serve."""


@dataclass
class EngineStats:
    requests: dict[tuple[str, str, str], int] = field(default_factory=dict)  # (class, status, queue) -> count
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_host_blocks_total: int = 0
    kv_host_blocks_used: int = 0
    num_preemptions: int = 0  # recomputes + swap-outs
    num_recomputes: int = 0
    num_swaps: int = 0  # swap-outs + swap-ins
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    swap_stall_seconds: float = 0.0
    # KV loans: requests admitted into device blocks owed to streams parked on
    # the host (or to a starving request), because they leave before any claim could be met.
    num_backfills: int = 0
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_host_query_tokens: int = 0
    prefix_cache_host_hit_tokens: int = 0
    num_checkpoint_evictions: int = 0  # swap-outs of requests with a checkpoint (ConServe §4.4)
    checkpoint_bytes: int = 0  # KV copied to the host by incremental checkpointing
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_steps: int = 0
    offline_generation_tokens_total: int = 0
    # Layer-wise preemption: steps abandoned at a safepoint, the request
    # preemptions they made (each request of the step), and their tokens.
    num_steps_abandoned: int = 0
    num_abandoned_preemptions: int = 0
    # Tokens computed again: of steps abandoned without their state kept,
    # and of paused steps given up before they resumed.
    abandoned_tokens: int = 0
    num_steps_resumed: int = 0  # paused steps continued from their safepoint
    # Async scheduling: decode steps queued before the previous step's tokens were read.
    num_steps_launched_ahead: int = 0
    # Speculative decoding (vLLM's spec_decode counters): sequences' steps
    # that verified drafts, the draft tokens verified, those that stood, and
    # those that stood by their position among a step's drafts.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # Drafts the adaptive policy did not verify: where they cost the step more than they would save.
    spec_num_withheld_tokens: int = 0
    # Steps whose forward raised (the device sound), and the requests failed
    # by them or by a row whose sampling raised; the engine served on.
    num_failed_steps: int = 0
    num_failed_requests: int = 0
    # --yield-busy-cores: the threads steps compute on now (0: not watched),
    # how often it changed (a thread left while the team waited for cores, or
    # came back), and the trials of one thread fewer or more that decided it.
    cpu_threads: int = 0
    num_cpu_thread_changes: int = 0
    num_cpu_thread_trials: int = 0
    # Tokens per step (vLLM's iteration_tokens_total): steps per bucket of
    # ITERATION_TOKEN_BUCKETS (the last for larger ones), and their sum. A
    # tuple, replaced per step, so a copy of the stats is a snapshot.
    iteration_tokens_buckets: tuple[int, ...] = (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1)
    iteration_tokens_sum: int = 0
    cache_config: dict[str, str] = field(default_factory=dict)  # vLLM's cache_config_info labels
    # With --enable-lora, vLLM's lora_requests_info: (adapter slots, adapters
    # with requests waiting, adapters with requests running), names sorted.
    lora_info: tuple[int, tuple[str, ...], tuple[str, ...]] | None = None

    def observe_iteration(self, num_tokens: int) -> None:
        if num_tokens:  # a step of KV copies only runs no token
            i = bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)
            b = self.iteration_tokens_buckets
            self.iteration_tokens_buckets = (*b[:i], b[i] + 1, *b[i + 1:])
            self.iteration_tokens_sum += num_tokens


@dataclass
class _Launched:
    """A step queued on the device whose tokens have not been read."""

    plan: StepPlan  # decodes only: its sample rows are its scheduled sequences, in order
    handle: object  # Executor.launch's: .result() waits for the tokens
    start: float
    failed: str | None = None  # the launch raised (StepFailed): no handle


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.is_tiny_default = config.model is None
        model_dir = (default_tiny_model_dir() if config.model is None
                     else resolve_model_dir(config.model, config.load_format))
        self.model_dir = Path(model_dir)
        self.model_name = config.served_model_name or (
            "fluidserve-tiny-random" if self.is_tiny_default else str(config.model)
        )
        self.hf_config = load_hf_config(self.model_dir, config.hf_overrides)
        # What it serves: generation, or embeddings (engine/pooling.py) and their defaults.
        self.runner = resolve_runner(config.runner, config.convert, self.hf_config)
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_dir)
        # A sequence classifier pools as an embedding model does, then its head classifies the vector.
        self.classifier = (load_classifier(self.model_dir, self.hf_config, self.tokenizer)
                           if is_classifier(self.hf_config) else None)
        task = "embed" if self.classifier is None else "classify"
        self.pooling = (model_pooling(self.model_dir, config.pooler_config, task) if self.runner == "pooling"
                        else None)
        if self.pooling is not None:
            check_dimensions(self.pooling.dimensions, self.hf_config)
        byte_table(self.tokenizer, skip_special_tokens=True)  # the default's, now: 0.5 s at 128k tokens
        self.vocab_size = int(self.hf_config.vocab_size)
        self.max_model_len = config.max_model_len or model_context_length(self.hf_config)
        self.executor = make_executor(config, str(self.model_dir))
        self.eos_token_id = self.executor.eos_token_id
        # Every EOS id of config.json and generation_config.json ends a sequence.
        self.eos_token_ids = {t for t in [self.eos_token_id, *eos_token_ids(self.hf_config, self.model_dir)]
                              if t is not None}
        cache = config.cache
        self.bytes_per_block = self.executor.bytes_per_block
        if self.executor.num_kv_blocks * cache.block_size < self.max_model_len:
            raise ValueError(
                f"num_kv_blocks: {self.executor.num_kv_blocks} blocks of {cache.block_size} tokens cannot hold "
                f"one sequence of max_model_len={self.max_model_len}"
            )
        # The policy consults the cost model (a measured profile, else the
        # roofline of this model on this device) to place arrivals.
        device = pick_device(config.device)
        self.cost_model = cost_model_for_engine(config, self.hf_config, device.type,
                                                 runtime_for(device).name)
        # The scheduler owns the KV accounting over the blocks the executor found room for.
        interval, attention = safepoint_shares(config.scheduler.preemption_safepoint_layers, self.hf_config)
        self.scheduler = Scheduler.create(
            # What the device decides: the swap rate its host link allows;
            # whether KV copies run beside the forward (the CPU copies before it, on the same cores).
            dataclasses.replace(config.scheduler, max_swap_blocks_per_step=self._swap_blocks_per_step(),
                                copies_beside_online=device.type != "cpu"),
            cache, self.executor.num_kv_blocks, self.executor.num_host_blocks,
            cost_model=self.cost_model,
            safepoint_interval_share=interval, safepoint_attention_share=attention,
        )
        self.requests: dict[str, Request] = {}
        self.seqs: dict[str, Sequence] = {}
        self._finished_constrained: list[str] = []  # told to the worker with the next step
        self.stats_ = EngineStats()
        self.output_processor = OutputProcessor(self.requests, self.seqs, self.eos_token_ids, self.stats_,
                                                self.kv.block_size, self._block_filled, self._grammar_finished,
                                                self.classifier)
        self._lost_tokens = 0  # of abandoned steps whose state the worker did not keep
        self.preemption = PreemptionPolicy(self.executor.interrupt)
        self.speculative = parse_speculative_config(config.speculative_config)
        if self.speculative is not None:
            self.stats_.spec_accepted_per_position = (0,) * self.speculative.num_speculative_tokens
        self._draft_policy = DraftPolicy() if self.speculative is not None and self.speculative.adaptive else None
        # Constrained sequences' drafts, shaped by their grammars (engine/grammar_drafts.py).
        self._grammar_drafts = (GrammarDrafts(self.tokenizer, self._grammar_compiler())
                                if self.speculative is not None else None)
        wanted = config.async_scheduling if config.async_scheduling is not None else device.type == "cuda"
        self._async = wanted and self.executor.can_launch
        if config.async_scheduling and not self._async:
            log.warning("--async-scheduling needs the in-process executor (--executor local, one GPU): "
                        "steps run synchronously")
        self._pending: _Launched | None = None  # async scheduling: the step queued, unread
        # With drafts: steps that may still be queued blind (set by each proposal: _propose_drafts).
        self._blind_left = 0
        # With drafts: the last step, whose sequences' drafts the next step() proposes before it plans,
        # so a step's tokens are returned before the lookups (a prompt's first: its whole index).
        self._unproposed: StepPlan | None = None
        # Built on the thread that steps the engine (EngineThread), which owns its OpenMP team.
        self._cpu_share = (CpuShare.for_this_thread() if config.yield_busy_cores and device.type == "cpu"
                           and config.executor == "local" else None)
        self._failed_in_a_row = 0
        self._read_at = 0.0  # when the last launched step's tokens were read
        # LoRA adapters by served name (--enable-lora); those given at start are loaded now.
        lora = config.lora
        self.adapters = (AdapterRegistry(self.hf_config, lora.lora_slots, lora.max_lora_rank)
                         if lora.enable_lora else None)  # fmt: skip
        for name, path in lora.lora_modules:
            self.add_lora(name, path)
        log.info("engine ready: %s on %s (%s attention kernels%s), %d KV blocks of %d tokens (+%d on the host%s), "
                 "max_model_len %d%s", self.model_name, runtime_for(device).name or device, kernel_path(device),
                 "" if config.enforce_eager else ", decode CUDA graphs where the device has them",
                 self.kv.num_blocks, cache.block_size, self.kv.num_host_blocks,
                 "" if cache.kv_cache_dtype == "auto" else f"; K/V stored as {cache.kv_cache_dtype}",
                 self.max_model_len, " (built-in tiny random-weight model)" if is_tiny_model(self.model_dir) else "")

    @property
    def kv(self):
        """The scheduler's KV accounting, to read (figures, tests): the
        scheduler alone changes it."""
        return self.scheduler.kv

    # -- requests ----------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        klass: str | RequestClass = RequestClass.ONLINE,
        arrival_time: float | None = None,
        final_only: bool = False,
    ) -> None:
        """Validate and enqueue a request. Raises ValueError naming the bad
        parameter; nothing is enqueued then. A ``final_only`` request yields
        only its finished output (equal to a streamed one's last output)."""
        params = (params or SamplingParams()).with_extra_eos(self.eos_token_ids - {self.eos_token_id})
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        klass = RequestClass(klass)
        if params.structured_outputs is not None:
            xgrammar()  # a missing package is this request's error, not a failed step
        lora = None
        if params.lora is not None:
            lora = self.adapters.loaded.get(params.lora) if self.adapters is not None else None
            if lora is None:
                raise ValueError(f"model: no LoRA adapter named {params.lora!r} is loaded")
        if (params.pooling is None) != (self.pooling is None):
            raise ValueError(f"model: {self.model_name} serves "
                             + ("embeddings (--runner pooling), not generation" if self.pooling is not None
                                else "generation; embeddings need --runner pooling"))
        pooling = None
        if self.pooling is not None:
            pooling = params.pooling.over(self.pooling)
            if params.pooling.dimensions is not None:
                if self.classifier is not None:
                    raise ValueError("dimensions: cut an embedding; a classifier's output has one value per label")
                check_dimensions(pooling.dimensions, self.hf_config)
            params = dataclasses.replace(params, pooling=pooling)
        text, token_ids = self._tokenize(prompt)
        # An embedding request is scheduled as a prompt and one sampling row it never samples.
        max_tokens = self._max_tokens(len(token_ids), params) if pooling is None else self._pool_length(token_ids)
        now = time.monotonic() if arrival_time is None else arrival_time
        req = Request(request_id, text, token_ids, params, klass, now, max_tokens, final_only=final_only,
                      launchable=params.prompt_logprobs is None and pooling is None and device_only(params),
                      lora_slot=-1 if lora is None else lora.slot,
                      plain=params.prompt_logprobs is None and pooling is None)
        lazy_text = final_only and params.n == 1 and not params.stop
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]  # nothing predicts the first prompt token
        # An adapter's KV differs from the base model's: its prefix-cache entries hang from a root of its own.
        root = salted_root(params.cache_salt, None if lora is None else lora.cache_key)
        keys = self.scheduler.prompt_block_keys(token_ids, root)
        stop_ids = frozenset(params.stop_token_ids).union(() if params.ignore_eos else self.eos_token_ids)
        predicted: PredictionIndex | None = None
        for i in range(params.n):
            # A request scoring its prompt must compute every position: it
            # takes no prefix-cache hits, but offers its blocks to others.
            state = SeqState(f"{request_id}#{i}", len(token_ids), max_tokens, now, klass, block_keys=list(keys),
                             reads_cache=req.prompt_logprobs is None and (pooling is None or pooling.reads_cache),
                             cache_root=root)
            seq = Sequence(i, state, req, TextStream(self.tokenizer, token_ids, params),
                           logprobs=[] if params.logprobs is not None else None,
                           new_logprobs=[] if params.logprobs is not None else None,
                           stop_ids=stop_ids, max_output_len=min(max_tokens, self.max_model_len - len(token_ids)),
                           lazy_text=lazy_text)
            spec = self.speculative
            if spec is not None and pooling is None:
                seq.drafter = NgramDrafter(token_ids, seq.output_token_ids, spec.prompt_lookup_min,
                                           spec.prompt_lookup_max)
                if params.prediction_token_ids:
                    if predicted is None:  # one index of the prediction for the request's n sequences
                        predicted = PredictionIndex(params.prediction_token_ids, spec.prompt_lookup_min,
                                                    spec.prompt_lookup_max)
                    seq.drafter = PredictionDrafter(params.prediction_token_ids, seq.output_token_ids, seq.drafter,
                                                    predicted)
                seq.acceptance = Acceptance()
            req.seqs.append(seq)
        self.requests[request_id] = req
        for seq in req.seqs:
            self.seqs[seq.seq_id] = seq
            self.scheduler.add(seq.state, now)
        self.stats_.prompt_tokens_total += len(token_ids) * params.n

    # -- LoRA adapters -------------------------------------------------------
    def add_lora(self, name: str, path: str | Adapter, replace: bool = False) -> Loaded:
        """Serve the PEFT adapter in folder ``path`` (or one ``read_lora``
        read) as ``name``: requests whose params name it generate with it
        from the next step on (``replace``: in place of the adapter of that
        name, which keeps its slot until its requests are done). Raises
        ValueError naming what is wrong (no --enable-lora, a name in use,
        no free slot, an adapter that does not fit the model); nothing
        changes then."""
        if self.adapters is None:
            raise ValueError("lora_name: LoRA adapters need --enable-lora")
        if name == self.model_name:
            raise ValueError(f"lora_name: {name!r} is the base model's name")
        busy = {req.lora_slot for req in self.requests.values() if req.lora_slot >= 0}
        loaded = self.adapters.add(name, path, busy, replace)
        log.info("LoRA adapter %s loaded from %s into slot %d", name, loaded.path, loaded.slot)
        return loaded

    def read_lora(self, path: str) -> Adapter:
        """The adapter in folder ``path``, read and checked: safe to call
        from another thread while the engine steps (the server does, so an
        adapter's files are not read between two steps)."""
        if self.adapters is None:
            raise ValueError("lora_name: LoRA adapters need --enable-lora")
        return self.adapters.read(path)

    def remove_lora(self, name: str) -> None:
        """Stop serving adapter ``name``; requests already generating with it
        finish with it. ValueError when no such adapter is loaded."""
        if self.adapters is None or name not in self.adapters.loaded:
            raise ValueError(f"lora_name: no LoRA adapter named {name!r} is loaded")
        self.adapters.remove(name)
        log.info("LoRA adapter %s unloaded", name)

    def lora_names(self) -> dict[str, str]:
        """The adapters served now: name -> the folder each was read from."""
        return {} if self.adapters is None else {a.name: a.path for a in self.adapters.loaded.values()}

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})")
        return None, token_ids

    def _pool_length(self, token_ids: list[int]) -> int:
        """An embedding request's prompt fits max_model_len (it generates
        nothing): its one unsampled row's token count."""
        if not token_ids:
            raise ValueError("input: an embedding needs at least one token")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"input: {len(token_ids)} tokens exceed max_model_len={self.max_model_len}")
        return 1

    def _max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        if prompt_len >= self.max_model_len:
            raise ValueError(
                f"prompt: {prompt_len} tokens leave no room to generate within max_model_len={self.max_model_len}"
            )
        room = self.max_model_len - prompt_len
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ValueError(
                f"max_tokens: prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds max_model_len={self.max_model_len}"
            )
        return params.max_tokens

    def abort(self, request_id: str) -> None:
        """Drop a request at once and free its KV blocks; it yields no more output."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            self.seqs.pop(seq.seq_id, None)
            self.scheduler.finish(seq.seq_id)
            if req.params.structured_outputs is not None:
                self._grammar_finished(seq.seq_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._pending is not None

    def _swap_blocks_per_step(self) -> int | None:
        """Blocks whose copy hides behind the cheapest step (FastServe §4.2:
        swaps overlap compute); None when the cost model knows no link speed."""
        transfer = getattr(self.cost_model, "transfer_time", None)
        if transfer is None:
            return None
        per_block = transfer(self.bytes_per_block)
        return max(1, int(self.cost_model.min_iteration_time() / per_block)) if per_block > 0 else None

    # -- the step ----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self._cpu_share is not None:
            self._cpu_share.tick()
        if self._pending is not None:
            return self._read_launched()
        if self._unproposed is not None:
            self._propose_drafts(self._unproposed)
            self._unproposed = None
        now = time.monotonic()
        plan = self.scheduler.schedule(now)
        if plan.is_empty:
            return []
        if self._async and self._launchable(plan):
            launched = self._launch(plan, now)
            if launched.failed is not None:
                return self._fail_step(plan, launched.failed, now)
            self._pending = launched
            return self._read_launched()
        result, inp = self._execute(plan)
        if result.failed is not None:
            return self._fail_step(plan, result.failed, now)
        self._failed_in_a_row = 0
        if result.failed_requests:
            self._fail_whole_requests(result)
        rejected = self._accept_drafts(inp.drafts, result) if inp.drafts and not result.abandoned else {}
        outputs, finished = self.output_processor.process(result, now)
        if result.failed_rows:
            outputs += self._fail_rows(result.failed_rows, now, finished)
        took = time.monotonic() - now
        self.scheduler.update_from_output(plan, StepOutcome(took, now, finished,
                                                            abandoned=result.abandoned, paused=result.paused,
                                                            # kept with the paused step until it resumes
                                                            paused_input=inp if result.paused else None,
                                                            rejected=rejected))
        if self.speculative is not None and not result.abandoned:
            if self._draft_policy is not None and not result.failed_rows:
                drafts = _decode_drafts(plan)
                if drafts is not None:
                    self._draft_policy.observe_step(len(plan.scheduled), drafts, took)
            self._unproposed = plan
        self._count_step(plan, took)
        self.stats_.swap_stall_seconds += result.swap_stall_s
        return outputs

    def _count_step(self, plan: StepPlan, seconds: float) -> None:
        """A step that computed: into the stats and, for its trials, the CPU watch."""
        tokens = plan.num_batched_tokens
        if self._cpu_share is not None:
            self._cpu_share.step_done(tokens, seconds)
        self.stats_.num_steps += 1
        self.stats_.observe_iteration(tokens)

    def idle(self) -> None:
        """Between requests, on the engine's thread: keeps the CPU watch's
        windows short (``--yield-busy-cores``), so the next request's first
        step acts on the load around it, not on an average since the last step."""
        if self._cpu_share is not None:
            self._cpu_share.tick()

    # -- async scheduling ------------------------------------------------------
    def _launchable(self, plan: StepPlan) -> bool:
        """A decode-only step of plain rows, with nothing else for the worker
        to do: it may run through ``Executor.launch``."""
        if plan.has_copies or plan.preemptible or plan.resumes or self._finished_constrained or not plan.scheduled:
            return False
        seqs = self.seqs
        for item in plan.scheduled:
            if item.num_tokens != 1 or not item.samples or not seqs[item.request_id].request.launchable:
                return False
        return True

    def _read_launched(self) -> list[RequestOutput]:
        """Queue the step after the launched one where the scheduler can plan
        it blind (``Scheduler.continue_decodes``), then read the launched
        step's tokens and process them: this host work overlaps the device's
        on the step just queued. A sequence that stopped on the token read
        here ran one more token in that step; it is dropped unread."""
        cur, self._pending = self._pending, None
        nxt = self._launch_after(cur)
        result = cur.handle.result()
        read_at = time.monotonic()
        # The device began this step when it was queued or when the one
        # before it ended (read back then), whichever came later.
        step_time = read_at - max(cur.start, self._read_at)
        self._read_at = read_at
        self._failed_in_a_row = 0
        outputs, finished = self.output_processor.process(result, cur.start)
        self.scheduler.update_from_output(cur.plan, StepOutcome(step_time, cur.start, finished))
        self._count_step(cur.plan, step_time)
        if self.speculative is not None:
            if self._draft_policy is not None:  # a decode without drafts, timed as queued steps run
                self._draft_policy.observe_step(len(cur.plan.scheduled), 0, step_time)
            if nxt is None:  # the next step is planned from these tokens: its drafts too
                self._unproposed = cur.plan
        if nxt is not None:
            if nxt.failed is not None:
                outputs += self._fail_step(nxt.plan, nxt.failed, nxt.start)
            elif any(item.request_id in self.seqs for item in nxt.plan.scheduled):
                self._pending = nxt
            else:  # every sequence it ran has stopped: nothing to read of it
                nxt.handle.result()
        return outputs

    def _launch_after(self, cur: _Launched) -> _Launched | None:
        seqs = self.seqs
        ahead: dict[str, int] = {}  # sequence -> its sample row in ``cur``
        for row, item in enumerate(cur.plan.scheduled):
            sid = item.request_id
            seq = seqs.get(sid)
            # Gone (stopped, aborted), or stopping on the token ``cur`` samples: nothing after it.
            if seq is not None and len(seq.output_token_ids) + 1 < seq.max_output_len:
                ahead[sid] = row
        if not ahead or self._finished_constrained:
            return None
        if self.speculative is not None:
            if self._blind_left <= 0 or self._would_draft(list(ahead)):
                return None
            self._blind_left -= 1
        plan = self.scheduler.continue_decodes(cur.plan, list(ahead))
        if plan is None:
            return None
        self.stats_.num_steps_launched_ahead += 1
        return self._launch(plan, time.monotonic(), ahead)

    def _would_draft(self, seq_ids: list[str]) -> bool:
        """Whether the step after the running one would verify drafts, as far
        as the tokens read tell (the running step samples one more): each
        sequence's newest n-gram as of them, where it recurs, offered to
        the adaptive policy at this batch; with every draft verified, any."""
        seqs, k = self.seqs, self.speculative.drafts_at(len(seq_ids))
        offers = []
        for sid in seq_ids:
            seq = seqs[sid]
            if seq.drafter is None:
                continue
            n = len(seq.drafter.propose(_draft_limit(seq, k, ahead=1)))
            if n:
                if self._draft_policy is None:
                    return True
                offers.append((seq.acceptance, n))
        return bool(offers) and self._draft_policy.pays(len(seq_ids), offers)

    def _launch(self, plan: StepPlan, start: float, ahead: dict[str, int] | None = None) -> _Launched:
        try:
            return _Launched(plan, self.executor.launch(self._model_input(plan, ahead)), start)
        except StepFailed as exc:
            return _Launched(plan, None, start, failed=str(exc))

    def _fail_step(self, plan: StepPlan, error: str, start: float) -> list[RequestOutput]:
        """The step's forward raised (or its launch) and the device is sound: it
        computed nothing (as an abandoned step: its KV copies stand, its
        tokens do not, none of its blocks enters the prefix cache). Each
        request it ran fails with ``error``, keeping the tokens it had, and
        leaves; the rest are served on. A fault that is in no one request
        fails every step: after a few in a row the engine stops."""
        self._failed_in_a_row += 1
        if self._failed_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
            raise StepsKeepFailingError(f"{self._failed_in_a_row} steps in a row failed, the last with {error}")
        log.error("a step failed (%s): its requests fail, the engine serves on", error)
        stopped: list[str] = []
        outputs = self._fail_requests({item.request_id: error for item in plan.scheduled}, start, stopped)
        self.scheduler.update_from_output(plan, StepOutcome(time.monotonic() - start, start, stopped,
                                                            abandoned=True))
        self.stats_.num_steps += 1  # also the step ids of preemptible steps: each must be new
        self.stats_.num_failed_steps += 1
        return outputs

    def _fail_whole_requests(self, result: StepResult) -> None:
        """Requests whose prompt logprobs raised even alone join the failed
        rows, every sequence of theirs, their tokens of the step dropped:
        each is answered once, with the error."""
        for rid, error in result.failed_requests.items():
            req = self.requests.get(rid)
            for seq in req.seqs if req is not None else ():
                result.failed_rows[seq.seq_id] = error
                result.sampled.pop(seq.seq_id, None)

    def _fail_rows(self, failed_rows: dict[str, str], start: float, finished: list[str]) -> list[RequestOutput]:
        """Rows whose sampling or prompt scoring raised even alone: their
        requests fail; the step's other rows stand. Not a failed step: the
        fault is the request's."""
        log.error("%d row(s) failed (%s): their requests fail", len(failed_rows), next(iter(failed_rows.values())))
        return self._fail_requests(failed_rows, start, finished)

    def _fail_requests(self, errors: dict[str, str], start: float, stopped: list[str]) -> list[RequestOutput]:
        """Fail the request of each sequence in ``errors`` (sequence id ->
        the error) with its error: their finished outputs. Every sequence of
        theirs goes on ``stopped``, for the scheduler to release."""
        failing: dict[str, tuple[Request, str]] = {}
        for sid, error in errors.items():
            seq = self.seqs.get(sid)
            if seq is not None:  # not stopped or aborted already
                failing.setdefault(seq.request.request_id, (seq.request, error))
        outputs = [self.output_processor.fail(req, error, start) for req, error in failing.values()]
        stopped += [seq.seq_id for req, _ in failing.values() for seq in req.seqs]
        self.stats_.num_failed_requests += len(failing)
        return outputs

    def _execute(self, plan: StepPlan) -> tuple[StepResult, ModelInput]:
        """Run the plan (its result and the input it ran); a preemptible one
        is announced to the preemption policy while it runs, so an online
        arrival can interrupt it."""
        if plan.resumes:  # the paused step's input again: its tables and copies are already applied
            inp = self.scheduler.paused.input
            inp.resume_of = inp.step_id
            inp.swap_out, inp.swap_in, inp.wait_for_swap_in, inp.finished_ids = [], [], False, []
            inp.retired_keys = []
            inp.lora_loads = []  # sent with the step that paused; a slot may hold another adapter since
        else:
            inp = self._model_input(plan)
        if not plan.preemptible or self.config.scheduler.preemption_safepoint_layers == 0 or not inp.input_ids:
            return self.executor.execute(inp), inp
        inp.preemptible, inp.step_id = True, self.stats_.num_steps  # unique: counts every step run
        self.preemption.step_started(inp.step_id)
        try:
            result = self.executor.execute(inp)
        finally:
            self.preemption.step_ended()
        if result.abandoned:
            self.stats_.num_steps_abandoned += 1
            self.stats_.num_abandoned_preemptions += len(plan.scheduled)
            if not result.paused:
                self._lost_tokens += plan.num_batched_tokens
        return result, inp

    def _model_input(self, plan: StepPlan, ahead: dict[str, int] | None = None) -> ModelInput:
        """The step's input. ``ahead``: the plan continues a launched step
        whose tokens are unread (async scheduling): each sequence decodes one
        position past what the scheduler has counted, fed on the device the
        token of its sample row in that step."""
        inp = ModelInput(swap_out=plan.swap_out, swap_in=plan.swap_in, finished_ids=self._finished_constrained,
                         retired_keys=self.kv.take_retired_keys(),
                         fed=ahead is not None)
        if self.adapters is not None:
            inp.lora_loads = self.adapters.take_loads()
        self._finished_constrained = []
        scored: dict[str, int] = {}  # request id -> prompt positions scored once this step has run
        bs = self.kv.block_size
        seqs, tables, keys = self.seqs, self.kv.block_tables, self.kv.table_keys  # the scheduler's: one copy of each
        # Bound appends: a decode row is a handful of them (this loop runs
        # once per scheduled sequence per step).
        add_id, add_pos, add_slot = inp.input_ids.append, inp.positions.append, inp.slot_mapping.append
        add_qsl, add_len, add_table = inp.query_start_loc.append, inp.seq_lens.append, inp.block_tables.append
        add_idx, add_spec, add_sid = inp.sample_indices.append, inp.samples.append, inp.sample_ids.append
        add_key = inp.table_keys.append
        num_tokens = 0
        for item in plan.scheduled:
            seq = seqs[item.request_id]
            table = tables[item.request_id]
            start = seq.state.num_computed_tokens
            n = item.num_tokens
            req = seq.request
            sample = item.samples
            if ahead is not None:
                start += 1
                add_id(-1 - ahead[item.request_id])
                add_pos(start)
                add_slot(slot_of(table, start, bs))
            elif n == 1 and req.plain:
                # A decode (or a one-token chunk): the token at position start.
                prompt = req.prompt_token_ids
                add_id(prompt[start] if start < len(prompt) else seq.output_token_ids[start - len(prompt)])
                add_pos(start)
                add_slot(slot_of(table, start, bs))
            elif item.drafts:
                # A decode and the drafts after it, each position a sampling row (engine/speculative.py).
                draft = inp.drafts[item.request_id] = seq.draft[:item.drafts]
                inp.input_ids += seq.tokens(start, start + 1)
                inp.input_ids += draft
                inp.positions += range(start, start + n)
                inp.slot_mapping += slots(table, start, start + n, bs)
            else:
                end = start + n
                if req.prompt_logprobs is not None:
                    self._score_prompt(req, start, end, num_tokens, scored, inp)
                if req.params.pooling is not None:
                    self._pool_rows(req, start, end, num_tokens, inp)
                    sample = False  # its "sampling" row completes the embedding instead
                inp.input_ids += seq.tokens(start, end)
                inp.positions += range(start, end)
                inp.slot_mapping += slots(table, start, end, bs)
            num_tokens += n
            add_qsl(num_tokens)
            add_len(start + n)
            add_table(table)
            add_key(keys[item.request_id])
            if sample:
                spec = seq.sample_spec
                # Made before and unseeded: nothing in it moves (its outputs are the live list).
                if spec is None or spec.params.seed is not None:
                    spec = self._sample_spec(seq)
                if item.drafts:
                    for j, row in enumerate(self._draft_rows(seq, spec, item.drafts)):
                        add_idx(num_tokens - n + j)
                        add_spec(row)
                        add_sid(item.request_id)
                add_idx(num_tokens - 1)
                add_spec(spec)
                add_sid(item.request_id)
        if self.adapters is not None:
            # Each row's adapter slot, only where some row has one: the workers see a base-only step at a glance.
            rows = [seqs[item.request_id].request.lora_slot for item in plan.scheduled]
            if max(rows, default=-1) >= 0:
                inp.lora_slots = rows
        if plan.swapped_in:
            inp.wait_for_swap_in = not set(plan.swapped_in).isdisjoint(item.request_id for item in plan.scheduled)
        return inp

    @staticmethod
    def _score_prompt(req: Request, start: int, end: int, first_index: int, scored: dict[str, int],
                      inp: ModelInput) -> None:
        """Score the prompt positions this chunk [start, end) of one of the
        request's sequences computes and no earlier step (or other sequence
        of this step) scored: the hidden state at position p predicts prompt
        token p + 1. A recompute repeats positions already scored; those are
        skipped, so none is reported twice or lost."""
        prompt = req.prompt_token_ids
        done = scored.get(req.request_id, len(req.prompt_logprobs))  # tokens 0 .. done-1 have entries
        lo, hi = max(start, done - 1), min(end, len(prompt) - 1)
        if lo >= hi:
            return
        inp.prompt_logprobs.append(PromptLogprobSpec(
            req.request_id, first_index + lo - start, prompt[lo + 1:hi + 1], req.params.prompt_logprobs))
        scored[req.request_id] = hi + 1

    @staticmethod
    def _pool_rows(req: Request, start: int, end: int, first_index: int, inp: ModelInput) -> None:
        """The rows of chunk [start, end) of an embedding request that its
        vector takes (engine/pooling.py); the chunk that ends the prompt
        completes the vector."""
        prompt_len = len(req.prompt_token_ids)
        lo, hi = pool_range(req.params.pooling, start, end, prompt_len, req.pool_count)
        final = end == prompt_len
        if hi > lo or final:
            inp.pooling.append(PoolSpec(req.request_id, first_index + lo - start, hi - lo, final))

    @staticmethod
    def _sample_spec(seq: Sequence) -> SampleSpec:
        """The sequence's sampler row for this step: made once, then only the
        per-step fields change (its token history is the live output list)."""
        spec = seq.sample_spec
        n_out = len(seq.output_token_ids)
        if spec is None:
            p = seq.request.params
            # A grammar matcher on the worker is checked against (and if need
            # be rebuilt from) the outputs so far.
            needs_history = reads_outputs(p) or p.structured_outputs is not None
            spec = seq.sample_spec = SampleSpec(
                params=p, seed=None,
                prompt_token_ids=seq.request.prompt_token_ids if p.repetition_penalty != 1.0 else [],
                output_token_ids=seq.output_token_ids if needs_history else [],
            )
        if spec.params.seed is not None:
            spec.seed = _row_seed(spec.params.seed, seq.index, n_out)
        return spec

    @staticmethod
    def _draft_rows(seq: Sequence, spec: SampleSpec, drafts: int) -> list[SampleSpec]:
        """The sampling rows of a verifying step before its last (``spec``,
        which this turns into the last's): row ``j`` samples output position
        ``n_out + j``, with the seed that position would have had."""
        seed = spec.params.seed
        if seed is None:
            return [spec] * drafts
        n_out = len(seq.output_token_ids)
        rows = [dataclasses.replace(spec, seed=_row_seed(seed, seq.index, n_out + j)) for j in range(drafts)]
        spec.seed = _row_seed(seed, seq.index, n_out + drafts)
        return rows

    def _accept_drafts(self, drafts: dict[str, list[int]], result: StepResult) -> dict[str, int]:
        """Each verifying sequence's rows against its drafts: ``drafted``
        then holds, for it, the list of tokens that stand (the drafts its
        rows confirmed, then the first row's token that differs, or the row
        after the last draft). Returns the drafts rejected per sequence."""
        rejected: dict[str, int] = {}
        stats = self.stats_
        per_position = list(stats.spec_accepted_per_position)
        policy = self._draft_policy
        for sid, draft in drafts.items():
            last = result.sampled.get(sid)
            if last is None:  # its row failed, or the sequence stopped while the step ran
                continue
            rows = result.drafted.get(sid, [])
            rows.append(last)
            m = accepted(rows, draft)
            result.drafted[sid] = rows[:m + 1]
            rejected[sid] = len(draft) - m
            stats.spec_num_drafts += 1
            stats.spec_num_draft_tokens += len(draft)
            stats.spec_num_accepted_tokens += m
            seq = self.seqs.get(sid)
            if policy is not None and seq is not None and seq.acceptance is not None:
                policy.observe_verify(seq.acceptance, len(draft), m)
            if seq is not None and seq.draft_from_prediction:
                seq.drafter.accepted += m
                seq.drafter.rejected += len(draft) - m
            for j in range(m):
                per_position[j] += 1
        stats.spec_accepted_per_position = tuple(per_position)
        return rejected

    def _propose_drafts(self, plan: StepPlan) -> None:
        """Drafts for the next decode of each sequence that just sampled: its
        drafter looks its newest n-gram up; the adaptive policy then keeps,
        of all the step's drafts, those that pay (engine/draft_policy.py)."""
        seqs = self.seqs
        # The batch the next step is likely to have: this one's, less those that stopped.
        batch = sum(item.request_id in seqs for item in plan.scheduled)
        k = self.speculative.drafts_at(batch)
        offered: list[Sequence] = []
        for item in plan.scheduled:
            seq = seqs.get(item.request_id)
            if seq is None or seq.drafter is None:
                continue
            if not item.samples:  # a prompt's chunk: indexed now, not all at its first lookup
                seq.drafter.index(seq.state.num_computed_tokens)
                continue
            out = seq.output_token_ids
            params = seq.request.params
            limit = _draft_limit(seq, k)
            seq.draft = seq.drafter.propose(limit)
            seq.draft_from_prediction = isinstance(seq.drafter, PredictionDrafter) and seq.drafter.from_prediction
            if params.structured_outputs is not None and self._grammar_drafts is not None:
                seq.draft = self._grammar_drafts.propose(seq.seq_id, params, out, seq.draft, limit)
            seq.state.num_draft_tokens = len(seq.draft)
            if seq.draft:
                offered.append(seq)
        policy = self._draft_policy
        if policy is not None and offered:
            counts = policy.choose(batch, [(seq.acceptance, len(seq.draft)) for seq in offered])
            for seq, n in zip(offered, counts):
                del seq.draft[n:]
                seq.state.num_draft_tokens = n
        # Async scheduling: steps may go blind after a proposal that kept no draft (_launch_after).
        self._blind_left = 0 if any(seq.draft for seq in offered) else MAX_BLIND_STEPS

    def _block_filled(self, seq: Sequence) -> None:
        """Prompt + outputs just filled a KV block: the scheduler keys it."""
        n = len(seq.request.prompt_token_ids) + len(seq.output_token_ids)
        bs = self.kv.block_size
        self.scheduler.block_filled(seq.state, seq.tokens(n - bs, n), n)

    def _grammar_compiler(self) -> Callable[[], GrammarCompiler]:
        """The grammars the drafting matchers use: the worker's compiler where
        the worker runs in this process (one compile a grammar), else one of
        the engine's own, made on first use."""
        if isinstance(self.executor, LocalExecutor):
            structured = self.executor.worker.structured
            return lambda: structured.compiler
        own: list[GrammarCompiler] = []

        def compiler() -> GrammarCompiler:
            if not own:
                own.append(GrammarCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids)))
            return own[0]

        return compiler

    def _grammar_finished(self, seq_id: str) -> None:
        """A constrained sequence stopped: the worker drops its grammar
        matcher with the next step's input; the engine's drafting one goes now."""
        self._finished_constrained.append(seq_id)
        if self._grammar_drafts is not None:
            self._grammar_drafts.release(seq_id)

    # -- figures -----------------------------------------------------------
    def stats(self) -> EngineStats:
        s = self.stats_
        s.requests = self.scheduler.counts()
        s.kv_blocks_total = self.kv.num_blocks
        s.kv_blocks_used = self.kv.num_used_blocks
        s.kv_host_blocks_total = self.kv.num_host_blocks
        s.kv_host_blocks_used = self.kv.num_used_host_blocks
        c = self.scheduler.counters
        s.num_preemptions = c.num_preemptions
        s.num_recomputes = c.num_recomputes
        s.num_checkpoint_evictions = c.num_checkpoint_evictions
        s.abandoned_tokens = self._lost_tokens + c.dropped_pause_tokens
        s.num_steps_resumed = c.num_resumes
        s.num_backfills = c.num_backfills
        s.checkpoint_bytes = c.checkpoint_blocks * self.bytes_per_block
        s.num_swaps = c.num_swap_outs + c.num_swap_ins
        s.swap_out_bytes = c.swap_out_blocks * self.bytes_per_block
        s.swap_in_bytes = c.swap_in_blocks * self.bytes_per_block
        s.prefix_cache_query_tokens = self.kv.prefix_stats.query_tokens
        s.prefix_cache_hit_tokens = self.kv.prefix_stats.hit_tokens
        s.prefix_cache_host_query_tokens = self.kv.prefix_stats.host_query_tokens
        s.prefix_cache_host_hit_tokens = self.kv.prefix_stats.host_hit_tokens
        if self._draft_policy is not None:
            s.spec_num_withheld_tokens = self._draft_policy.withheld
        if self._cpu_share is not None:
            share = self._cpu_share
            s.cpu_threads, s.num_cpu_thread_changes, s.num_cpu_thread_trials = (share.held, share.changes,
                                                                                 share.trials)
        if self.adapters is not None:
            running: set[str] = set()
            waiting: set[str] = set()
            for req in self.requests.values():
                if req.params.lora is not None:
                    on_device = any(seq.state.status is SeqStatus.RUNNING for seq in req.seqs)
                    (running if on_device else waiting).add(req.params.lora)
            s.lora_info = (self.adapters.slots, tuple(sorted(waiting)), tuple(sorted(running)))
        if not s.cache_config:  # as vLLM's CacheConfig.metrics_info(): every setting, and the pools' sizes
            cache = self.config.cache
            s.cache_config = {f.name: str(getattr(cache, f.name)) for f in dataclasses.fields(cache)}
            s.cache_config.update(num_gpu_blocks=str(self.kv.num_blocks), num_cpu_blocks=str(self.kv.num_host_blocks),
                                  cache_dtype=cache.kv_cache_dtype)
        return s

    def check_health(self) -> None:
        """Raise ExecutorError if a worker is dead (called while idle)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()


_ids = itertools.count()


def _draft_limit(seq: Sequence, k: int, ahead: int = 0) -> int:
    """Drafts ``seq`` may verify next, of ``k``, with ``ahead`` tokens sampled
    but not yet read (a step queued blind samples one)."""
    return draft_limit(k, len(seq.output_token_ids) + ahead, seq.max_output_len, seq.request.params.min_tokens)


def _decode_drafts(plan: StepPlan) -> int | None:
    """The drafts a step of decodes (each with its drafts) and nothing else
    verified; None for any other step (a prefill chunk, KV copies, a resumed
    one): what the draft policy times."""
    if plan.has_copies or plan.resumes:
        return None
    drafts = 0
    for item in plan.scheduled:
        if not item.samples or item.num_tokens != 1 + item.drafts:
            return None
        drafts += item.drafts
    return drafts


def _row_seed(seed: int, index: int, position: int) -> int:
    """A sampling row's seed: fresh per (request seed, completion, output
    position), so a seeded draw is reproducible whatever else shares the
    batch, stateless across workers, and the same whether the position is
    sampled alone or among a step's drafts."""
    return hash((seed, index, position)) & 0x7FFF_FFFF_FFFF_FFFF


def next_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{next(_ids)}"
