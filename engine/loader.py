"""Finding a checkpoint, reading its config and tokenizer, and putting its
weights into our model classes: safetensors first, PyTorch ``.bin`` as the
fallback, or random ``dummy`` weights from the config alone (benchmarks).

Under tensor parallelism each worker reads only its own shard of every split
weight (the ``ShardSpec`` its parameter carries, engine/parallel.py); from
safetensors that is a slice read, not the whole tensor."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from .models import model_class
from .parallel import ShardSpec, TensorParallel, shard_spec

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
# Keys some checkpoints carry that are not parameters of ours.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")


def resolve_model_dir(model: str, load_format: str = "auto") -> Path:
    """A local directory as is; otherwise a hub id fetched into the HF cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/", "~")):
        raise ValueError(f"model: {model!r} is not a model directory")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.model", "*.txt", "*.tiktoken"]
    if load_format != "dummy":
        patterns.append("*.safetensors")
    local = Path(snapshot_download(model, allow_patterns=patterns))
    if load_format != "dummy" and not list(local.glob("*.safetensors")):
        local = Path(snapshot_download(model, allow_patterns=patterns + ["*.bin"]))
    return local


def load_hf_config(model_dir: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir))


def load_tokenizer(path: Path | str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


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
                tp: TensorParallel | None = None) -> nn.Module:
    """The model of this rank (the whole model without ``tp``), weights unset."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
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


def _shape(source) -> tuple[int, ...]:
    return tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())


def _read(source, spec: ShardSpec | None) -> torch.Tensor:
    """The whole tensor, or just the slice ``spec`` names (zero-padded)."""
    if spec is None:
        return source if isinstance(source, torch.Tensor) else source[:]
    if isinstance(source, torch.Tensor):
        return spec.take(source)
    index = [slice(None)] * len(_shape(source))
    index[spec.dim] = slice(spec.start, spec.stop)
    return spec.pad(source[tuple(index)])


def load_weights(model: nn.Module, model_dir: Path | str) -> None:
    model_dir = Path(model_dir)
    params = dict(model.named_parameters())
    prefixes = getattr(model, "checkpoint_prefixes", {})
    loaded: set[str] = set()
    for name, source in _checkpoint_tensors(model_dir):
        for old, new in prefixes.items():
            if name.startswith(old):
                name = new + name[len(old):]
        if name not in params:
            if not name.endswith(_IGNORED_SUFFIXES):
                log.debug("ignoring checkpoint tensor %s", name)
            continue
        param = params[name]
        spec = shard_spec(param)
        expected = spec.full_shape(param.shape) if spec is not None else tuple(param.shape)
        if _shape(source) != expected:
            raise ValueError(f"weight {name}: checkpoint shape {_shape(source)} != model {expected}")
        with torch.no_grad():
            param.copy_(_read(source, spec))
        loaded.add(name)
    # Tied weights appear once under either name.
    tied = {n for n, p in params.items() if any(p is params[m] for m in loaded)}
    missing = set(params) - loaded - tied
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights: {sorted(missing)[:5]}")


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Small random weights: enough for timing, never for text. A sharded
    parameter draws its whole tensor and keeps its slice, so every
    tensor_parallel_size yields the same model."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            spec = shard_spec(p)
            if spec is None:
                p.uniform_(-0.02, 0.02)
            else:
                full = torch.empty(spec.full_shape(p.shape), dtype=p.dtype, device=p.device)
                p.copy_(spec.take(full.uniform_(-0.02, 0.02)))


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
