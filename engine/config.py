"""EngineConfig: every knob of an engine, frozen, constructible without a model
on disk. It holds the scheduler's, the KV cache's and the parallelism's own
configs; each setting is declared once, in the config that owns it, with
its default, its check and its flag (engine/args.py makes the flags from
the declarations). ``EngineConfig.create(**flat)`` builds the tree from flat
names, as ``LLM(model, **kwargs)`` passes them, and ``config.block_size``
reads through to ``config.cache.block_size``."""

from __future__ import annotations

import json
import dataclasses
from dataclasses import dataclass

from fluidserve.kvcache.config import BLOCK_SIZES, CacheConfig, ConfigTree, check_all, setting
from fluidserve.scheduler.config import SchedulerConfig
from fluidserve.engine.speculative import parse_speculative_config

# Decode CUDA graphs unless --enforce-eager, as vLLM does: the graph tests
# (tests/engine/test_cuda_graphs.py -m gpu) pass on an H100, which is what
# confirms a captured graph leaves eager's tokens and KV (benchmarks/gpu_check.sh).
CUDA_GRAPHS_BY_DEFAULT = True

# scheduler/router.py's policies (a test checks the two agree); spelled out
# here so reading a config imports no router.
ROUTING_POLICIES = ("prefix-aware", "least-loaded", "round-robin")
# The quantized checkpoints' methods engine/quantization.py reads (named
# here so that the CLI, which sets OpenMP's policy before torch loads,
# reads them without importing torch).
QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "gptq", "awq")
# vLLM's names for its Marlin kernels over the same checkpoints: a vLLM
# command line naming them names the checkpoint's method (how the weights
# are held is --quantized-weights').
QUANTIZATION_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}
# How a quantized checkpoint's weights are held (engine/loader.py, quantized_linears).
QUANTIZED_WEIGHTS = ("dequantized", "packed")
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32", "fp16", "bf16", "fp32")


@dataclass(frozen=True)
class ParallelConfig:
    executor: str = setting("local", "local: in-process worker; ray: one Ray actor per GPU", choices=("local", "ray"))
    tensor_parallel_size: int = setting(1, "GPUs (Ray workers) per model", aliases=("-tp",))
    data_parallel_size: int = setting(
        1, "engine replicas behind this one endpoint, each a whole engine (scheduler, KV cache, workers) in a "
           "Ray actor of its own: data_parallel_size x tensor_parallel_size devices", aliases=("-dp",))
    routing_policy: str = setting(
        "prefix-aware", "how a request picks its replica (with --data-parallel-size > 1): prefix-aware sends it "
                        "where its prompt's prefix is likely cached unless that replica is too far behind",
        choices=ROUTING_POLICIES)
    routing_balance_threshold_ms: float = setting(
        1000.0, "prefix-aware routing: how much more predicted backlog than the least-loaded replica the "
                "replica holding a prompt's prefix may have, beyond the prefill the hit saves, and still be "
                "chosen (benchmarks/routing.py)", metavar="MS")
    ray_transport: str = setting(
        "auto", "how steps reach the tensor-parallel Ray workers, and requests and outputs the data-parallel "
                "replicas: auto takes a Unix socket each where they share this process's node (~0.07 ms a round "
                "trip, outputs pushed as they come) and Ray calls elsewhere (~0.9 ms; outputs by long polling); "
                "ray-calls takes Ray calls everywhere", choices=("auto", "ray-calls"))
    ray_address: str | None = setting(None, "join this Ray cluster (multi-node); default: start a local one "
                                            "on 127.0.0.1", metavar="ADDRESS")

    def __post_init__(self) -> None:
        check_all(self, [("tensor_parallel_size", self.tensor_parallel_size >= 1, "must be positive"),
                         ("data_parallel_size", self.data_parallel_size >= 1, "must be positive"),
                         ("routing_balance_threshold_ms", self.routing_balance_threshold_ms >= 0,
                          "must be >= 0")])


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = setting(False, "serve LoRA adapters (PEFT's format) beside the base model: a request "
                                       "names one as its model")
    max_loras: int = setting(1, "adapter slots kept on the device, every one usable in every step (raised to "
                                "the number of --lora-modules)")
    max_lora_rank: int = setting(16, "the largest rank an adapter may have (every slot is this wide)")
    # (name, folder) of the adapters loaded at start: serve/cli.py's --lora-modules.
    lora_modules: tuple[tuple[str, str], ...] = setting((), cli=False)

    def __post_init__(self) -> None:
        check_all(self, [("max_loras", self.max_loras >= 1, "must be positive"),
                         ("max_lora_rank", self.max_lora_rank >= 1, "must be positive"),
                         ("lora_modules", not self.lora_modules or self.enable_lora, "need --enable-lora")])

    @property
    def lora_slots(self) -> int:
        return max(self.max_loras, len(self.lora_modules))


@dataclass(frozen=True)
class EngineConfig(ConfigTree):
    # Local HF directory or hub id; None: the built-in tiny model. The server
    # takes it as its positional argument or --model (serve/cli.py).
    model: str | None = setting(None, cli=False)
    tokenizer: str | None = setting(None, "tokenizer id or path (default: the model's)")
    served_model_name: str | None = setting(None, cli=False)  # serve/cli.py: --served-model-name takes several
    dtype: str = setting("auto", "auto: float32 on CPU, the checkpoint's half type on GPU; half = float16, "
                                 "float = float32", choices=DTYPES[:6])
    load_format: str = setting("auto", "dummy: random weights from the model's config", choices=("auto", "dummy"))
    quantization: str | None = setting(
        None, "the quantized checkpoint's method, which config.json declares anyway: fp8 (block- or "
              "tensor-scaled FP8), compressed-tensors (FP8), gptq (4- and 8-bit) or awq (4-bit GEMM); its weights "
              "are dequantized to --dtype as they load (weights are never quantized at load)",
        aliases=("-q",), choices=QUANTIZATION_METHODS + tuple(QUANTIZATION_ALIASES))
    quantized_weights: str = setting(
        "dequantized", "how a quantized checkpoint's weights are held: dequantized (in --dtype, the memory and "
                       "speed of the full-precision model) or packed (as the checkpoint keeps them: GPTQ/AWQ "
                       "integers, a quarter of a 16-bit weight's memory at 4 bits, or float8, half; "
                       "kernels/int_linear.py and fp8_linear.py run them)",
        choices=QUANTIZED_WEIGHTS)
    device: str = setting("auto", "auto: CUDA where torch sees one, else the CPU", choices=("auto", "cpu", "cuda"))
    seed: int = setting(0, "seed of the dummy weights and of sampling without a per-request seed")
    max_model_len: int | None = setting(None, "context length (default: the model's)")
    profile_path: str | None = setting(None, "measured cost model from `fluidserve profile -o` "
                                             "(default: analytic roofline)", flag="--profile",
                                       metavar="PROFILE_JSON")
    # Without a profile the scheduler's cost model learns from the steps run
    # (scheduler/calibration.py); None: when an online SLO needs the model.
    calibrate_cost_model: bool | None = setting(None, cli=False)
    enforce_eager: bool = setting(
        not CUDA_GRAPHS_BY_DEFAULT,
        "run every step eagerly; --no-enforce-eager"
        + (" (the default)" if CUDA_GRAPHS_BY_DEFAULT else "")
        + " captures decode-only steps as CUDA graphs at start-up (CUDA, one GPU: elsewhere every step runs "
          "eagerly)")
    # None: on where the device is CUDA (where the host's work per step is
    # what batch-1 decode waits on), off on the CPU.
    async_scheduling: bool | None = setting(
        None, "queue a decode-only step before the previous step's tokens are read, so the host's work "
              "(outputs, stop checks, the next input) overlaps the device's (one in-process worker; plain "
              "sampling rows: no logprobs, seed, penalties or grammar); a stream that stops on EOS or a stop "
              "string costs one discarded token (default: on with CUDA, off on the CPU)")
    # None: on in `fluidserve serve`, whose idle OpenMP threads spin
    # (serve/cli.py); off in LLM, a run that owns its machine, whose numbers
    # then never depend on what else runs.
    yield_busy_cores: bool | None = setting(
        None, "CPU, in-process worker: compute on fewer of torch's threads while this process's threads wait "
              "for cores other work holds, so no op waits on a teammate that shares its core; back on all of "
              "them when the neighbour leaves or a probe finds the cores free (engine/cpu_share.py) "
              "(default: on in `fluidserve serve`, off in LLM)")
    cuda_graph_sizes: tuple[int, ...] | None = setting(
        None, "batch sizes captured as decode graphs (default: 1 2 4 ... 256, up to --max-num-seqs)")
    piecewise_graphs: bool = setting(
        False, "also capture, for steps of up to 512 tokens that decode graphs do not take (prefill chunks, "
               "mixed steps), every stretch between two attention calls as a CUDA graph, attention eager "
               "between them (Llama family, with decode graphs)")
    runner: str = setting(
        "auto", "generate: completions, chat and the rest; pooling: embeddings (/v1/embeddings, /score, "
                "/rerank) of the final hidden states, and nothing generated (a sequence classifier: /classify "
                "in place of /v1/embeddings); auto: pooling for a checkpoint of the base model alone "
                "(LlamaModel, Qwen3Model, ...) or a classifier (...ForSequenceClassification), else generate",
        choices=("auto", "generate", "pooling"))
    convert: str = setting("auto", "embed: serve a generative checkpoint as an embedding model (--runner pooling)",
                           choices=("auto", "none", "embed"))
    pooler_config: str | None = setting(
        None, 'the embedding\'s pooling as vLLM\'s JSON: {"pooling_type": "LAST" | "MEAN" | "CLS", '
              '"use_activation": false (no L2 normalization), "dimensions": N} (default: the checkpoint\'s '
              'sentence-transformers pooling, else LAST, normalized)')
    hf_overrides: str | None = setting(
        None, "a JSON object of config.json keys set over the checkpoint's, as vLLM's: "
              '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
              '"is_original_qwen3_reranker": true} serves a causal LM trained as a reranker as a classifier '
              "whose head is its LM head's rows of those tokens")
    speculative_config: str | None = setting(
        None, 'speculative decoding as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": K, '
              '"prompt_lookup_max": N, "prompt_lookup_min": M}: each decode step also verifies up to K tokens '
              "that followed the latest N..M tokens where they occurred before in the prompt or outputs "
              "(engine/speculative.py); each step verifies those drafts that cut the mean time per token, "
              "from the step times it measured and each sequence's acceptance rate (engine/draft_policy.py; "
              '"adaptive": false verifies all, as vLLM); num_speculative_tokens_per_batch_size ranges set K by '
              "the step's batch size instead; rows with penalties or a thinking budget read the drafts before "
              "them as outputs, a grammar's rows are masked by the grammar after them; steps run synchronously "
              "(no --async-scheduling)", metavar="JSON")
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        sizes = self.cuda_graph_sizes
        check_all(self, [
            ("dtype", self.dtype in DTYPES, f"must be one of {DTYPES}"),
            ("load_format", self.load_format in ("auto", "dummy"), "must be auto or dummy"),
            ("device", self.device in ("auto", "cpu", "cuda"), "must be auto, cpu or cuda"),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 1, "must be positive"),
            ("block_size", self.cache.block_size in BLOCK_SIZES, f"must be one of {BLOCK_SIZES}"),
            ("cuda_graph_sizes", sizes is None or (len(sizes) > 0 and all(isinstance(n, int) and n >= 1
                                                                          for n in sizes)),
             "must be positive batch sizes"),
            ("hf_overrides", self.hf_overrides is None or _json_object(self.hf_overrides), "must be a JSON object"),
        ])
        parse_speculative_config(self.speculative_config)  # its own errors name what is wrong


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
