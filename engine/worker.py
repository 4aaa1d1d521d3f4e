"""Worker: one device's share of the model and the lifecycle around it. Owns
the model weights, its CacheEngine (device and host KV, engine/cache_engine.py),
its ModelRunner (the step's tensors, engine/model_runner.py) and, when
asked for, its decode CUDA graphs (engine/cuda_graphs.py); turns a
ModelInput into a StepResult: the step's KV moves first, then the forward and
sampling. A Ray actor hosts exactly this class
(engine/executor/ray.py).

Under tensor parallelism every rank runs every step on the same ModelInput:
the same block tables and slot mapping address each rank's KV cache, which
holds only that rank's KV heads. Rank 0 alone gathers the logits and samples;
the others return no tokens."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from fluidserve.engine.batch import ModelInput, PromptLogprobSpec, SampleSpec, StepFailed, StepResult
from fluidserve.engine.cache_engine import CacheEngine
from fluidserve.engine.config import EngineConfig
from fluidserve.engine.cuda_graphs import DecodeGraphs, capture_sizes, graph_mode
from fluidserve.engine.piecewise import PiecewiseGraphs, token_sizes
from fluidserve.engine.piecewise import supports as supports_piecewise
from fluidserve.engine.loader import (build_model, eos_token_ids, held_weights, init_dummy_weights, quantized_linears,
                                      load_hf_config, load_tokenizer, load_weights, model_context_length,
                                      resolve_dtype)
from fluidserve.engine.lora import LoRASlots
from fluidserve.engine.model_runner import ModelRunner
from fluidserve.engine.parallel import TensorParallel, realize_linears
from fluidserve.engine.preemption import PausedForward, Safepoints, StepAbandoned
from fluidserve.engine.quantization import check_packed_weights, checkpoint_quantization
from fluidserve.engine.pooling import pool_rows, resolve_runner
from fluidserve.engine.prompt_logprobs import score_prompts
from fluidserve.engine.runtime import pick_device, runtime_for
from fluidserve.engine.sample_specs import SampleSpecMirror
from fluidserve.engine.sampler import (SampledToken, SamplingRow, make_generator, reads_outputs, sample,
                                      sample_on_device)
from fluidserve.engine.sampling_params import SamplingParams
from fluidserve.engine.structured import StructuredDecoder, TokenMask
from fluidserve.engine.token_history import TokenHistories
from fluidserve.kernels.cache_dtype import cache_dtype

log = logging.getLogger(__name__)

# Errors of the device itself: after one the context is unusable.
_DEVICE_ERRORS = tuple(t for t in (getattr(torch, "AcceleratorError", None),) if t is not None)


def _after_drafts(rows: list[SamplingRow], sample_ids: list[str], drafts: dict[str, list[int]]) -> None:
    """Each verifying sequence's rows after its first, where they read the
    outputs (``reads_outputs``): the drafts before the row's position
    appended to its outputs (and its token history)."""
    seen: dict[str, int] = {}
    for i, sid in enumerate(sample_ids):
        draft = drafts.get(sid)
        if draft is None:
            continue
        j = seen[sid] = seen.get(sid, -1) + 1
        row = rows[i]
        if j and reads_outputs(row.params):
            row.output_token_ids = row.output_token_ids + draft[:j]
            if row.history is not None:
                row.history = np.concatenate((row.history, np.asarray(draft[:j], dtype=row.history.dtype)))


def _add_row(result: StepResult, sid: str, token: SampledToken) -> None:
    """A sampled row into ``result``: a sequence verifying drafts has a row
    at each of its positions, its last in ``sampled`` and the ones before it
    in ``drafted``, in order."""
    prev = result.sampled.get(sid)
    if prev is not None:
        result.drafted.setdefault(sid, []).append(prev)
    result.sampled[sid] = token


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def default_swap_space_gb() -> float:
    """Host memory for swapped KV when ``--swap-space`` is not given: 4 GiB
    (vLLM's default), or a quarter of the memory available now if less."""
    try:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return 4.0
    return min(4.0, avail / 4)


@dataclass
class PendingStep:
    """A step ``Worker.launch`` queued: its forward and draws are on the
    device, its tokens on their way to ``host``; ``result`` waits for them."""

    sample_ids: list[str]
    host: torch.Tensor  # [S] int64, filled by a copy that ``done`` marks
    done: Any

    def result(self) -> StepResult:
        self.done.synchronize()
        return StepResult(sampled={rid: SampledToken(t, None) for rid, t in zip(self.sample_ids, self.host.tolist())})


class Worker:
    def __init__(self, config: EngineConfig, model_dir: str, tp: TensorParallel | None = None) -> None:
        self.config = config
        self.tp = tp or TensorParallel()
        self.device = pick_device(config.device)
        self.runtime = runtime_for(self.device)
        self.runtime.select()
        hf_config = load_hf_config(model_dir, config.hf_overrides)
        self.hf_config = hf_config
        self.dtype = resolve_dtype(hf_config, config.dtype, self.device)
        # The checkpoint's quantized format, checked before the model takes device memory.
        self.quantization = checkpoint_quantization(hf_config, config.quantization)
        self.cache_dtype = cache_dtype(config.cache.kv_cache_dtype, self.dtype)  # what the KV cache stores
        torch.manual_seed(config.seed)
        self.pools = resolve_runner(config.runner, config.convert, hf_config) == "pooling"  # embeddings
        packed = config.quantized_weights == "packed"
        if packed:
            check_packed_weights(self.quantization, config)
        self.model = build_model(hf_config, self.dtype, self.device, self.tp, pooling=self.pools,
                                 max_model_len=config.max_model_len or model_context_length(hf_config),
                                 defer_linears=packed)  # fmt: skip
        if packed:
            realize_linears(self.model, quantized_linears(self.model, model_dir, self.quantization), self.device)
        if config.load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
        else:
            # An embedding model's checkpoint may be the base model alone: no LM head, no "model." prefix.
            load_weights(self.model, model_dir, base_only=self.pools, quantization=self.quantization)
            if self.quantization is not None:
                log.info("%s checkpoint: %s", self.quantization.describe(), held_weights(self.model, self.dtype))
        # Adapter slots on every linear (--enable-lora): adapters arrive with the steps (ModelInput.lora_loads).
        self.lora = (LoRASlots(self.model, config.lora.lora_slots, config.max_lora_rank) if config.enable_lora
                     else None)  # fmt: skip
        self.num_layers, self.num_kv_heads, self.head_dim = self.model.kv_shape  # this rank's KV heads
        self.eos_token_id = getattr(hf_config, "eos_token_id", None)
        if isinstance(self.eos_token_id, list):
            self.eos_token_id = self.eos_token_id[0] if self.eos_token_id else None
        self.cache: CacheEngine | None = None
        self.runner = ModelRunner(self.model, self.device, self.dtype, self.runtime)
        self.histories = TokenHistories()  # the tokens the penalties count, kept as they grow
        self.sample_specs = SampleSpecMirror()  # each sequence's sampler row, as the Ray executor sends them
        # Decode CUDA graphs, captured by warm_up when asked for (off by default).
        self.graphs: DecodeGraphs | None = None
        # Piecewise graphs of the other steps (--piecewise-graphs), captured beside them.
        self.piecewise: PiecewiseGraphs | None = None
        self._graph_mode = graph_mode(config.enforce_eager, self.runtime, self.tp.size)
        # Grammar matchers of constrained sequences; the tokenizer loads on first use.
        stops = [t for t in [self.eos_token_id, *eos_token_ids(hf_config, model_dir)] if t is not None]
        self.structured = StructuredDecoder(lambda: load_tokenizer(config.tokenizer or model_dir),
                                            int(hf_config.vocab_size), stops)
        self.safepoints = Safepoints(config.preemption_safepoint_layers, self.tp, self.device)
        self.paused: PausedForward | None = None  # the last interrupted step's state, until resumed
        self.model.layer_loop.safepoints = self.safepoints
        # Async scheduling: the tokens the last launched step sampled (on the
        # device), which the next launched step's fed rows read, and two
        # host buffers the launched steps' tokens come back in, in turn (a
        # step's tokens are read after the next step is launched).
        self._last_tokens: torch.Tensor | None = None
        self._token_buffers: list[torch.Tensor] = []
        self._launches = 0

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.cache.device_caches if self.cache is not None else []

    # -- KV cache ----------------------------------------------------------
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.cache_dtype).element_size()
        return 2 * self.num_layers * self.config.block_size * self.num_kv_heads * self.head_dim * elem

    def available_kv_blocks(self) -> int:
        """How many KV blocks fit: the configured number, a fixed host budget on
        CPU, or what the device has left after weights and a profiled step.
        Under tensor parallelism every rank must call this together (the
        profiled step communicates); the executor takes the minimum."""
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if not self.runtime.measures_memory:
            return max(1, int(cfg.cpu_kv_cache_gb * 2**30) // self.bytes_per_block())
        peak = self._profile_peak_memory()
        free, total = self.runtime.free_and_total_memory()
        budget = total * cfg.gpu_memory_utilization - (total - free) - peak
        blocks = int(budget // self.bytes_per_block())
        if blocks < 1:
            raise ValueError("gpu_memory_utilization leaves no memory for the KV cache")
        return blocks

    @torch.inference_mode()
    def _profile_peak_memory(self) -> int:
        """Activation memory of the largest step: one prefill of the whole token budget."""
        n = self.config.max_num_batched_tokens
        bs = self.config.block_size
        nblocks = -(-n // bs)
        self.init_cache(nblocks)
        inp = ModelInput(
            input_ids=[0] * n, positions=list(range(n)), slot_mapping=list(range(n)),
            query_start_loc=[0, n], seq_lens=[n], block_tables=[list(range(nblocks))],
        )
        peak = self.runtime.peak_memory(lambda: self._forward(inp))
        self.cache = None
        self.runtime.release_cached_memory()
        return peak

    def available_host_blocks(self) -> int:
        """Host KV blocks for swapping: the configured number, else
        ``swap_space`` GiB (vLLM's flag); 0 turns the host tier off."""
        cfg = self.config
        if cfg.num_host_blocks is not None:
            return cfg.num_host_blocks
        gib = cfg.swap_space if cfg.swap_space is not None else default_swap_space_gb()
        return int(gib * 2**30) // self.bytes_per_block()

    def init_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        self.graphs = self.piecewise = None  # graphs hold the old cache's addresses
        self.runner.tables.clear()  # tables of the old cache's blocks
        self.cache = None  # free the old tensors before the new ones are made
        self.cache = CacheEngine(self.num_layers, self.config.block_size, self.num_kv_heads, self.head_dim,
                                 self.cache_dtype, self.device, num_blocks, num_host_blocks)

    def warm_up(self) -> None:
        """One prefill and one decode step over scratch slots of block 0, run
        before serving: compiles the kernels and exercises every collective,
        so neither lands in the first real step. Block 0's contents are junk
        afterwards, which is harmless: a sequence reads only the slots its own
        earlier steps wrote."""
        n = self.config.block_size // 2
        greedy = [SampleSpec(SamplingParams(temperature=0.0), seed=None)]
        for inp in (
            ModelInput(input_ids=[0] * n, positions=list(range(n)), slot_mapping=list(range(n)),
                       query_start_loc=[0, n], seq_lens=[n], block_tables=[[0]], sample_indices=[n - 1],
                       samples=greedy, sample_ids=["warm-up"]),
            ModelInput(input_ids=[0], positions=[n], slot_mapping=[n], query_start_loc=[0, 1], seq_lens=[n + 1],
                       block_tables=[[0]], sample_indices=[0], samples=greedy, sample_ids=["warm-up"]),
        ):
            result = self.execute(inp)
            if result.failed or result.failed_rows:  # served on in a step, it must stop the start
                raise RuntimeError(f"the warm-up step failed: {result.failed or result.failed_rows}")
        # An embedding model's requests end with their prompts: it never runs a decode step.
        if self._graph_mode is not None and not self.pools:
            self.graphs = self.decode_graphs(capture=self._graph_mode == "capture")
        if self.config.piecewise_graphs:
            if self._graph_mode is not None and supports_piecewise(self.model):
                self.piecewise = self.piecewise_graphs(capture=self._graph_mode == "capture")
            else:
                log.warning("--piecewise-graphs needs decode graphs (CUDA, one GPU, no --enforce-eager) and a "
                            "model family that cuts its forward into pieces (Llama): running mixed steps eagerly")

    def decode_graphs(self, capture: bool) -> DecodeGraphs:
        """Decode-only steps in batch-size buckets over this worker's cache:
        captured as CUDA graphs, or (``capture=False``) run eagerly over the
        same padded static buffers (tests on CPU)."""
        cfg = self.config
        max_len = cfg.max_model_len or model_context_length(self.hf_config)
        width = min(-(-max_len // cfg.block_size), self.kv_caches[0][0].shape[0])  # blocks one sequence may hold
        sizes = capture_sizes(cfg.max_num_seqs, cfg.cuda_graph_sizes)
        return DecodeGraphs(self.model, self.device, self.kv_caches, sizes, width, cfg.block_size, capture=capture,
                            tables=self.runner.tables)

    def piecewise_graphs(self, capture: bool) -> PiecewiseGraphs:
        """The steps decode graphs do not take, in token buckets, attention
        eager between graphed pieces; ``capture=False`` runs the pieces
        eagerly over the same static buffers (tests on CPU)."""
        sizes = token_sizes(self.config.max_num_batched_tokens)
        return PiecewiseGraphs(self.model, self.runner, self.device, self.kv_caches, sizes, capture=capture)

    # -- one step ----------------------------------------------------------
    def _forward(self, inp: ModelInput,
                 feed: Callable[[torch.Tensor], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        for graphs in (self.graphs, self.piecewise):
            if graphs is not None and not inp.lora_slots:  # adapter rows run eagerly (engine/lora.py)
                out = graphs.forward(inp, feed)  # None: the step does not fit a bucket
                if out is not None:
                    return out
        return self.runner.forward(inp, self.kv_caches, feed)

    def _take_in(self, inp: ModelInput) -> None:
        """The step's block tables and sampler rows into the worker's copies
        (sent as what the worker lacks of them, over Ray)."""
        self.runner.tables.sync(inp)
        self.sample_specs.sync(inp)
        for slot, adapter in inp.lora_loads:
            self.lora.load(slot, adapter)

    def _feed(self, input_ids: torch.Tensor) -> None:
        """Rows whose id is ``-j - 1`` take the token the last launched step
        sampled in its row ``j``, on the device: nothing waits for it."""
        last = self._last_tokens
        fed = input_ids < 0
        src = last[(-input_ids - 1).clamp_(0, last.numel() - 1)]
        input_ids.copy_(torch.where(fed, src, input_ids))

    @torch.inference_mode()
    def launch(self, inp: ModelInput) -> PendingStep:
        """Queue a plain decode step and return before its tokens are read
        (async scheduling): no KV moves, grammar, prompt logprobs or
        preemption, and rows ``sampler.device_only`` can draw; with
        ``inp.fed``, rows with a negative id are fed the tokens of the step
        launched before. One worker alone (no tensor parallelism)."""
        if inp.swap_out or inp.swap_in or inp.prompt_logprobs or inp.preemptible or self.tp.size != 1:
            raise ValueError("launch takes a plain decode step of one worker")
        if inp.fed and self._last_tokens is None:
            raise ValueError("a fed step must follow a launched one")
        self._take_in(inp)
        # No moves of its own, but the forward still waits for the last
        # step's copies: blocks its swap-outs freed may be written now.
        self.cache.swap([], [], False)
        self.structured.release(inp.finished_ids)
        try:
            return self._launch(inp)
        except Exception as exc:
            if not self._survivable(exc):
                raise
            # The traceback is told here: the engine hears the message alone.
            log.error("a launched step failed; its requests fail", exc_info=exc)
            raise StepFailed(_describe(exc)) from exc

    def _launch(self, inp: ModelInput) -> PendingStep:
        hidden, sample_idx = self._forward(inp, self._feed if inp.fed else None)
        logits = self.model.compute_logits(hidden[sample_idx])
        rows = [SamplingRow(params=s.params, prompt_token_ids=[], output_token_ids=[], generator=None)
                for s in inp.samples]
        tokens = sample_on_device(logits, rows)
        self._last_tokens = tokens
        if not self._token_buffers or self._token_buffers[0].numel() < tokens.numel():
            size = max(tokens.numel(), self.config.max_num_seqs)
            self._token_buffers = [self.runtime.host_buffer(size, torch.int64) for _ in range(2)]
        host = self._token_buffers[self._launches % 2][:tokens.numel()]
        self._launches += 1
        host.copy_(tokens, non_blocking=True)
        done = self.runtime.event()
        done.record()
        return PendingStep(list(inp.sample_ids), host, done)

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> StepResult:
        """Run one step: its KV moves, then the forward; the sampled tokens
        on rank 0, none on the other ranks."""
        self._last_tokens = None  # a fed step follows a launched one only
        self._take_in(inp)  # first: a step that fails later has still taken its tables and rows in
        stall = self.cache.swap(inp.swap_out, inp.swap_in, inp.wait_for_swap_in)
        result = StepResult(swap_stall_s=stall)
        self.structured.release(inp.finished_ids)
        if not inp.input_ids:
            return result  # a step of copies only
        # A failure after the copies were queued: they stand (the scheduler
        # counts them done), the step's tokens do not.
        try:
            return self._run(inp, result)
        except Exception as exc:
            # Sampling, past the last collective, catches its own: under
            # tensor parallelism what reaches here stopped this rank before a
            # collective the other ranks now wait in.
            if self.tp.size != 1 or not self._survivable(exc):
                raise
            log.error("a step failed; its requests fail", exc_info=exc)
            return StepResult(swap_stall_s=stall, failed=_describe(exc))

    def _run(self, inp: ModelInput, result: StepResult) -> StepResult:
        """The step's forward and sampling into ``result``."""
        # A paused forward waits through other steps for the one that resumes
        # it (or is replaced by the next pause: at most one is kept).
        if self.paused is not None and self.paused.step_id == inp.resume_of:
            self.model.layer_loop.resume_next(self.paused)
            self.paused = None
        if inp.preemptible:
            self.safepoints.arm(inp.step_id)
        try:
            hidden, sample_idx = self._forward(inp)  # [T, hidden], [S]
        except StepAbandoned as stop:  # before any sampling: no sampler state moved
            result.abandoned_at_layer = stop.layer
            if stop.hidden is not None:
                self.paused = PausedForward(inp.step_id, stop.position, stop.hidden)
                result.paused = True
            return result
        finally:
            self.safepoints.disarm()
            self.model.layer_loop.resume_next(None)
        # Grammar masks of constrained rows, made while a GPU still runs the
        # forward queued above (rank 0 alone samples). A failure here waits
        # for the logits (the other ranks are on their way to gather them).
        mask_error = token_mask = None
        if self.tp.is_first:
            try:
                token_mask = self.structured.fill(inp.sample_ids, inp.samples, inp.drafts)
            except Exception as exc:  # noqa: BLE001 - rows are sampled one by one below
                mask_error = exc
        if inp.prompt_logprobs:
            result.prompt_logprobs = self._score_prompts(hidden, inp.prompt_logprobs, result)
        if inp.pooling and self.tp.is_first:  # every rank holds the whole hidden states
            result.pooled = pool_rows(hidden, inp.pooling)
        if not inp.sample_indices:
            return result
        logits = self.model.compute_logits(hidden[sample_idx])  # [S, V] on rank 0
        if logits is None:
            return result
        if mask_error is None:
            try:
                tokens = sample(logits, self._rows(inp), self.eos_token_id, token_mask)  # on its own fp32 copy
                if inp.drafts:
                    for sid, token in zip(inp.sample_ids, tokens):
                        _add_row(result, sid, token)
                else:
                    result.sampled = dict(zip(inp.sample_ids, tokens))
                return result
            except Exception as exc:  # noqa: BLE001 - rows are sampled one by one below
                mask_error = exc
        if not self._survivable(mask_error):
            raise mask_error
        log.warning("sampling the step's rows together raised (%s): sampling each alone", _describe(mask_error))
        self._sample_alone(inp, logits, result)
        return result

    def _score_prompts(self, hidden: torch.Tensor, specs: list[PromptLogprobSpec], result: StepResult) -> dict:
        """The step's prompt logprobs. Scoring the requests together raised
        (a request's parameters reaching a fault, or a long prompt's logits
        running out of memory): each request is scored again alone, and
        the one that raises again fails (``result.failed_requests``) while
        the others keep their scores. Under tensor parallelism the logits
        are a collective that every rank reaches alike, so there a fault
        stays the step's."""
        try:
            return score_prompts(hidden, specs, self.model.compute_logits) or {}
        except Exception as exc:  # noqa: BLE001 - requests are scored one by one below
            if self.tp.size != 1 or not self._survivable(exc):
                raise
            log.warning("scoring the step's prompts together raised (%s): scoring each request alone", _describe(exc))
        scores: dict = {}
        for rid in dict.fromkeys(spec.request_id for spec in specs):
            try:
                alone = [spec for spec in specs if spec.request_id == rid]
                scores |= score_prompts(hidden, alone, self.model.compute_logits) or {}
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                if not self._survivable(exc):
                    raise
                log.error("scoring the prompt of %s failed; it fails", rid, exc_info=exc)
                result.failed_requests[rid] = _describe(exc)
        return scores

    def _rows(self, inp: ModelInput) -> list[SamplingRow]:
        """The step's sampler rows; a seeded row's generator made afresh. Row
        ``j`` of a sequence verifying drafts samples the position after its
        first ``j`` drafts, so a row whose sampling reads the outputs so far
        (penalties, bad words, min_tokens) reads those drafts as outputs."""
        rows = [
            SamplingRow(
                params=s.params,
                prompt_token_ids=s.prompt_token_ids,
                output_token_ids=s.output_token_ids,
                generator=make_generator(s.seed, self.device) if s.seed is not None else None,
                history=history,
            )
            for s, history in zip(inp.samples, self.histories.rows(inp.sample_ids, inp.samples))
        ]
        if inp.drafts:
            _after_drafts(rows, inp.sample_ids, inp.drafts)
        return rows

    def _sample_alone(self, inp: ModelInput, logits: torch.Tensor, result: StepResult) -> None:
        """Sampling the step's rows together raised: each row again alone,
        so that the one whose request holds the fault fails and the rest get
        the token they would have had (fresh generators: a seeded row draws
        as it would have in the batch)."""
        rows_of: dict[str, list[int]] = {}  # each sequence's rows (several where it verifies drafts)
        for i, sid in enumerate(inp.sample_ids):
            rows_of.setdefault(sid, []).append(i)
        masks: dict[str, TokenMask | None] = {}  # made once for a sequence's rows
        for i, (sid, row) in enumerate(zip(inp.sample_ids, self._rows(inp))):
            if sid in result.failed_rows:  # a later row of a sequence verifying drafts
                continue
            try:
                own = rows_of[sid]
                if sid not in masks:
                    masks[sid] = self.structured.fill([sid] * len(own), [inp.samples[k] for k in own], inp.drafts)
                mask = masks[sid] and masks[sid].row(own.index(i))
                _add_row(result, sid, sample(logits[i:i + 1], [row], self.eos_token_id, mask)[0])
            except Exception as exc:  # noqa: BLE001 - this row's request fails, the others go on
                if not self._survivable(exc):
                    raise
                log.error("sampling %s failed; its request fails", sid, exc_info=exc)
                result.failed_rows[sid] = _describe(exc)
                result.sampled.pop(sid, None)
                result.drafted.pop(sid, None)

    def _survivable(self, exc: Exception) -> bool:
        """Whether the worker can serve on after ``exc`` ended a step: not
        after a device error (CUDA's are sticky, every later call fails
        too), which a synchronize brings out if the exception hid it."""
        if isinstance(exc, _DEVICE_ERRORS):
            return False
        try:
            self.runtime.synchronize()
        except Exception:  # noqa: BLE001 - any error here means the device is gone
            log.exception("the device failed with the step")
            return False
        if isinstance(exc, torch.cuda.OutOfMemoryError):  # torch.OutOfMemoryError from 2.5 on
            self.runtime.release_cached_memory()
        return True

    def interrupt(self, step_id: int) -> None:
        """Stop step ``step_id`` at its next safepoint if it is preemptible
        (called from another thread while it runs; harmless once it ended)."""
        self.safepoints.flag.request(step_id)

    @torch.inference_mode()
    def logits(self, inp: ModelInput) -> torch.Tensor | None:
        """Logits at the sample positions, for tests comparing with a
        reference; None on ranks other than 0."""
        hidden, sample_idx = self._forward(inp)
        logits = self.model.compute_logits(hidden[sample_idx])
        return None if logits is None else logits.float()
