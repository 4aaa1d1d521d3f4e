"""CacheConfig: the settings of the two KV tiers, and ``setting``, the way
every config dataclass of the project declares a field once: its name, its
default, its help text and its command-line flag (engine/args.py turns the
fields into ``fluidserve serve``'s flags; nothing else declares them).

Pure Python: the scheduler and the simulator embed this config too.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any


def setting(default: Any = dataclasses.MISSING, help: str = "", *, flag: str | None = None,
            aliases: tuple[str, ...] = (), choices: tuple | None = None, metavar: str | None = None,
            cli: bool = True, default_factory: Any = dataclasses.MISSING) -> Any:
    """A config field with what its flag needs: ``help`` (the default is
    appended unless the text says it), ``flag`` (default ``--field-name``),
    vLLM's other spellings in ``aliases``, ``choices``, ``metavar``; ``cli=False`` for a
    setting no flag sets (tests, benchmarks, values the engine derives)."""
    metadata = {"help": help, "flag": flag, "aliases": aliases, "choices": choices, "metavar": metavar, "cli": cli}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


BLOCK_SIZES = (8, 16, 32, 64)  # what the engine's attention kernels take
# What a KV cache may store (kernels/cache_dtype.py maps each to its type).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = setting(16, "tokens per KV block", choices=BLOCK_SIZES)
    num_kv_blocks: int | None = setting(None, "device KV blocks, overriding the sizing from free memory "
                                              "(default: sized by --gpu-memory-utilization, or "
                                              "--cpu-kv-cache-gb on CPU)")
    gpu_memory_utilization: float = setting(0.9, "fraction of GPU memory the engine may use (weights + KV cache)")
    cpu_kv_cache_gb: float = setting(1.0, "GiB of device KV cache on a CPU, where free memory is not measured",
                                     metavar="GIB")
    kv_cache_dtype: str = setting(
        "auto", "what the KV cache stores: auto, the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2, one byte an "
                "element at a scale of 1, rounded to nearest and saturated, so twice the tokens fit (bf16 models) "
                "and attention reads half the bytes", choices=KV_CACHE_DTYPES)
    # Host tier (FastServe §4.2): GiB per worker, or an exact block count.
    swap_space: float | None = setting(
        None, "host memory per worker for KV swapped out of the device, in GiB (pinned on CUDA); "
              "0 turns the host tier off (default: 4, or a quarter of the free RAM if less)", metavar="GIB")
    num_host_blocks: int | None = setting(None, "host KV blocks, overriding --swap-space (tests, benchmarks)")
    enable_prefix_caching: bool = setting(
        True, "share the KV of prompt prefixes already in the cache (full blocks), as vLLM does; "
              "--no-enable-prefix-caching recomputes every prompt")
    # With a host pool the prefix cache spans both tiers; False keeps it on
    # the device only (a baseline for benchmarks/prefix_cache_sim.py).
    cache_on_host: bool = setting(True, cli=False)

    def __post_init__(self) -> None:
        checks = [
            # The engine's kernels take BLOCK_SIZES only (EngineConfig checks);
            # the accounting and the simulator take any.
            ("block_size", self.block_size >= 1, "must be positive"),
            ("num_kv_blocks", self.num_kv_blocks is None or self.num_kv_blocks >= 1, "must be positive"),
            ("gpu_memory_utilization", 0.0 < self.gpu_memory_utilization <= 1.0, "must be in (0, 1]"),
            ("cpu_kv_cache_gb", self.cpu_kv_cache_gb > 0, "must be positive"),
            ("kv_cache_dtype", self.kv_cache_dtype in KV_CACHE_DTYPES, f"must be one of {KV_CACHE_DTYPES}"),
            ("swap_space", self.swap_space is None or self.swap_space >= 0, "must be >= 0"),
            ("num_host_blocks", self.num_host_blocks is None or self.num_host_blocks >= 0, "must be >= 0"),
        ]
        check_all(self, checks)


def json_object(text: str, name: str) -> dict:
    """A setting given as a JSON object (vLLM's ``--pooler-config``,
    ``--speculative-config``, ...); a ValueError names the setting."""
    try:
        given = json.loads(text)
    except ValueError:
        given = None
    if not isinstance(given, dict):
        raise ValueError(f"{name}: not a JSON object: {text!r}")
    return given


def check_all(config: Any, checks: list[tuple[str, bool, str]]) -> None:
    """Raise ValueError naming the first setting that fails its check."""
    for name, ok, why in checks:
        if not ok:
            raise ValueError(f"{name} {why}, got {getattr(config, name)!r}")


class ConfigTree:
    """A config dataclass whose fields include other config dataclasses
    (``EngineConfig`` holds ``SchedulerConfig``, ``CacheConfig``, ...). Every
    setting is declared once, in the config that owns it; the tree is built
    from, read as and replaced by flat setting names (``block_size``, not
    ``cache.block_size``), as ``LLM(model, **kwargs)`` and tests pass them.
    Names are unique across a tree, so a flat name has one home."""

    @classmethod
    def create(cls, **flat: Any):
        """The tree from flat setting names; a name no config of the tree
        declares is a TypeError naming it."""
        config = cls(**_route(cls, flat))
        if flat:
            raise TypeError(f"{cls.__name__}: unknown setting(s) {', '.join(sorted(flat))}")
        return config

    def replace(self, **flat: Any):
        """A copy with the given settings changed (flat names)."""
        changes = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in flat:
                changes[f.name] = flat.pop(f.name)
            elif dataclasses.is_dataclass(value):
                mine = {n: flat.pop(n) for n in list(flat) if n in _names(type(value))}
                if mine:
                    changes[f.name] = (value.replace(**mine) if isinstance(value, ConfigTree)
                                       else dataclasses.replace(value, **mine))
        if flat:
            raise TypeError(f"{type(self).__name__}: unknown setting(s) {', '.join(sorted(flat))}")
        return dataclasses.replace(self, **changes)

    def __getattr__(self, name: str) -> Any:
        # Reached only for names that are not this config's own fields: look
        # in the configs it holds. Dunder lookups (pickle, copy) stay plain.
        if name.startswith("__"):
            raise AttributeError(name)
        for f in dataclasses.fields(self):
            sub = self.__dict__.get(f.name)
            if dataclasses.is_dataclass(sub) and name in _names(type(sub)):
                return getattr(sub, name)
        raise AttributeError(f"{type(self).__name__} has no setting {name!r}")


@functools.lru_cache(maxsize=None)
def _names(cls: type) -> frozenset[str]:
    """Every flat setting name of a config class, sub-configs included."""
    names: set[str] = set()
    for f in dataclasses.fields(cls):
        sub = _sub_config(f)
        names |= _names(sub) if sub is not None else {f.name}
    return frozenset(names)


def _sub_config(f: dataclasses.Field) -> type | None:
    """The config class a field holds, if it holds one."""
    factory = f.default_factory
    return factory if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory) else None


def _route(cls: type, flat: dict[str, Any]) -> dict[str, Any]:
    """``cls``'s constructor arguments, taking the names it owns out of ``flat``."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        sub = _sub_config(f)
        if f.name in flat:
            kwargs[f.name] = flat.pop(f.name)
        elif sub is not None:
            kwargs[f.name] = sub(**_route(sub, flat))
    return kwargs


# -- flags ---------------------------------------------------------------------------


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def cli_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` itself (not of the configs it holds) a flag sets."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", False) and _sub_config(f) is None]


def add_flags(group: Any, cls: type) -> None:
    """One flag per setting of ``cls`` a flag sets, from its declaration:
    the type and default of the field, its help, choices and aliases."""
    import argparse

    for f in cli_fields(cls):
        m = f.metadata
        kind = str(f.type).split("|")[0].strip()
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": m["help"]}
        if kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            if kind.startswith("tuple"):
                kwargs["nargs"] = "+"
                kind = kind[len("tuple["):].split(",")[0]
            kwargs["type"] = {"int": int, "float": float, "str": str}[kind]
            kwargs["metavar"] = m.get("metavar") or {"int": "N", "float": "X", "str": None}[kind]
        if "default" not in m["help"]:
            kwargs["help"] = f"{m['help']} (default: {_shown(f.default)})"
        if m["choices"]:
            kwargs.update(choices=list(m["choices"]), metavar=None)  # argparse shows the choices
        group.add_argument(flag_name(f), *m["aliases"], **kwargs)


def _shown(default: Any) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    if default is None:
        return "none"
    return f"{default:g}" if isinstance(default, float) else str(default)


def flag_values(args: Any, cls: type) -> dict[str, Any]:
    """The settings of ``cls`` its flags set, by field name."""
    values = {}
    for f in cli_fields(cls):
        value = getattr(args, f.name)
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return values


def flag_error(exc: ValueError, classes: tuple[type, ...]) -> ValueError:
    """A config's ValueError (it starts with the setting's name) told in
    the flag's name, for an error on the command line."""
    text = str(exc)
    name = text.split(" ", 1)[0].rstrip(":")
    for cls in classes:
        for f in cli_fields(cls):
            if f.name == name:
                return ValueError(flag_name(f) + text[len(name):])
    return exc
