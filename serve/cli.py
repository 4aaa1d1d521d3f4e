"""The ``fluidserve`` command: ``serve``, ``bench`` and ``profile``.

Owns flags → frozen configs (``EngineConfig``, ``ServerSettings``) and process
startup. Scheduler flags come from ``scheduler.options`` so the CLI never has
to know a policy's knobs. Without ``--model`` the server runs the built-in
tiny random-weight model and says so, so the README's command works offline.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .inputs import ModelInfo

logger = logging.getLogger("fluidserve.serve")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from ..scheduler.options import add_cli_args as add_scheduler_args

    m = p.add_argument_group("model and engine")
    m.add_argument("--model", default=None,
                   help="Hugging Face id or local path; omitted: the built-in tiny random-weight model")
    m.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    m.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    m.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights from the model's config")
    m.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    m.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    m.add_argument("--max-num-seqs", type=int, default=256, help="request cap of one step")
    m.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    m.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory the engine may use (weights + KV cache)")
    m.add_argument("--num-kv-blocks", type=int, default=None, help="device KV blocks (overrides the sizing)")
    m.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32, 64])
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--profile", dest="profile_path", default=None, metavar="PROFILE_JSON",
                   help="measured cost model from `fluidserve profile -o` (default: analytic roofline)")
    m.add_argument("--executor", default="local", choices=["local", "ray"],
                   help="local: in-process worker; ray: one Ray actor per GPU")
    m.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs (Ray workers) per model")
    m.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (multi-node); default: start a local one on 127.0.0.1")
    add_scheduler_args(p)

    s = p.add_argument_group("server")
    # Loopback unless told otherwise; the container image sets FLUIDSERVE_HOST=0.0.0.0
    # because its fixed ENTRYPOINT leaves users no other way to bind outside.
    s.add_argument("--host", default=os.environ.get("FLUIDSERVE_HOST", "127.0.0.1"),
                   help="address to bind (default 127.0.0.1, or $FLUIDSERVE_HOST)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on /v1/*")
    s.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests waiting for their first token before new ones get 429")
    s.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger bodies get 413")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    s.add_argument("--watchdog-timeout", type=float, default=60.0,
                   help="/health turns 503 when the engine loop shows no heartbeat for this long")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def engine_config_from_args(args: argparse.Namespace):
    from ..engine.config import EngineConfig
    from ..scheduler.options import options_from_args

    policy, policy_options = options_from_args(args)
    return EngineConfig(
        model=args.model, served_model_name=args.served_model_name, dtype=args.dtype,
        load_format=args.load_format, device=args.device, seed=args.seed,
        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, scheduling_policy=policy,
        policy_options=policy_options, profile_path=args.profile_path, executor=args.executor,
        tensor_parallel_size=args.tensor_parallel_size, ray_address=args.ray_address,
    )


def model_info(engine) -> "ModelInfo":
    from .inputs import ModelInfo

    return ModelInfo(name=engine.model_name, max_model_len=engine.max_model_len,
                     vocab_size=engine.vocab_size, is_tiny_default=bool(getattr(engine, "is_tiny_default", False)))


def frontend_tokenizer(engine):
    """The frontend's own copy of the tokenizer, so tokenizing on the event
    loop never races the engine loop's detokenizer on shared Rust state."""
    import copy

    try:
        return copy.deepcopy(engine.tokenizer)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared
        return engine.tokenizer


def run_serve(args: argparse.Namespace) -> int:
    from ..engine.async_engine import AsyncEngine
    from ..engine.engine import LLMEngine
    from .api import ServerSettings, build_app
    from .server import make_server

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config_from_args(args)
    except ValueError as exc:
        print(f"fluidserve serve: {exc}", file=sys.stderr)
        return 2
    _share_cpu_with_frontend(config)
    try:
        engine = LLMEngine(config)
    except (ValueError, OSError) as exc:  # a bad model path, an impossible KV size, ...
        print(f"fluidserve serve: {exc}", file=sys.stderr)
        return 2
    info = model_info(engine)
    if info.is_tiny_default:
        logger.warning("no --model given: serving the built-in tiny random-weight model %r "
                       "(for trying the API offline; its text is noise)", info.name)
    settings = ServerSettings(api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                              max_queued_requests=args.max_queued_requests)
    app = build_app(AsyncEngine(engine, stall_timeout=args.watchdog_timeout), frontend_tokenizer(engine),
                    info, settings)
    server = make_server(app, args.host, args.port, drain_timeout=args.drain_timeout,
                         log_level=args.log_level)
    logger.info("serving %s on http://%s:%d/v1 (max_model_len %d)", info.name, args.host, args.port,
                info.max_model_len)
    server.run()
    return 0


def _share_cpu_with_frontend(config) -> None:
    """On CPU, torch's thread pool would take every core from the event loop
    that streams tokens: leave one core to the frontend."""
    import torch

    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))


def run_bench(argv: Sequence[str]) -> int:
    from .bench_client import main as bench_main

    return bench_main(list(argv))


def run_profile(argv: Sequence[str]) -> int:
    try:
        from ..engine.profiler import main as profile_main
    except ImportError as exc:
        print(f"fluidserve profile: the profiler is not available ({exc})", file=sys.stderr)
        return 2
    return int(profile_main(list(argv)) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fluidserve", description="fluidserve: OpenAI-compatible LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_args(sub.add_parser("serve", help="run the OpenAI-compatible server"))
    sub.add_parser("bench", help="load-test a running server (see `fluidserve bench --help`)", add_help=False)
    sub.add_parser("profile", help="measure the engine's cost model", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # bench and profile own their flags: hand them the rest of the line.
    if argv and argv[0] == "bench":
        return run_bench(argv[1:])
    if argv and argv[0] == "profile":
        return run_profile(argv[1:])
    args = build_parser().parse_args(argv)
    return run_serve(args)


if __name__ == "__main__":
    sys.exit(main())
