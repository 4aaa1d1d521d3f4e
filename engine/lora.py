"""Multi-LoRA serving (S-LoRA, Punica): many fine-tunes of one base model
served side by side, each request generating with its own adapter, or none.

Owns what an engine needs of adapters:

* reading an adapter in PEFT's format (``adapter_config.json`` beside
  ``adapter_model.safetensors`` or ``adapter_model.bin``) and checking it
  against the model it is to run on (``read_adapter``); what PEFT can save
  but this module would not compute exactly as PEFT does (DoRA, bias
  terms, embedding or LM-head adapters, per-module alphas, ...) is refused
  by name;
* the adapter slots of each linear (``LoRASlots``): every adapter is kept
  on the device, its A and B matrices stacked per slot beside the base
  weight, B scaled once on loading;
* a step's rows by adapter slot (``LoRAStep``), which every linear adds to
  its base product: ``y += (x A_s^T) B_s^T`` for the rows of slot ``s``. A
  step whose adapter rows are one run of one adapter takes one product pair
  on them; a step mixing adapters takes every slot's shrink for every row in
  one product, masked to each row's own slot, then one expand: three
  launches a linear whatever the mix and order of its rows (Punica's BGMV
  without a kernel of its own), or, past ``DENSE_MAX_WIDTH``, each slot's
  rows on their own;
* the engine's adapters by served name (``AdapterRegistry``), and vLLM's
  ``LoRARequest`` for the offline API.

A fused linear (q/k/v, gate/up) holds one rank block per part: part ``p``
uses ranks ``[p R, p R + r)`` of the slot, and its B rows are the part's
output rows, zero elsewhere, so the fused product stays one pair of
matrix products. Under tensor parallelism a column-parallel linear keeps
this rank's rows of B, a row-parallel one this rank's columns of A; the
row-parallel delta is a partial sum like the base product, so the one
all-reduce after it sums both.

A step with adapter rows runs eagerly through the modules: the batch-1 row
path, the batch path and CUDA graphs take base-only steps.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from fluidserve.engine.loader import checkpoint_name, row_order

CONFIG_FILE = "adapter_config.json"
# PEFT's config keys whose non-default values change what an adapter
# computes in ways this module does not: refused by name, never ignored.
_REFUSED_CONFIG = {
    "use_dora": "DoRA adapters",
    "lora_bias": "adapters with bias terms",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D) adapters",
    "modules_to_save": "adapters that replace whole modules (modules_to_save)",
    "alpha_pattern": "per-module lora_alpha (alpha_pattern)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable token embeddings",
    "target_parameters": "adapters on parameters (target_parameters)",
    "use_qalora": "QA-LoRA adapters",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
}
# PEFT's ``*_config`` keys that only say how an adapter was initialised or
# trained; any other one set (Arrow routing, Monte Carlo LoRA, ...) changes
# inference and is refused by name.
_TRAINING_CONFIGS = {"loftq_config", "eva_config", "corda_config", "lora_ga_config", "megatron_config"}
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's ``LoRARequest`` for ``LLM.generate(..., lora_request=...)``:
    the adapter in ``lora_path`` under ``lora_name``, loaded on first use.
    ``lora_int_id`` is vLLM's; the name says which adapter here."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


class AdapterError(ValueError):
    """An adapter that cannot be served, the message saying why."""


@dataclass
class Adapter:
    """One adapter as read from disk, checked against a model: per linear of
    the checkpoint (``model.layers.0.self_attn.q_proj``), its A [r, in] and
    its B [out, r] already scaled, on the CPU in float32."""

    path: str
    rank: int  # the largest of its modules' ranks
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Site:
    """Where a checkpoint linear's adapter goes: ``module`` (a linear of the
    model), its part ``part`` of ``parts`` (fused linears), whose output
    rows are ``[offset, offset + rows)``; ``spec``: this rank's slice."""

    module: nn.Module
    part: int
    parts: int
    offset: int
    rows: int
    spec: object  # parallel.ShardSpec | None


def _sites(model: nn.Module) -> dict[str, _Site]:
    """Every checkpoint linear an adapter may target, and where it lives in
    ``model``: each decoder linear, not the LM head (vLLM's set)."""
    from .loader import checkpoint_targets
    from .parallel import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear, fused_pieces

    sites = {}
    for name, target in checkpoint_targets(model).items():
        if not name.endswith(".weight"):
            continue
        module = model.get_submodule(target.param_name.rsplit(".", 1)[0])
        if not isinstance(module, (ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear)):
            continue
        pieces = fused_pieces(module.weight) or ()
        index = next((i for i, p in enumerate(pieces) if p.offset == target.offset), 0)
        sites[name.removesuffix(".weight")] = _Site(module, index, max(len(pieces), 1), target.offset, target.rows,
                                                    target.spec)
    return sites


def _config(path: Path) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"lora_path: no {CONFIG_FILE} in {str(path)!r}")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"lora_path: {CONFIG_FILE} in {str(path)!r} does not parse: {exc}") from exc
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"lora_path: {str(path)!r} is not a LoRA adapter (peft_type "
                           f"{config.get('peft_type') if isinstance(config, dict) else None!r})")
    for key, what in _REFUSED_CONFIG.items():
        if config.get(key):
            raise AdapterError(f"lora_path: {what} are not supported ({key} in {str(path)!r})")
    for key, value in config.items():
        if key.endswith("_config") and key not in _TRAINING_CONFIGS and value:
            raise AdapterError(f"lora_path: {key} is not supported (in {str(path)!r})")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"lora_path: adapters with bias terms are not supported (bias "
                           f"{config['bias']!r} in {str(path)!r})")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise AdapterError(f"lora_path: {CONFIG_FILE} in {str(path)!r} has no positive rank r")
    return config


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    file = path / "adapter_model.safetensors"
    if file.is_file():
        from safetensors.torch import load_file

        return load_file(str(file))
    file = path / "adapter_model.bin"
    if file.is_file():
        return torch.load(str(file), map_location="cpu", weights_only=True)
    raise AdapterError(f"lora_path: no adapter_model.safetensors or adapter_model.bin in {str(path)!r}")


def _as_our_modules(model: nn.Module, pairs: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """The adapter's (A, B) pairs on our linears: a module the checkpoint
    keeps fused (Phi-3's ``qkv_proj``, GLM-4's ``gate_up_proj``:
    ``model.checkpoint_splits``) becomes one pair per part, each with the
    whole A and its part's rows of B (the same product, part by part); B's
    rows then in the order the model takes the module's rows
    (``loader.row_order``: GLM-4's q_proj and k_proj)."""
    splits = getattr(model, "checkpoint_splits", {})
    ours: dict[str, dict[str, torch.Tensor]] = {}
    for module, pair in pairs.items():
        fused = next((key for key in splits if key in f"{module}."), None)
        if fused is None or set(pair) != {"lora_A", "lora_B"}:
            ours[module] = pair
            continue
        start = 0
        for part, rows in splits[fused]:
            ours[f"{module}.".replace(fused, part)[:-1]] = {"lora_A": pair["lora_A"],
                                                           "lora_B": pair["lora_B"][start:start + rows]}
            start += rows
    for module, pair in ours.items():
        order = row_order(model, f"{module}.")
        if order is not None and "lora_B" in pair and pair["lora_B"].shape[0] == order.numel():
            pair["lora_B"] = pair["lora_B"].index_select(0, order)
    return ours


def read_adapter(path: str | Path, model: nn.Module, max_rank: int) -> Adapter:
    """The adapter in folder ``path``, checked against ``model`` (any rank's
    copy, or the model built on the meta device): every tensor must name a
    linear of the model, with its shapes, and no module's rank may pass
    ``max_rank``. Raises ``AdapterError`` naming what is wrong."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise AdapterError(f"lora_path: {str(path)!r} is not a folder")
    config = _config(path)
    rslora = bool(config.get("use_rslora"))
    alpha = float(config.get("lora_alpha", 8))
    sites = _sites(model)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _tensors(path).items():
        name = key.removeprefix(_PEFT_PREFIX)
        for which in ("lora_A", "lora_B"):
            marker = f".{which}."
            if marker in name and name.endswith(".weight"):
                module = name[:name.index(marker)]
                break
        else:
            raise AdapterError(f"lora_path: tensor {key!r} is not a LoRA A or B weight of a linear "
                               f"(embedding and LM-head adapters are not supported)")
        module = checkpoint_name(model, module)
        pairs.setdefault(module, {})[which] = tensor
    if not pairs:
        raise AdapterError(f"lora_path: the adapter in {str(path)!r} holds no LoRA weights")
    pairs = _as_our_modules(model, pairs)
    adapter = Adapter(str(path), 0)
    for module, pair in sorted(pairs.items()):
        site = sites.get(module)
        if site is None:
            raise AdapterError(f"lora_path: the adapter targets {module!r}, which is not a linear of the model's "
                               f"decoder layers")
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"lora_path: {module!r} has lora_A or lora_B but not both")
        a, b = pair["lora_A"], pair["lora_B"]
        rank = a.shape[0]
        linear = site.module
        out_full = site.spec.full if site.spec is not None and site.spec.dim == 0 else site.rows
        in_full = (site.spec.full if site.spec is not None and site.spec.dim == 1
                   else linear.weight.shape[1])  # fmt: skip
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank or a.shape[1] != in_full or b.shape[0] != out_full:
            raise AdapterError(f"lora_path: {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not "
                               f"fit a linear of {in_full} inputs and {out_full} outputs")
        if rank > max_rank:
            raise AdapterError(f"lora_path: rank {rank} of {module!r} exceeds max_lora_rank={max_rank}")
        # PEFT's scaling: lora_alpha over the rank (its square root with rsLoRA).
        scale = alpha / (math.sqrt(rank) if rslora else rank)
        adapter.weights[module] = (a.float().contiguous(), (b.float() * scale).contiguous())
        adapter.rank = max(adapter.rank, rank)
    return adapter


# A step mixing adapters computes every slot's rank columns for every row
# (three launches a linear) while a linear's slots are at most this wide
# (slots x parts x R); wider, it gathers each slot's rows (four launches a
# slot), which costs the rank work of the slots present only.
DENSE_MAX_WIDTH = 1024


@dataclass
class LoRAStep:
    """A step's token rows by adapter slot, in the form the linears add
    them in: ``run`` where every adapter row is one run of one slot (one
    adapter, or one request's chunk), else ``slot_of_row`` [T] on the device
    (-1: the base model) for the dense form and, made on first use by the
    gathered form, ``groups``: each slot present with its rows (a slice
    where they are one run, else an index tensor)."""

    run: tuple[int, slice] | None
    slot_of_row: torch.Tensor | None = None
    spans: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # slot -> its runs of rows
    _masks: dict = field(default_factory=dict)
    _groups: list | None = None

    @classmethod
    def build(cls, seq_slots: list[int], query_start_loc: list[int], device: torch.device) -> "LoRAStep | None":
        """From each sequence row's slot (-1: the base model) and where its
        tokens start; None when no row has an adapter."""
        spans: dict[int, list[tuple[int, int]]] = {}
        for slot, start, end in zip(seq_slots, query_start_loc, query_start_loc[1:]):
            if slot < 0 or start == end:
                continue
            runs = spans.setdefault(slot, [])
            if runs and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], end)
            else:
                runs.append((start, end))
        if not spans:
            return None
        if len(spans) == 1:
            ((slot, runs),) = spans.items()
            if len(runs) == 1:
                return cls((slot, slice(*runs[0])))
        counts = torch.tensor([b - a for a, b in zip(query_start_loc, query_start_loc[1:])])
        rows = torch.tensor(seq_slots).repeat_interleave(counts)  # each token's slot
        return cls(None, rows.to(device, non_blocking=True), spans)

    @property
    def groups(self) -> list[tuple[int, slice | torch.Tensor]]:
        if self._groups is None:
            device = self.slot_of_row.device
            self._groups = [(slot, slice(*runs[0])) if len(runs) == 1 else
                            (slot, torch.cat([torch.arange(a, b) for a, b in runs]).to(device, non_blocking=True))
                            for slot, runs in self.spans.items()]  # fmt: skip
        return self._groups

    def mask(self, slots: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, slots * width]: 1 in the ``width`` columns of each row's own
        slot, 0 elsewhere (everywhere for a base row); made once a step per
        shape, for every linear of that shape."""
        key = (slots, width, dtype)
        mask = self._masks.get(key)
        if mask is None:
            own = self.slot_of_row[:, None] == torch.arange(slots, device=self.slot_of_row.device)
            mask = self._masks[key] = own.to(dtype)[:, :, None].expand(-1, -1, width).reshape(len(own), -1)
        return mask


class LoRAState:
    """The step the linears of one model read their adapter rows from: set
    by the model runner around a forward, None between steps and for steps
    of the base model alone."""

    def __init__(self) -> None:
        self.step: LoRAStep | None = None


class LoRAWeights:
    """One linear's adapter slots: A [slots, parts * R, in] and B [out,
    slots, parts * R] (scaled), zero where no adapter is loaded; laid out
    so that every slot's A rows, and every slot's B columns, are one matrix."""

    def __init__(self, state: LoRAState, slots: int, max_rank: int, parts: int, in_features: int,
                 out_features: int, dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
        self.state = state
        self.width = parts * max_rank  # one slot's rank columns
        self.a = torch.zeros((slots, self.width, in_features), dtype=dtype, device=device)
        self.b = torch.zeros((out_features, slots, self.width), dtype=dtype, device=device)
        self.a_all = self.a.view(slots * self.width, in_features)
        self.b_all = self.b.view(out_features, slots * self.width)

    @property
    def active(self) -> bool:
        return self.state.step is not None

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` [T, out] plus each adapter row's ``(x A^T) B^T``, in place;
        x [T, in]."""
        step = self.state.step
        if step is None:
            return y
        if step.run is not None:
            slot, rows = step.run
            y[rows].addmm_(x[rows] @ self.a[slot].t(), self.b[:, slot].t())
        elif self.a_all.shape[0] <= DENSE_MAX_WIDTH:
            shrunk = x @ self.a_all.t()  # [T, slots * width]: every slot's, for every row
            shrunk.mul_(step.mask(self.a.shape[0], self.width, shrunk.dtype))
            y.addmm_(shrunk, self.b_all.t())
        else:
            for slot, rows in step.groups:
                a, b = self.a[slot], self.b[:, slot]
                if isinstance(rows, slice):
                    y[rows].addmm_(x[rows] @ a.t(), b.t())
                else:
                    y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
        return y


class LoRASlots:
    """The adapter slots of one worker's model: a ``LoRAWeights`` on each
    linear an adapter may target, and the step state they read."""

    def __init__(self, model: nn.Module, slots: int, max_rank: int) -> None:
        self.model = model
        self.slots = slots
        self.max_rank = max_rank
        self.state = LoRAState()
        self.sites = _sites(model)
        model.lora_slots = self  # the model runner sets the step's rows on ``state``
        for site in self.sites.values():
            linear = site.module
            if getattr(linear, "lora", None) is None:
                w = linear.weight
                linear.lora = LoRAWeights(self.state, slots, max_rank, site.parts, w.shape[1], w.shape[0], w.dtype,
                                          w.device)  # fmt: skip

    def load(self, slot: int, adapter: Adapter) -> None:
        """Put ``adapter`` into ``slot`` of every linear (this rank's shards),
        zeroing what it does not target."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"LoRA slot {slot} outside [0, {self.slots})")
        with torch.no_grad():
            for site in self.sites.values():
                site.module.lora.a[slot].zero_()
                site.module.lora.b[:, slot].zero_()
            for module, (a, b) in adapter.weights.items():
                site = self.sites[module]
                weights = site.module.lora
                rank, r0 = a.shape[0], site.part * self.max_rank
                if site.spec is not None and site.spec.dim == 1:  # row-parallel: this rank's input columns
                    a = site.spec.take(a)
                elif site.spec is not None:  # column-parallel: this rank's output rows
                    b = site.spec.take(b)
                weights.a[slot, r0:r0 + rank].copy_(a)
                weights.b[site.offset:site.offset + site.rows, slot, r0:r0 + rank].copy_(b)


@dataclass(frozen=True)
class Loaded:
    """An adapter the engine serves: its slot on the workers, and the key
    its requests' prefix-cache entries hang from (one per load, so an
    adapter loaded again under the same name shares nothing cached
    before)."""

    name: str
    path: str
    slot: int
    cache_key: int


class AdapterRegistry:
    """The engine's adapters by served name: which slot each holds, and the
    loads the workers have not been sent yet (they ride on the next step,
    ``ModelInput.lora_loads``, before any request can use them).

    A removed adapter's name is gone at once; its slot is taken again only
    once no live request generates with it (``add``'s ``busy``), so nothing
    accepted changes adapter mid-answer."""

    def __init__(self, hf_config, slots: int, max_rank: int) -> None:
        from .loader import build_model

        # Shapes only: adapters are checked against the whole (unsharded) model, weights never allocated.
        self._model = build_model(hf_config, torch.float32, torch.device("meta"))
        self.slots = slots
        self.max_rank = max_rank
        self.loaded: dict[str, Loaded] = {}
        self._pending: list[tuple[int, Adapter]] = []
        self._loads = 0

    def read(self, path: str | Path) -> Adapter:
        """The adapter in ``path``, checked against the model. Reads files
        and the meta model only, so another thread may call it while the
        engine steps (the server reads adapters off the engine's loop)."""
        return read_adapter(path, self._model, self.max_rank)

    def add(self, name: str, adapter: str | Path | Adapter, busy: set[int] = frozenset(),
            replace: bool = False) -> Loaded:  # fmt: skip
        """Give ``adapter`` (one ``read`` made, or the folder to read it
        from) a free slot (``busy``: slots live requests still generate
        with); ``replace``: it takes the place of the adapter of that name,
        whose requests finish with the old weights in the old slot. Raises
        ValueError naming what is wrong; nothing changes then."""
        if not isinstance(name, str) or not name:
            raise AdapterError("lora_name: must be a non-empty string")
        if name in self.loaded and not replace:
            raise AdapterError(f"lora_name: an adapter named {name!r} is already loaded")
        taken = {a.slot for a in self.loaded.values()} | set(busy)
        free = [s for s in range(self.slots) if s not in taken]
        if not free:
            raise AdapterError(f"lora_name: all {self.slots} adapter slots are in use (--max-loras); unload one "
                               f"first")
        if not isinstance(adapter, Adapter):
            adapter = self.read(adapter)
        self._loads += 1
        loaded = self.loaded[name] = Loaded(name, adapter.path, free[0], hash(("lora", self._loads)))
        self._pending.append((loaded.slot, adapter))
        return loaded

    def remove(self, name: str) -> Loaded:
        """Stop serving ``name``: KeyError when no such adapter is loaded."""
        return self.loaded.pop(name)

    def take_loads(self) -> list[tuple[int, Adapter]]:
        """The loads not yet sent to the workers, once."""
        loads, self._pending = self._pending, []
        return loads
