"""Finding a checkpoint, reading its config and tokenizer, and putting its
weights into our model classes: safetensors first, PyTorch ``.bin`` as the
fallback, or random ``dummy`` weights from the config alone (benchmarks).
Also what a checkpoint says about generation: every end-of-sequence id of
``config.json`` and ``generation_config.json``, and the sampling defaults of
``generation_config.json``.

Under tensor parallelism each worker reads only its own shard of every split
weight (the ``ShardSpec`` its parameter carries, engine/parallel.py); from
safetensors that is a slice read, not the whole tensor."""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fluidserve.engine.models import model_class
from fluidserve.engine.parallel import (
    HeldWeights, QuantizedWeight, ShardSpec, TensorParallel, deferred_linear_weights, fused_pieces,
    prepack_linears, shard_spec,
)
from fluidserve.engine.quantization import CheckpointFormat, GroupedCodes, is_fp8

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
# Keys some checkpoints carry that are not parameters of ours.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")


# Set once by the CLI (``--trust-remote-code``) before anything is loaded:
# lets a checkpoint's own config or tokenizer classes load. The model itself
# always runs on our built-in implementations, never on checkpoint code.
_trust_remote_code = False


def set_trust_remote_code(allowed: bool) -> None:
    global _trust_remote_code
    _trust_remote_code = bool(allowed)


def resolve_model_dir(model: str, load_format: str = "auto", revision: str | None = None) -> Path:
    """A local directory as is; otherwise a hub id (at ``revision``: a
    branch, tag or commit) fetched into the HF cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/", "~")):
        raise ValueError(f"model: {model!r} is not a model directory")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.model", "*.txt", "*.tiktoken"]
    if load_format != "dummy":
        patterns.append("*.safetensors")
    local = Path(snapshot_download(model, revision=revision, allow_patterns=patterns))
    if load_format != "dummy" and not list(local.glob("*.safetensors")):
        local = Path(snapshot_download(model, revision=revision, allow_patterns=patterns + ["*.bin"]))
    return local


# Multimodal checkpoints served for their text alone: the model type -> the
# text model's architecture, and where the checkpoint keeps its weights
# (transformers' older layout and its newer one).
TEXT_OF_MULTIMODAL = {"gemma3": "Gemma3ForCausalLM", "mistral3": "MistralForCausalLM"}
TEXT_PREFIXES = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                 "model.language_model.": "model."}


def load_hf_config(model_dir: Path, overrides: str | None = None):
    """The checkpoint's config; ``overrides`` (``--hf-overrides``, a JSON
    object) sets its keys over the file's. A multimodal checkpoint of
    ``TEXT_OF_MULTIMODAL`` (Gemma 3 4B and up, Mistral Small 3.1 and up)
    gives its text model's config:
    the server takes text only, and its vision tower stays unread."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=_trust_remote_code)
    text_arch = TEXT_OF_MULTIMODAL.get(config.model_type)
    if text_arch is not None:
        top, config = config, copy.deepcopy(config.text_config)
        config.architectures = [text_arch]
        config.checkpoint_prefixes = TEXT_PREFIXES
        # transformers ties the multimodal model's head by the outer config's flag.
        config.tie_word_embeddings = bool(getattr(top, "tie_word_embeddings", config.tie_word_embeddings))
    for key, value in (json.loads(overrides) if overrides else {}).items():
        setattr(config, key, value)
    return config


def load_tokenizer(path: Path | str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=_trust_remote_code)


# Sampling fields of generation_config.json that become request defaults.
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _as_ids(value) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def read_generation_config(folder: Path | str) -> dict:
    """``generation_config.json`` of ``folder`` as a dict; {} when absent or unreadable."""
    path = Path(folder) / "generation_config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def eos_token_ids(hf_config, model_dir: Path | str) -> list[int]:
    """Every end-of-sequence id the checkpoint declares, config first: an id
    or a list in ``config.json``, more in ``generation_config.json``
    (Llama-3 instruct models end turns with an id only the latter lists)."""
    ids = _as_ids(getattr(hf_config, "eos_token_id", None))
    text_config = getattr(hf_config, "text_config", None)
    if text_config is not None:
        ids += _as_ids(getattr(text_config, "eos_token_id", None))
    ids += _as_ids(read_generation_config(model_dir).get("eos_token_id"))
    return list(dict.fromkeys(ids))


def generation_defaults(folder: Path | str) -> dict:
    """The sampling defaults ``generation_config.json`` sets (temperature,
    top_p, top_k, min_p, repetition_penalty), for requests that leave them
    unset. A config with ``do_sample: false`` asks for greedy decoding."""
    data = read_generation_config(folder)
    out = {k: data[k] for k in GENERATION_DEFAULT_FIELDS
           if isinstance(data.get(k), (int, float)) and not isinstance(data.get(k), bool)}
    if data.get("do_sample") is False and "temperature" not in out:
        out["temperature"] = 0.0
    return out


def resolve_dtype(hf_config, dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32  # half-precision matmuls on CPU are slow and lossy
    declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = _DTYPES.get(declared)
    return declared if declared in (torch.float16, torch.bfloat16) else torch.bfloat16


def build_model(hf_config, dtype: torch.dtype, device: torch.device,
                tp: TensorParallel | None = None, pooling: bool = False,
                max_model_len: int | None = None, defer_linears: bool = False) -> nn.Module:
    """The model of this rank (the whole model without ``tp``), weights unset.
    ``pooling`` (an embedding model or classifier): nothing is sampled, so
    the LM head shares the embedding's weight instead of holding its own
    (vocab x hidden of device memory: 1.2 GB at Qwen3-8B's size in bf16),
    and a checkpoint's ``lm_head.weight`` is then no target: it stays unread.
    ``max_model_len``: the server's context, which picks LongRoPE's factors
    (engine/layers.py, ``RotaryEmbedding``). ``defer_linears``: the linears'
    weights stay unallocated until ``parallel.realize_linears`` (those that
    will hold a quantized checkpoint's codes never take a dense weight's
    memory)."""
    if pooling and not getattr(hf_config, "tie_word_embeddings", False):
        hf_config = copy.copy(hf_config)
        hf_config.tie_word_embeddings = True
    if max_model_len is not None:
        hf_config = copy.copy(hf_config)
        hf_config.served_max_model_len = max_model_len
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), deferred_linear_weights(defer_linears):
            model = model_class(hf_config)(hf_config, tp or TensorParallel())
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def _checkpoint_tensors(model_dir: Path):
    """Yield (name, source) over every weight of the checkpoint. A source is a
    tensor, or a safetensors slice handle that reads only what is indexed
    (valid until the next item)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_slice(name)
        return
    bins = sorted(model_dir.glob("pytorch_model*.bin"))
    if not bins:
        raise ValueError(f"model: no *.safetensors or pytorch_model*.bin weights in {model_dir}")
    for f in bins:
        state = torch.load(str(f), map_location="cpu", weights_only=True)
        yield from state.items()


def checkpoint_tensor(model_dir: Path, name: str, rows: list[int] | None = None) -> torch.Tensor:
    """One tensor of the checkpoint (a classifier's head), whole or only
    ``rows`` of it (an LM head's rows of a few tokens), read without the rest."""
    for key, source in _checkpoint_tensors(model_dir):
        if key == name:
            if is_fp8(source):
                raise ValueError(f"weight {name}: float8, which this head does not read (only linears dequantize)")
            if rows is None:
                return _read(source, None)
            return torch.cat([source[r:r + 1] for r in rows])
    raise ValueError(f"checkpoint in {model_dir} lacks weights: ['{name}']")


def _dequantized(model_dir: Path, quantization: CheckpointFormat | None, device: torch.device,
                 unpacked: bool = False):  # fmt: skip
    """The checkpoint's tensors (``_checkpoint_tensors``), each quantized
    weight dequantized in fp32 on ``device``, the model's (one CPU thread
    takes 0.6 s for one of Llama-3-8B's 14336 x 4096 GPTQ weights, about
    75 s for the model's), the copy into the model rounding it once, and
    its scales and zero points left out. Those are read ahead: they may sit in
    another file than their weight. ``unpacked``: each such linear weight
    (2-D) as its ``GroupedCodes`` instead, for the loader to keep or
    dequantize where it lands."""
    aux = {} if quantization is None else {
        name: _read(source, None).to(device) for name, source in _checkpoint_tensors(model_dir)
        if quantization.is_aux(name)}
    for name, source in _checkpoint_tensors(model_dir):
        if quantization is None:
            if is_fp8(source):
                raise ValueError(f"weight {name}: float8, and the checkpoint's config.json declares no "
                                 "quantization_config to say how it is scaled")
            yield name, source
        elif quantization.quantized(name, source):
            tensor = _read(source, None).to(device)
            convert = quantization.unpack if unpacked and tensor.dim() == 2 else quantization.dequantize
            yield convert(name, tensor, aux)
        elif not quantization.is_aux(name):
            yield name, source


def _shape(source) -> tuple[int, ...]:
    return tuple(source.shape) if isinstance(source, (torch.Tensor, GroupedCodes)) else tuple(source.get_shape())


def _read(source, spec: ShardSpec | None) -> torch.Tensor | GroupedCodes:
    """The whole tensor, or just the slice ``spec`` names (zero-padded)."""
    if isinstance(source, GroupedCodes):
        if spec is None:
            return source
        part = source.narrow(spec.dim, spec.start, spec.stop - spec.start)
        return part.pad_rows(spec.size) if spec.dim == 0 else part
    if spec is None:
        return source if isinstance(source, torch.Tensor) else source[:]
    if isinstance(source, torch.Tensor):
        return spec.take(source)
    index = [slice(None)] * len(_shape(source))
    index[spec.dim] = slice(spec.start, spec.stop)
    return spec.pad(source[tuple(index)])


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: rows ``[offset, offset + rows)`` of
    ``param`` (all of it, unless fused), holding ``spec``'s slice."""

    param_name: str
    param: nn.Parameter
    offset: int
    rows: int
    spec: ShardSpec | None
    expert: int | None = None  # a stacked parameter's index along its first dimension
    quantized_weight: QuantizedWeight | None = None  # where the weight is held as the checkpoint's codes (no param)

    def view(self, values: torch.Tensor | None = None) -> torch.Tensor:
        """The part of the parameter this tensor fills; of ``values`` in the
        parameter's place where given (``parallel.loaded_weights``' values
        of a weight given up once packed)."""
        whole = self.param if values is None else values
        if not fused_pieces(self.param):
            return whole
        whole = whole if self.expert is None else whole[self.expert]
        return whole.narrow(0, self.offset, self.rows)


def checkpoint_targets(model: nn.Module) -> dict[str, _Target]:
    """Every checkpoint tensor name the model reads, and where it goes. A
    fused parameter (``...self_attn.qkv_proj.weight``) answers to the names of
    its parts (``...self_attn.q_proj.weight``, ``k_proj``, ``v_proj``); a
    stacked one (``...mlp.experts.gate_up_proj``) to its experts' names
    (``...mlp.experts.3.gate_proj.weight``)."""
    targets = {}
    held = [(name, param, fused_pieces(param), shard_spec(param), None) for name, param in model.named_parameters()]
    for name, m in model.named_modules():
        for leaf, codes in m.held_codes().items() if isinstance(m, HeldWeights) else ():
            held.append((f"{name}.{leaf}", None, codes.pieces, codes.spec, codes))
    for name, param, pieces, spec, codes in held:
        if pieces is None:
            rows = codes.rows if codes is not None else param.shape[0] if param.dim() else 0
            targets[name] = _Target(name, param, 0, rows, spec, quantized_weight=codes)
            continue
        module, leaf = name.rsplit(".", 1)
        parent = module.rsplit(".", 1)[0] + "." if "." in module else ""
        for piece in pieces:
            key = f"{module}.{piece.key}" if piece.key else f"{parent}{piece.name}.{leaf}"
            targets[key] = _Target(name, param, piece.offset, piece.rows, piece.spec, piece.expert, codes)
    return targets


def quantized_linears(model: nn.Module, model_dir: Path | str, quantization: CheckpointFormat) -> set[str]:
    """The linears and stacked experts of ``model`` (built with
    ``defer_linears``) that may hold a quantized checkpoint's weights as its
    codes: each whose every checkpoint weight is quantized (GPTQ's and
    AWQ's ``qweight``, a float8 matrix). Others (a router, a linear the
    checkpoint keeps in floats) load dense, dequantized where they are
    quantized; so does a fused linear, or an expert's gate and up, whose
    parts order their features' groups apart (act-order GPTQ computed for
    each part alone), which one ``g_idx`` cannot describe."""
    quantized, orders = set(), {}
    for name, source in _checkpoint_tensors(Path(model_dir)):
        if name.endswith(".qweight") or (is_fp8(source) and len(_shape(source)) == 2):
            quantized.add(name.removesuffix(".qweight") + ".weight" if name.endswith(".qweight") else name)
        elif name.endswith(".g_idx"):
            orders[name.removesuffix(".g_idx") + ".weight"] = _read(source, None).to(torch.int64)
    splits = getattr(model, "checkpoint_splits", {})
    groups = {}  # our name of each quantized weight -> its g_idx (None: in order)
    for raw in quantized:
        name = checkpoint_name(model, raw)
        fused = next((key for key in splits if key in name), None)
        for part in [name] if fused is None else [name.replace(fused, part) for part, _ in splits[fused]]:
            groups[part] = orders.get(raw)
    targets = checkpoint_targets(model)
    parts: dict[str, dict[int | None, list[str]]] = {}  # a weight's parts, by expert (None: not stacked)
    for name, target in targets.items():
        parts.setdefault(target.param_name, {}).setdefault(target.expert, []).append(name)
    chosen = set()
    for name, module in model.named_modules():
        if not isinstance(module, HeldWeights) or not module.takes_quantized_weight:
            continue
        weights = [parts.get(f"{name}.{leaf}") for leaf in module.code_params]
        if not all(w and all(part in groups for ps in w.values() for part in ps) for w in weights):
            continue
        if all(_same_order([groups[part] for part in ps]) for w in weights for ps in w.values()):
            chosen.add(name)
        else:
            log.info("%s: its parts order their groups apart, so it is dequantized", name)
    return chosen


def _same_order(orders: list[torch.Tensor | None]) -> bool:
    """Whether every part's groups come in the first's order (None: in order)."""
    first = orders[0]
    return all((o is None) == (first is None) and (o is None or torch.equal(o, first)) for o in orders[1:])


def checkpoint_name(model: nn.Module, name: str) -> str:
    """A checkpoint tensor's name as our modules spell it: the model's
    ``checkpoint_prefixes`` (OPT's ``decoder.``) and ``checkpoint_renames``
    (Mixtral's ``block_sparse_moe`` and ``w1``/``w3``/``w2``) applied."""
    prefixes = (getattr(model, "checkpoint_prefixes", None)
                or getattr(getattr(model, "config", None), "checkpoint_prefixes", None) or {})  # fmt: skip
    for old, new in prefixes.items():
        if name.startswith(old):
            name = new + name[len(old):]
    for old, new in getattr(model, "checkpoint_renames", ()):
        name = name.replace(old, new)
    return name


def row_order(model: nn.Module, name: str) -> torch.Tensor | None:
    """The order the model takes a checkpoint tensor's rows in
    (``model.checkpoint_row_orders``, keyed by a part of our names: GLM-4's
    q_proj and k_proj, their interleaved rope pairs made halves), or None."""
    orders = getattr(model, "checkpoint_row_orders", {})
    return next((order for key, order in orders.items() if key in name), None)


def _reordered(model: nn.Module, name: str, source):
    order = row_order(model, name)
    if order is None:
        return name, source
    whole = _read(source, None)
    return name, whole.index_select(0, order.to(whole.device))


def _split_fused(model: nn.Module, tensors):
    """(name, source) of each checkpoint tensor under our names, a tensor
    the checkpoint keeps fused (Phi-3's ``qkv_proj``, ``model.checkpoint_splits``)
    cut into its parts' rows, each then sharded as its part is; every
    expert's tensors a checkpoint stacks in one (Granite MoE's
    ``input_linear``, ``model.checkpoint_unstacks``) cut into each expert's
    parts; rows the model takes in another order (``row_order``) reordered
    first."""
    splits = getattr(model, "checkpoint_splits", {})
    unstacks = getattr(model, "checkpoint_unstacks", {})
    for name, source in tensors:
        name = checkpoint_name(model, name)
        stacked = next((key for key in unstacks if name.endswith(key)), None)
        if stacked is not None:  # [E, rows, cols], every expert's parts: one tensor per expert's part
            whole = _dense(_read(source, None))
            for expert in range(whole.shape[0]):
                start = 0
                for part, rows in unstacks[stacked]:
                    part_name = name.replace(stacked, f".mlp.experts.{expert}.{part}.weight")
                    yield part_name, whole[expert, start:start + rows]
                    start += rows
            continue
        fused = next((key for key in splits if key in name), None)
        if fused is None:
            yield _reordered(model, name, source)
            continue
        whole, start = _read(source, None), 0
        for part, rows in splits[fused]:
            yield _reordered(model, name.replace(fused, part), whole.narrow(0, start, rows))
            start += rows
        if start != whole.shape[0]:
            raise ValueError(f"weight {name}: {whole.shape[0]} rows, not the {start} of its parts")


def _dense(source):
    """A checkpoint source as a dense weight wants it: ``GroupedCodes`` dequantized (fp32)."""
    return source.dequantize() if isinstance(source, GroupedCodes) else source


def load_weights(model: nn.Module, model_dir: Path | str, base_only: bool = False,
                 quantization: CheckpointFormat | None = None) -> None:
    """Read every weight of ``model`` from the checkpoint in ``model_dir``
    (this rank's shard of the split ones), then pack the linears for the CPU.
    ``base_only`` (an embedding model): the checkpoint may hold the base
    model alone, its names without the ``model.`` prefix and no LM head,
    which then stays unread (nothing is sampled). ``quantization``: the
    checkpoint's format (``quantization.checkpoint_quantization``), its
    weights dequantized as they are read, or kept as stored where a linear
    holds the checkpoint's codes (``quantized_linears``)."""
    _read_weights(model, Path(model_dir), base_only, quantization)
    # After the read has let go of the parameters: a linear packed for the
    # CPU drops the weight it was packed from, which frees nothing while
    # the read's targets still hold it.
    prepack_linears(model)


def _read_weights(model: nn.Module, model_dir: Path, base_only: bool, quantization: CheckpointFormat | None) -> None:
    targets = checkpoint_targets(model)
    loaded: set[str] = set()
    device = next(model.parameters()).device
    unpacked = any(t.quantized_weight is not None for t in targets.values())
    for name, source in _split_fused(model, _dequantized(model_dir, quantization, device, unpacked)):
        if base_only and name not in targets and f"model.{name}" in targets:
            name = f"model.{name}"
        if name not in targets:
            if not name.endswith(_IGNORED_SUFFIXES):
                log.debug("ignoring checkpoint tensor %s", name)
            continue
        target = targets[name]
        held = target.quantized_weight
        if held is None:
            source = _dense(source)
        elif not isinstance(source, GroupedCodes):
            raise ValueError(f"weight {name}: held as the checkpoint's codes, and the checkpoint's is not quantized")
        shape = (target.rows, held.features) if held is not None else tuple(target.view().shape)
        expected = target.spec.full_shape(shape) if target.spec is not None else shape
        if _shape(source) != expected:
            raise ValueError(f"weight {name}: checkpoint shape {_shape(source)} != model {expected}")
        if held is not None:
            held.load(target.offset, _read(source, target.spec), name, target.expert)
        else:
            with torch.no_grad():
                target.view().copy_(_read(source, target.spec))
        loaded.add(name)
    # Tied weights appear once under either name.
    loaded_params = [targets[n].param for n in loaded if targets[n].param is not None]
    tied = {n for n, t in targets.items() if t.param is not None and fused_pieces(t.param) is None
            and any(t.param is p for p in loaded_params)}
    missing = set(targets) - loaded - tied
    if base_only:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights: {sorted(missing)[:5]}")


def held_weights(model: nn.Module, dtype: torch.dtype) -> str:
    """How a quantized checkpoint's weights are held, for the start-up log:
    the linears holding the checkpoint's codes and their bytes, or that all
    were dequantized."""
    held = [w for m in model.modules() if isinstance(m, HeldWeights) for w in m.held_codes().values()]
    name = str(dtype).removeprefix("torch.")
    if not held:
        return f"weights dequantized to {name} as they loaded"
    kept = sum(w.nbytes() for w in held)
    dense = sum(w.dense_elements() for w in held) * torch.empty((), dtype=dtype).element_size()
    stacks = sum(w.experts is not None for w in held)
    what = f"{len(held) - stacks} linears" + (f" and {stacks} expert stacks" if stacks else "")
    return (f"{what} hold {held[0].kind()} weights as the checkpoint's, {kept / 2**20:.1f} MiB against "
            f"{dense / 2**20:.1f} MiB in {name}; any other quantized weight dequantized to {name}")


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Small random weights: enough for timing, never for text. A sharded
    tensor is drawn whole and this rank keeps its slice, so every
    tensor_parallel_size yields the same model."""
    _draw_weights(model, seed)
    prepack_linears(model)  # after the draw has let go of the parameters, as in ``load_weights``


def _draw_weights(model: nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for target in checkpoint_targets(model).values():  # tied weights appear once
            if target.quantized_weight is not None:
                raise ValueError("dummy weights are dense: a model with integer weights loads a checkpoint")
            dest = target.view()
            if target.spec is None:
                dest.uniform_(-0.02, 0.02)
            else:
                full = torch.empty(target.spec.full_shape(dest.shape), dtype=dest.dtype, device=dest.device)
                dest.copy_(target.spec.take(full.uniform_(-0.02, 0.02)))


def model_context_length(hf_config) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def is_tiny_model(model_dir: Path) -> bool:
    return (model_dir / "fluidserve_tiny.json").exists()


def describe(model_dir: Path) -> dict:
    marker = model_dir / "fluidserve_tiny.json"
    return json.loads(marker.read_text()) if marker.exists() else {}
