"""The ``fluidserve`` command: ``serve``, ``bench`` and ``profile``.

Owns flags → frozen configs (``EngineConfig``, ``ServerSettings``) and process
startup. Scheduler flags come from ``scheduler.options`` so the CLI never has
to know a policy's knobs. Without a model the server runs the built-in tiny
random-weight model and says so, so the README's command works offline.

``fluidserve serve [MODEL]`` takes vLLM's flag names with vLLM's meanings for
what we support, so a vLLM command line runs unchanged; a vLLM flag we do not
support ends the process with one line saying so (``UNSUPPORTED_VLLM_FLAGS``).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from fluidserve.engine.config import QUANTIZATION_ALIASES, QUANTIZATION_METHODS
from fluidserve.engine.sampling_params import STRUCTURED_OUTPUT_BACKENDS
from fluidserve.kvcache.config import KV_CACHE_DTYPES
from fluidserve.serve.reasoning import REASONING_PARSERS
from fluidserve.serve.tool_parsers import TOOL_CALL_PARSERS
if TYPE_CHECKING:
    from fluidserve.serve.api import ServerSettings
    from fluidserve.serve.inputs import ModelInfo

logger = logging.getLogger("fluidserve.serve")

# vLLM flags we do not implement -> why. Each fails with one line, not a usage
# dump or a traceback. A value in ``_HARMLESS_VALUES`` is one we implement
# (the flag then reaches the parser as our own setting).
UNSUPPORTED_VLLM_FLAGS = {
    "--kv-cache-dtype": "the KV cache stores auto (the model's dtype), fp8, fp8_e4m3 or fp8_e5m2",
    "--tool-parser-plugin": "tool-call parser plugins are not supported (built in: --tool-call-parser "
                            "hermes | llama3_json)",
    "--quantization": "quantized checkpoints load as fp8, compressed-tensors (FP8), gptq or awq (gptq_marlin, "
                      "awq_marlin)",
    "-q": "quantized checkpoints load as fp8, compressed-tensors (FP8), gptq or awq (gptq_marlin, awq_marlin)",
    "--max-cpu-loras": "every LoRA adapter stays on the device (--max-loras slots): there is no host cache of "
                       "adapters to size",
    "--fully-sharded-loras": "LoRA adapters shard as their base weights do (B rows or A columns per rank)",
    "--lora-dtype": "LoRA adapters run in the model's dtype",
    "--pipeline-parallel-size": "only tensor parallelism is implemented",
    "-pp": "only tensor parallelism is implemented",
    "--cpu-offload-gb": "weight offloading is not implemented",
    "--guided-decoding-backend": "structured output always runs on xgrammar",
    "--limit-mm-per-prompt": "multimodal inputs are not supported",
    "--tokenizer-mode": "tokenizers load through transformers' AutoTokenizer only",
    "--rope-scaling": "overriding the model's RoPE scaling is not supported",
}
_QUANTIZATION_NAMES = set(QUANTIZATION_METHODS) | set(QUANTIZATION_ALIASES)
_HARMLESS_VALUES = {"--kv-cache-dtype": set(KV_CACHE_DTYPES), "--quantization": _QUANTIZATION_NAMES,
                    "-q": _QUANTIZATION_NAMES, "--tokenizer-mode": {"auto"}, "--lora-dtype": {"auto"},
                    "--pipeline-parallel-size": {"1"}, "-pp": {"1"},
                    "--guided-decoding-backend": set(STRUCTURED_OUTPUT_BACKENDS)}
_VALUELESS = {"--fully-sharded-loras"}
# Without an SLO flag, steps with online work may take at most this multiple
# of their online part alone (benchmarks/coserving_server.py --configs ''
# '--online-slowdown-cap 0' '--online-slowdown-cap 1.5' sets it beside no cap
# and a looser one). Offline work (Batch API lines, a request's priority
# above 0) is cut only beside online work: offline-only steps ran as fast
# with it as without (16 embeddings of 1,024 tokens: 24.9-25.4 s against
# 25.2-25.4 s; benchmarks/slowdown_cap_offline.py), and with embedding
# queries arriving beside a background bulk job their median latency went
# from 4.6 s to 55 ms (benchmarks/embeddings_vs_vllm.py).
COSERVING_SLOWDOWN_CAP = 1.2
# With --data-dir on a CPU and no --preemption-safepoint-layers: half-layer
# safepoints (see _safepoint_layers for the figures).
COSERVING_CPU_SAFEPOINT_LAYERS = 0.5
# vLLM's scheduling policy names that we map onto ours (see ``--scheduling-policy``).
POLICY_ALIASES = {"priority": "fcfs"}
UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


class UnsupportedFlag(Exception):
    """A vLLM flag fluidserve does not implement."""


def check_unsupported(argv: Sequence[str]) -> None:
    """Raise ``UnsupportedFlag`` for the first unsupported vLLM flag in ``argv``."""
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name not in UNSUPPORTED_VLLM_FLAGS:
            continue
        if not eq and name not in _VALUELESS:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if value in _HARMLESS_VALUES.get(name, ()):
            continue
        shown = name if name in _VALUELESS or not value else f"{name} {value}"
        raise UnsupportedFlag(f"{shown} is not supported ({UNSUPPORTED_VLLM_FLAGS[name]})")


# --structured-outputs-config: vLLM's keys -> the values we run. backend and
# disable_any_whitespace are ours to set; the rest are accepted at vLLM's
# default, which is what runs here anyway.
_STRUCTURED_OUTPUTS_KEYS: dict[str, tuple[Any, ...]] = {
    "backend": STRUCTURED_OUTPUT_BACKENDS,
    "disable_any_whitespace": (False, True),
    "disable_fallback": (False,),
    "disable_additional_properties": (False,),
    "reasoning_parser": ("", *REASONING_PARSERS),
    "enable_in_reasoning": (False, True),
}


def _structured_outputs_config(text: str) -> dict[str, Any]:
    """``--structured-outputs-config``: vLLM's JSON object, each key checked
    against what runs here."""
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    for key, v in value.items():
        allowed = _STRUCTURED_OUTPUTS_KEYS.get(key)
        if allowed is None:
            raise argparse.ArgumentTypeError(f"{key}: not a key this server knows "
                                             f"({', '.join(_STRUCTURED_OUTPUTS_KEYS)})")
        if not any(v == a and type(v) is type(a) for a in allowed):
            raise argparse.ArgumentTypeError(f"{key}: {v!r} is not supported (supported: "
                                             f"{', '.join(json.dumps(a) for a in allowed)})")
    return value


def _dotted_config_flags(argv: list[str]) -> list[str]:
    """vLLM's ``--structured-outputs-config.KEY VALUE`` as the JSON form of
    the same flag, which argparse knows (later flags win, as in vLLM)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        prefix = "--structured-outputs-config."
        if name.startswith(prefix) and len(name) > len(prefix):
            if not eq and i + 1 < len(argv):
                i, value = i + 1, argv[i + 1]
            try:
                parsed = json.loads(value)
            except ValueError:
                parsed = value  # a bare word: vLLM reads it as a string
            out += ["--structured-outputs-config", json.dumps({name[len(prefix):]: parsed})]
        else:
            out.append(argv[i])
        i += 1
    return out


def _origins(text: str) -> list[str]:
    """``--allowed-origins``: vLLM's JSON list, or a comma-separated list."""
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a JSON list: {text!r}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError("must be a JSON list of strings")
        return value
    return [o.strip() for o in text.split(",") if o.strip()]


def lora_module(text: str) -> tuple[str, str]:
    """One ``--lora-modules`` value: ``name=path`` or vLLM's JSON object
    with ``name`` and ``path`` (its ``base_model_name`` must be unset)."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}") from None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(
                value.get("path"), str):
            raise argparse.ArgumentTypeError(f"needs string name and path: {text!r}")
        unknown = set(value) - {"name", "path", "base_model_name"}
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown key(s) {sorted(unknown)} in {text!r}")
        name, path = value["name"], value["path"]
    else:
        name, eq, path = text.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    if not name or not path:
        raise argparse.ArgumentTypeError(f"expected a non-empty name and path, got {text!r}")
    return name, path


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from fluidserve.engine.args import add_engine_args

    m = add_engine_args(p)
    # Unset unless given: with the Batch API on a CPU the server picks its own (engine_config_from_args).
    p.set_defaults(preemption_safepoint_layers=None)
    m.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="Hugging Face id or local path (same as --model)")
    m.add_argument("--model", default=None,
                   help="Hugging Face id or local path; omitted: the built-in tiny random-weight model")
    m.add_argument("--revision", default=None, help="branch, tag or commit of a hub model")
    m.add_argument("--trust-remote-code", action="store_true",
                   help="let the checkpoint's own config/tokenizer classes load (the model always runs "
                        "on fluidserve's built-in implementations)")
    m.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients use; the first is the one responses carry (default: the model)")
    m.add_argument("--lora-modules", nargs="+", default=None, type=lora_module, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) to serve from the start, with --enable-lora: name=path, "
                        "or vLLM's JSON form '{\"name\": ..., \"path\": ...}'; a request names one as its "
                        "model")
    m.add_argument("--chat-template", default=None,
                   help="Jinja chat template: a file, or the template itself (default: the tokenizer's)")
    m.add_argument("--generation-config", default="auto",
                   help="sampling defaults for requests that leave them unset: 'auto' (the model's "
                        "generation_config.json), 'vllm' (none: temperature 1, top_p 1, ...) or a folder "
                        "holding a generation_config.json")

    s = p.add_argument_group("server")
    # Loopback unless told otherwise; the container image sets FLUIDSERVE_HOST=0.0.0.0
    # because its fixed ENTRYPOINT leaves users no other way to bind outside.
    s.add_argument("--host", default=os.environ.get("FLUIDSERVE_HOST", "127.0.0.1"),
                   help="address to bind (default 127.0.0.1, or $FLUIDSERVE_HOST)")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    s.add_argument("--api-key", default=os.environ.get("FLUIDSERVE_API_KEY") or None,
                   help="require 'Authorization: Bearer <key>' on /v1/* (default: $FLUIDSERVE_API_KEY)")
    s.add_argument("--allowed-origins", type=_origins, default=None,
                   help='CORS: origins browsers may call from, as a JSON list (\'["*"]\') or comma-separated '
                        "(default: none, no CORS headers)")
    s.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM)")
    s.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate chain (PEM)")
    s.add_argument("--disable-log-stats", action="store_true",
                   help="no effect: statistics are exported on /metrics, never logged")
    s.add_argument("--disable-log-requests", action="store_true",
                   help="no request logging (the default; kept for older vLLM command lines)")
    s.add_argument("--enable-log-requests", action="store_true",
                   help="log each request's id, parameters and prompt (at info level)")
    s.add_argument("--max-log-len", type=int, default=None,
                   help="with --enable-log-requests: characters / token ids of the prompt logged (default: all)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let requests use tool_choice "auto" (the default when tools are sent): the model '
                        "decides, and --tool-call-parser finds its calls")
    s.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="the model's tool-call format: hermes (Hermes, Qwen 2.5/3) or llama3_json (Llama 3.x)")
    s.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split a thinking model's replies into reasoning and content (deepseek_r1: DeepSeek-R1 "
                        "and its distills; qwen3: Qwen3, QwQ; mistral: Magistral; granite: Granite 3.2; ernie45: "
                        "ERNIE 4.5 thinking; glm45: GLM-4.5 and on; olmo3: OLMo 3 Think); structured output then "
                        "starts after the thinking (granite and olmo3 end it in text: a 400 on a thinking request)")
    s.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprob tokens as "token_id:N" unless a request says otherwise')
    s.add_argument("--enable-force-include-usage", action="store_true",
                   help="end every stream with a usage chunk, asked for or not")
    s.add_argument("--enable-request-id-headers", action="store_true",
                   help="answer every request with an X-Request-Id header")
    s.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage carries prompt_tokens_details.cached_tokens (prompt tokens from the prefix cache)")
    s.add_argument("--max-logprobs", type=int, default=20,
                   help="most logprobs a request may ask for per position (logprobs, top_logprobs, "
                        "prompt_logprobs); -1: the vocabulary size, which a request's -1 asks for")
    s.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info: the tokenizer's configuration and chat template")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a chat request (or an embeddings conversation) bring its own Jinja chat template "
                        "(chat_template); without it such a request is a 400 (templates render in transformers' "
                        "sandbox, but run the client's code)")
    s.add_argument("--max-stored-responses", type=int, default=10_000,
                   help="Responses API: the most replies kept for previous_response_id and "
                        "GET /v1/responses/{id}, the least recently made or continued going first (0: none kept)")
    s.add_argument("--guided-decoding-backend", default="auto", choices=STRUCTURED_OUTPUT_BACKENDS,
                   help="structured output (response_format, forced tool calls) runs on xgrammar, the one "
                        "backend built in")
    s.add_argument("--structured-outputs-config", type=_structured_outputs_config, action="append", default=[],
                   metavar="JSON",
                   help='vLLM\'s structured output options as a JSON object (or --structured-outputs-config.KEY '
                        'VALUE): {"disable_any_whitespace": true} makes every JSON constraint (response_format, '
                        'guided_json, forced tool calls) compact, no whitespace outside strings, unless a request\'s '
                        'structured_outputs.disable_any_whitespace says otherwise; "backend": auto | xgrammar')
    s.add_argument("--max-queued-requests", type=int, default=1024,

                   help="requests waiting for their first token before new ones get 429")
    s.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger bodies get 413")
    s.add_argument("--ignore-unknown-fields", action="store_true",
                   help="log and drop request fields neither OpenAI nor vLLM defines, as vLLM does; without it "
                        "they are a 400 naming the field, as OpenAI answers (a misspelt field never runs silently)")
    s.add_argument("--data-dir", default=None,
                   help="directory of the Batch API's SQLite store (files, batches, results), where the "
                        "Responses API's kept responses outlive restarts too; omitted: /v1/files and /v1/batches "
                        "are disabled and kept responses live in memory only")
    s.add_argument("--batch-max-in-flight", type=int, default=64,
                   help="batch lines in the engine at once (offline requests; online ones never wait on them)")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    s.add_argument("--watchdog-timeout", type=float, default=60.0,
                   help="/health turns 503 when the engine loop shows no heartbeat for this long")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log level of fluidserve's own loggers")
    s.add_argument("--uvicorn-log-level", default=None, choices=UVICORN_LOG_LEVELS,
                   help="log level of uvicorn itself (default: --log-level)")
    show_defaults(p)


def show_defaults(p: argparse.ArgumentParser) -> None:
    """Every flag's help ends with its default, as the config's flags'
    do (kvcache/config.py); the server's own flags say theirs here."""
    for action in p._actions:
        if not action.option_strings or action.help in (None, argparse.SUPPRESS) or "default" in action.help:
            continue
        value = action.default
        shown = ("on" if value else "off") if isinstance(value, bool) else "none" if value is None else value
        action.help += f" (default: {shown})"


def engine_config_from_args(args: argparse.Namespace):
    from fluidserve.engine.args import engine_config_from_args as from_flags
    from fluidserve.engine.loader import resolve_model_dir

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"model: given twice, as {args.model_tag!r} and --model {args.model!r}")
    model = args.model_tag or args.model
    served = args.served_model_name[0] if args.served_model_name else None
    if model is not None and args.revision is not None:
        # A hub id at a revision becomes its local snapshot; clients keep the id.
        served = served or model
        model = str(resolve_model_dir(model, args.load_format, revision=args.revision))
    if args.preemption_safepoint_layers is None:
        args.preemption_safepoint_layers = _safepoint_layers(args)
    config = from_flags(args, model=model, served_model_name=served,
                        lora_modules=tuple(getattr(args, "lora_modules", None) or ()))
    if config.yield_busy_cores is None:  # the server lets idle OpenMP threads spin (set_openmp_waiting)
        config = config.replace(yield_busy_cores=True)
    sched = config.scheduler
    if args.online_slowdown_cap is None and sched.online_tpot_slo_ms is None and sched.online_ttft_slo_ms is None:
        # Offline work beside online traffic: online requests are protected
        # without the user knowing about SLO flags (benchmarks/coserving_server.py).
        config = config.replace(online_slowdown_cap=COSERVING_SLOWDOWN_CAP)
    return config


def _safepoint_layers(args: argparse.Namespace) -> float:
    """Layers between an offline step's interrupt checks, when not given. A
    CPU serving a Batch API checks twice a layer: its layers are slow enough
    that waiting two of them costs an online arrival its TTFT (through the
    server, medians of 2 paired rounds: online P99 TTFT 2.00x online-only
    against 4.47x at 2 layers, P99 TPOT 1.15x against 1.24x, the batch at 54%
    of its speed alone either way; benchmarks/coserving_server.py)."""
    from fluidserve.scheduler.config import SchedulerConfig

    default = SchedulerConfig().preemption_safepoint_layers
    if not getattr(args, "data_dir", None):
        return default
    import torch

    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    return COSERVING_CPU_SAFEPOINT_LAYERS if on_cpu else default


def model_info(engine, served_model_names: Sequence[str] | None = None,
               generation_config: str = "auto", max_logprobs: int = 20,
               chat_template: str | None = None) -> "ModelInfo":
    """What the frontend knows of the served model; ``generation_config`` as
    ``--generation-config`` takes it (auto | vllm | a folder), ``max_logprobs``
    as ``--max-logprobs``, ``chat_template`` as ``--chat-template`` gave it
    (a cross-encoder's score template: vLLM applies only one given so)."""
    from fluidserve.serve.inputs import ModelInfo

    names = list(served_model_names or [])
    name = engine.model_name
    aliases = tuple(n for n in names if n != name)
    config = getattr(engine, "config", None)
    classifier = getattr(engine, "classifier", None)
    return ModelInfo(name=name, max_model_len=engine.max_model_len, vocab_size=engine.vocab_size,
                     is_tiny_default=bool(getattr(engine, "is_tiny_default", False)), aliases=aliases,
                     sampling_defaults=sampling_defaults(engine, generation_config),
                     root=getattr(config, "model", None) or str(engine.model_dir),
                     max_logprobs=max_logprobs, eos_token_ids=tuple(sorted(getattr(engine, "eos_token_ids", ()))),
                     lora_modules=dict(config.lora.lora_modules) if config is not None else {},
                     pooling=getattr(engine, "pooling", None) is not None,
                     labels=classifier.labels if classifier is not None else (),
                     use_sep_token=classifier.use_sep_token if classifier is not None else True,
                     score_template=chat_template if classifier is not None else None,
                     speculative=getattr(config, "speculative_config", None) is not None)


def sampling_defaults(engine, generation_config: str) -> dict:
    from fluidserve.engine.loader import generation_defaults

    if generation_config == "vllm":
        return {}
    folder = getattr(engine, "model_dir", None) if generation_config == "auto" else generation_config
    if folder is None:
        return {}
    if not Path(folder, "generation_config.json").exists() and generation_config != "auto":
        raise ValueError(f"generation_config: no generation_config.json in {folder!r}")
    return generation_defaults(folder)


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the template given inline."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if any(mark in value for mark in ("{{", "{%")):
        return value
    raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")


def frontend_tokenizer(engine, chat_template: str | None = None):
    """The frontend's own copy of the tokenizer, so tokenizing on the event
    loop never races the engine loop's detokenizer on shared Rust state."""
    import copy

    try:
        tokenizer = copy.deepcopy(engine.tokenizer)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared
        tokenizer = engine.tokenizer
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _check_ssl(args: argparse.Namespace) -> None:
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("ssl: --ssl-keyfile and --ssl-certfile go together")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile)):
        if path and not Path(path).is_file():
            raise ValueError(f"ssl: {flag} {path!r} is not a file")


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """The frontend's settings from the serve flags, for the server and for
    ``run-batch`` alike; ValueError for flags that do not go together."""
    from fluidserve.serve.api import ServerSettings
    from fluidserve.serve.lora import runtime_updating_allowed

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
    structured: dict[str, Any] = {}
    for given in args.structured_outputs_config:
        structured.update(given)
    return ServerSettings(api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                          max_queued_requests=args.max_queued_requests,
                          allowed_origins=tuple(args.allowed_origins or ()),
                          log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
                          tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                          return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                          enable_force_include_usage=args.enable_force_include_usage,
                          enable_request_id_headers=args.enable_request_id_headers,
                          enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                          enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                          trust_request_chat_template=args.trust_request_chat_template,
                          ignore_unknown_fields=args.ignore_unknown_fields,
                          max_stored_responses=args.max_stored_responses,
                          disable_any_whitespace=structured.get("disable_any_whitespace", False),
                          reasoning_parser=args.reasoning_parser or structured.get("reasoning_parser") or None,
                          enable_in_reasoning=structured.get("enable_in_reasoning", False),
                          runtime_lora_updating=runtime_updating_allowed())


def run_serve(args: argparse.Namespace) -> int:
    from fluidserve.engine.async_engine import AsyncEngine
    from fluidserve.engine.heap import frozen_heap
    from fluidserve.engine.loader import set_trust_remote_code
    from fluidserve.serve.api import build_app
    from fluidserve.serve.server import bind_socket, make_server

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    set_trust_remote_code(args.trust_remote_code)
    try:
        _check_ssl(args)
        settings = server_settings(args)
        chat_template = load_chat_template(args.chat_template)
        config = engine_config_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"fluidserve serve: {exc}", file=sys.stderr)
        return 2
    # The port is taken before any engine starts: a busy one fails in a
    # second, not after the weights load, and nothing the engines open (Ray's
    # replicas bind ports of their own) can take it in between.
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        print(f"fluidserve serve: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    sock.set_inheritable(False)  # no engine process keeps the port after the server ends
    try:
        engine_thread = None
        if config.data_parallel_size > 1:
            engine = start_replicas(config)
            model = engine.facts  # replica 0's: the front end loads no weights
        else:
            _share_cpu_with_frontend(config)
            engine, engine_thread = build_engine(config)
            model = engine
        info = model_info(model, args.served_model_name, args.generation_config, args.max_logprobs, chat_template)
    except (ValueError, OSError) as exc:  # a bad model path, an impossible KV size, ...
        print(f"fluidserve serve: {exc}", file=sys.stderr)
        return 2
    if info.is_tiny_default:
        logger.warning("no model given: serving the built-in tiny random-weight model %r "
                       "(for trying the API offline; its text is noise)", info.name)
    if info.sampling_defaults:
        logger.info("sampling defaults from the generation config: %s (--generation-config vllm: none)",
                    info.sampling_defaults)
    from fluidserve.serve.batches import BatchConfig
    from fluidserve.serve.store import StoreError

    batch_config = BatchConfig(args.data_dir, max_in_flight=args.batch_max_in_flight) if args.data_dir else None
    died: list[BaseException] = []

    def exit_on_death(exc: BaseException) -> None:
        # Every request has had its 503 by now. A dead engine loop does not
        # come back, and under plain `docker run --restart` an unhealthy
        # container is never restarted: exit, for the supervisor to start a
        # fresh server (accepted batch lines resume from --data-dir).
        died.append(exc)
        logger.error("the engine loop died (%s: %s): draining, then exiting with status 1",
                     type(exc).__name__, exc)
        server.should_exit = True
        server.on_drain()

    try:
        front = (engine if config.data_parallel_size > 1
                 else AsyncEngine(engine, stall_timeout=args.watchdog_timeout, on_death=exit_on_death,
                                  thread=engine_thread))
        app = build_app(front, frontend_tokenizer(model, chat_template), info, settings, batch_config=batch_config)
    except (StoreError, ValueError) as exc:  # a store corrupt or unwritable, a model without think tokens
        print(f"fluidserve serve: {exc}", file=sys.stderr)
        return 2
    server = make_server(app, args.host, args.port, drain_timeout=args.drain_timeout,
                         log_level=args.uvicorn_log_level or args.log_level)
    if args.ssl_keyfile:
        # uvicorn builds its SSL context from these when the server starts.
        server.config.ssl_keyfile, server.config.ssl_certfile = args.ssl_keyfile, args.ssl_certfile
    scheme = "https" if args.ssl_keyfile else "http"
    logger.info("serving %s on %s://%s:%d/v1 (max_model_len %d)", info.name, scheme, args.host, args.port,
                info.max_model_len)
    if _is_loopback(args.host):
        logger.info("listening on loopback only: to accept other machines, pass --host 0.0.0.0 "
                    "(with --api-key, or FLUIDSERVE_API_KEY, to require a key)")
    with frozen_heap(collect_first=True):
        server.run(sockets=[sock])
    return 1 if died else 0


def build_engine(config):
    """The engine and the thread to step it on: an in-process worker is
    built on an ``EngineThread`` (one OpenMP team computes, from the
    weights' load on); Ray's workers compute in processes of their own (no
    thread: ``AsyncEngine`` starts one)."""
    from fluidserve.engine.async_engine import EngineThread
    from fluidserve.engine.engine import LLMEngine

    if config.executor != "local":
        return LLMEngine(config), None
    thread = EngineThread()
    return thread.build(LLMEngine, config), thread


def start_replicas(config):
    """``--data-parallel-size N``: N engines in Ray actors behind one front.
    On a Ray instance of this machine's own, the cores are split among the
    replicas (a CPU replica computes on its share only); on a cluster each
    replica takes Ray's default for its actor."""
    import torch

    from fluidserve.engine.data_parallel import DataParallelEngine

    on_cpu = config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())
    threads = max(1, (os.cpu_count() or 1) // config.data_parallel_size) if on_cpu and not config.ray_address else None
    return DataParallelEngine(config, torch_threads=threads)


# Spin rounds of an idle OpenMP thread before it sleeps: about 0.1 ms.
SPIN_ROUNDS = "10000"


def set_openmp_waiting() -> None:
    """Idle OpenMP threads spin a short while, then sleep; a policy the user
    set (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``) wins. Read once, when torch
    loads OpenMP: call before it does.

    A decode step's ops come microseconds apart. Threads that sleep at once
    (``OMP_WAIT_POLICY=PASSIVE``) pay a wake-up on every op: SmolLM2 decodes
    at 43.8 ms a step at batch 1 on two cores, 24.3 ms with threads spinning
    10,000 rounds (``benchmarks/omp_teams.py``; the engine must be built on
    the thread that steps it, ``EngineThread``). Threads that spin on
    (OpenMP's default 300,000 rounds, or ``ACTIVE``) hold cores the event
    loop needs. Where another process keeps a core busy, even a short spin
    makes every op wait on the teammate sharing that core: the server steps
    on the cores left free (``--yield-busy-cores``, engine/cpu_share.py)."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", SPIN_ROUNDS)


def _share_cpu_with_frontend(config) -> None:
    """On CPU, torch's threads and the event loop that streams tokens share
    the cores. Idle threads that spin a short while (``set_openmp_waiting``)
    or sleep at once (``PASSIVE``) let torch compute on every core and the
    loop still get one when it has work; threads told to spin on
    (``ACTIVE``) leave it one core."""
    import torch

    if os.environ.get("OMP_WAIT_POLICY", "").upper() != "ACTIVE":
        return
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))


def run_bench(argv: Sequence[str]) -> int:
    from fluidserve.serve.bench_client import main as bench_main

    return bench_main(list(argv))


def run_profile(argv: Sequence[str]) -> int:
    try:
        from fluidserve.engine.profiler import main as profile_main
    except ImportError as exc:
        print(f"fluidserve profile: the profiler is not available ({exc})", file=sys.stderr)
        return 2
    return int(profile_main(list(argv)) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fluidserve", description="fluidserve: OpenAI-compatible LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_args(sub.add_parser(
        "serve", help="run the OpenAI-compatible server",
        epilog="vLLM's --scheduling-policy priority runs as fcfs: a request's int priority (lower first, "
               "default 0) puts it in the online class when <= 0 and the offline class when > 0; online "
               "requests always go first, arrival order decides inside a class."))
    sub.add_parser("bench", help="load-test a running server (see `fluidserve bench --help`)", add_help=False)
    sub.add_parser("profile", help="measure the engine's cost model", add_help=False)
    sub.add_parser("run-batch", help="run an OpenAI batch file offline (see `fluidserve run-batch --help`)",
                   add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    set_openmp_waiting()
    # bench and profile own their flags: hand them the rest of the line.
    if argv and argv[0] == "bench":
        return run_bench(argv[1:])
    if argv and argv[0] == "profile":
        return run_profile(argv[1:])
    argv = _dotted_config_flags(argv)
    if argv and argv[0] == "run-batch":
        from fluidserve.serve.batches import run_batch_main

        return run_batch_main(argv[1:])
    try:
        check_unsupported(argv)
    except UnsupportedFlag as exc:
        print(f"fluidserve serve: {exc}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(_map_policy_alias(argv))
    return run_serve(args)


def _map_policy_alias(argv: list[str]) -> list[str]:
    """vLLM's ``--scheduling-policy priority`` runs as ``fcfs``: a request's
    int ``priority`` picks its class (<= 0 online, > 0 offline; online always
    goes first) and arrival order decides inside a class."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--scheduling-policy" and i + 1 < len(out) and out[i + 1] in POLICY_ALIASES:
            out[i + 1] = POLICY_ALIASES[out[i + 1]]
        elif arg.startswith("--scheduling-policy=") and arg.split("=", 1)[1] in POLICY_ALIASES:
            out[i] = "--scheduling-policy=" + POLICY_ALIASES[arg.split("=", 1)[1]]
    return out


if __name__ == "__main__":
    sys.exit(main())
