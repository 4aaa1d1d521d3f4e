"""Worker: one device's share of the model. Owns the model weights, the KV
cache tensors and the step's tensors; turns a ModelInput into sampled tokens.
A Ray actor hosts exactly this class (engine/executor/ray.py).

Under tensor parallelism every rank runs every step on the same ModelInput:
the same block tables and slot mapping address each rank's KV cache, which
holds only that rank's KV heads. Rank 0 alone gathers the logits and samples;
the others return no tokens."""

from __future__ import annotations

import logging

import torch

from .batch import ModelInput, SampleSpec
from .config import EngineConfig
from .layers import AttentionMetadata
from .loader import build_model, init_dummy_weights, load_hf_config, load_weights, resolve_dtype
from .parallel import TensorParallel
from .sampler import SampledToken, SamplingRow, make_generator, sample
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but no CUDA device is available")
    return torch.device(name)


class Worker:
    def __init__(self, config: EngineConfig, model_dir: str, tp: TensorParallel | None = None) -> None:
        self.config = config
        self.tp = tp or TensorParallel()
        self.device = pick_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        hf_config = load_hf_config(model_dir)
        self.hf_config = hf_config
        self.dtype = resolve_dtype(hf_config, config.dtype, self.device)
        torch.manual_seed(config.seed)
        self.model = build_model(hf_config, self.dtype, self.device, self.tp)
        if config.load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
        else:
            load_weights(self.model, model_dir)
        self.num_layers, self.num_kv_heads, self.head_dim = self.model.kv_shape  # this rank's KV heads
        self.eos_token_id = getattr(hf_config, "eos_token_id", None)
        if isinstance(self.eos_token_id, list):
            self.eos_token_id = self.eos_token_id[0] if self.eos_token_id else None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    # -- KV cache ----------------------------------------------------------
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.config.block_size * self.num_kv_heads * self.head_dim * elem

    def available_kv_blocks(self) -> int:
        """How many KV blocks fit: the configured number, a fixed host budget on
        CPU, or what the device has left after weights and a profiled step.
        Under tensor parallelism every rank must call this together (the
        profiled step communicates); the executor takes the minimum."""
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if self.device.type == "cpu":
            return max(1, int(cfg.cpu_kv_cache_gb * 2**30) // self.bytes_per_block())
        peak = self._profile_peak_memory()
        free, total = torch.cuda.mem_get_info(self.device)
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
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        inp = ModelInput(
            input_ids=[0] * n, positions=list(range(n)), slot_mapping=list(range(n)),
            query_start_loc=[0, n], seq_lens=[n], block_tables=[list(range(nblocks))],
        )
        self._forward(inp)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.kv_caches = []
        torch.cuda.empty_cache()
        return peak

    def init_cache(self, num_blocks: int) -> None:
        shape = (num_blocks, self.config.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.num_layers)
        ]

    def warm_up(self) -> None:
        """One prefill and one decode step over scratch slots of block 0, run
        before serving: compiles the kernels and exercises every collective,
        so neither lands in the first real step. Block 0's contents are junk
        afterwards, which is harmless: a sequence reads only the slots its own
        earlier steps wrote."""
        n = self.config.block_size // 2
        greedy = [SampleSpec(SamplingParams(temperature=0.0), seed=None)]
        self.execute(ModelInput(
            input_ids=[0] * n, positions=list(range(n)), slot_mapping=list(range(n)),
            query_start_loc=[0, n], seq_lens=[n], block_tables=[[0]], sample_indices=[n - 1], samples=greedy,
        ))
        self.execute(ModelInput(
            input_ids=[0], positions=[n], slot_mapping=[n], query_start_loc=[0, 1], seq_lens=[n + 1],
            block_tables=[[0]], sample_indices=[0], samples=greedy,
        ))

    # -- one step ----------------------------------------------------------
    def _tensor(self, data, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def _forward(self, inp: ModelInput) -> torch.Tensor:
        width = max(len(t) for t in inp.block_tables)
        tables = [t + [0] * (width - len(t)) for t in inp.block_tables]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(inp.slot_mapping),
            block_tables=self._tensor(tables, torch.int32),
            seq_lens=self._tensor(inp.seq_lens, torch.int32),
            query_start_loc=self._tensor(inp.query_start_loc, torch.int32),
            host_q_lens=[b - a for a, b in zip(inp.query_start_loc, inp.query_start_loc[1:])],
            host_seq_lens=inp.seq_lens,
        )
        return self.model(self._tensor(inp.input_ids), self._tensor(inp.positions), self.kv_caches, meta)

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> list[SampledToken]:
        """Run one step; the sampled tokens on rank 0, [] on the other ranks."""
        hidden = self._forward(inp)  # [T, hidden]
        if not inp.sample_indices:
            return []
        logits = self.model.compute_logits(hidden[self._tensor(inp.sample_indices)])  # [S, V] on rank 0
        if logits is None:
            return []
        rows = [
            SamplingRow(
                params=s.params,
                prompt_token_ids=s.prompt_token_ids,
                output_token_ids=s.output_token_ids,
                generator=make_generator(s.seed, self.device) if s.seed is not None else None,
            )
            for s in inp.samples
        ]
        return sample(logits, rows, self.eos_token_id)  # the sampler makes its own fp32 copy

    @torch.inference_mode()
    def logits(self, inp: ModelInput) -> torch.Tensor | None:
        """Logits at the sample positions, for tests comparing with a
        reference; None on ranks other than 0."""
        hidden = self._forward(inp)
        logits = self.model.compute_logits(hidden[self._tensor(inp.sample_indices)])
        return None if logits is None else logits.float()
