"""One long prompt alone: its time to first token through ``fluidserve
serve``, beside ``LLM.generate(max_tokens=1)`` in-process and one
``transformers`` forward over the same prompt, all in one run on the same
model (the vs_vllm shape: 4 layers, hidden 512, GQA, fp32).

    python benchmarks/long_prompt.py                       # 2,374-token prompt
    python benchmarks/long_prompt.py --baseline-src DIR    # also a server from another tree (before a change)

Each measurement repeats ``--repeats`` times with a prompt of its own (no
prefix-cache hits) and the median is reported. The server gets token ids on
``/v1/completions``, streamed, ``max_tokens=1``: TTFT is the time from sending
the request to the first streamed token. Nothing else of this benchmark runs
while a server is timed (the in-process engines sit idle).

This process sets OpenMP's waiting before torch loads as ``fluidserve serve``
does (``serve/cli.py``, ``set_openmp_waiting``), so the in-process paths and the
server compute alike and the difference is what the server path adds; the
baseline server runs with its own tree's setting.

Writes JSON + markdown to ``benchmarks/results/long_prompt.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Before torch loads OpenMP (see the module docstring).
from fluidserve.serve.cli import set_openmp_waiting  # noqa: E402 - loads no torch

set_openmp_waiting()

import httpx  # noqa: E402
import torch  # noqa: E402
from serve_bench import bc_free_port, launch, stop_server  # noqa: E402
from vs_vllm import RESULTS, SHAPE, build_model, device_record  # noqa: E402


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    vocab = SHAPE["vocab_size"]
    return [torch.randint(vocab // 4, vocab, (length,), generator=g).tolist() for _ in range(n)]


def time_transformers(model_dir: Path, batch: list[list[int]]) -> list[float]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        model(torch.tensor([batch[0][:64]]))  # warm-up
        for ids in batch:
            t0 = time.perf_counter()
            model(torch.tensor([ids]), use_cache=False)
            out.append(time.perf_counter() - t0)
    return out


def time_llm(model_dir: Path, batch: list[list[int]]) -> list[float]:
    from fluidserve.engine import LLM, SamplingParams

    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", max_model_len=SHAPE["max_position_embeddings"])
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([[300] * 8], params)  # warm-up
    out = []
    for ids in batch:
        t0 = time.perf_counter()
        llm.generate([ids], params)
        out.append(time.perf_counter() - t0)
    del llm
    return out


def time_server(model_dir: Path, batch: list[list[int]], env: dict, log: Path) -> list[float]:
    port = bc_free_port()
    cmd = [sys.executable, "-m", "fluidserve.serve.cli", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--device", "cpu", "--dtype", "float32", "--log-level", "warning",
           "--max-model-len", str(SHAPE["max_position_embeddings"])]
    proc = launch(cmd, f"http://127.0.0.1:{port}/v1/models", env, log, 300, "fluidserve server", cwd=str(Path.cwd()))
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        name = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        out = []
        with httpx.Client(timeout=120) as client:
            for i, ids in enumerate([[300] * 8] + batch):  # the first is a warm-up
                body = {"model": name, "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True}
                t0 = time.perf_counter()
                with client.stream("POST", url, json=body) as resp:
                    resp.raise_for_status()
                    for line in resp.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"]:
                            break
                ttft = time.perf_counter() - t0
                if i:
                    out.append(ttft)
        return out
    finally:
        stop_server(proc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=2374)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline-src", type=Path, default=None, help="also a server importing fluidserve from here")
    ap.add_argument("--tag", default="")
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    record: dict = {"benchmark": "long prompt TTFT", "command": " ".join(map(shlex.quote, sys.argv)),
                    "device": device_record(), "load_average_start": os.getloadavg(), "model_shape": SHAPE,
                    "prompt_len": args.prompt_len, "repeats": args.repeats, "note": args.note, "seconds": {}}
    times = record["seconds"]
    log = RESULTS / "long_prompt-servers.log"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model")
        all_prompts = prompts(args.repeats * 4, args.prompt_len, 0)

        def take() -> list[list[int]]:  # fresh prompts for each path: no prefix-cache hits
            nonlocal all_prompts
            head, all_prompts = all_prompts[: args.repeats], all_prompts[args.repeats:]
            return head

        times["transformers forward"] = time_transformers(model_dir, take())
        times["LLM.generate(max_tokens=1)"] = time_llm(model_dir, take())
        times["fluidserve serve"] = time_server(model_dir, take(), {}, log)
        if args.baseline_src:
            root = Path(tmp) / "baseline_path"
            root.mkdir()
            (root / "fluidserve").symlink_to(args.baseline_src.resolve(), target_is_directory=True)
            saved = {k: os.environ.pop(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
            try:  # the baseline tree's server sets OpenMP's waiting as it does
                times["fluidserve serve (baseline tree)"] = time_server(model_dir, take(), {"PYTHONPATH": str(root)},
                                                                        log)
            finally:
                os.environ.update(saved)
            record["baseline_src"] = str(args.baseline_src)
    record["load_average_end"] = os.getloadavg()
    med = {k: statistics.median(v) for k, v in times.items()}
    ref_hf, ref_llm = med["transformers forward"], med["LLM.generate(max_tokens=1)"]
    lines = [f"# A lone {args.prompt_len}-token prompt: TTFT (median of {args.repeats}, seconds)", "",
             f"Command: `{record['command']}`", "",
             f"Load average (1 min) at the start {record['load_average_start'][0]:.2f}, at the end "
             f"{record['load_average_end'][0]:.2f}; {os.cpu_count()} cores.", ""]
    if args.note:
        lines += [args.note, ""]
    lines += ["| path | median s | runs | / transformers forward | / LLM.generate |", "|---|---:|---|---:|---:|"]
    for k, v in times.items():
        lines.append(f"| {k} | {med[k]:.3f} | {', '.join(f'{x:.2f}' for x in v)} | {med[k] / ref_hf:.2f} | "
                     f"{med[k] / ref_llm:.2f} |")
    record["median_s"] = med
    stem = RESULTS / f"long_prompt{args.tag}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
