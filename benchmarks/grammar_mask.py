"""Per-token grammar mask cost: xgrammar against llguidance, side by side.

What structured output adds to every decode step is filling one next-token
bitmask per constrained request. This script measures that for both
libraries on the same work: 256 concurrent JSON-schema requests (four schemas,
64 requests each), each walking the tokens of a real instance of its schema,
so every step both libraries fill 256 masks at 256 different grammar states.
A finished request restarts on a new instance, so 256 stay in flight.

Vocabularies: byte-level BPE tokenizers trained here, offline, on Python
source from the installed packages (a 32k one and one as large as the text
allows toward 128k, Llama 3's size); nothing is downloaded. Timed separately: grammar compile, matcher
creation, the batch mask fill (the figure), and token acceptance. Every token
a request consumes is checked against the mask just filled, so a library
that filled a wrong mask is reported, not timed as fast.

    python3 benchmarks/grammar_mask.py                  # both vocabularies
    python3 benchmarks/grammar_mask.py --vocab 32000 --steps 100

Writes benchmarks/results/grammar_mask.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

RESULTS = Path(__file__).resolve().parent / "results"
CACHE = Path.home() / ".cache" / "fluidserve" / "bench-tokenizers"

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "address": {
                "type": "object",
                "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city", "zip"], "additionalProperties": False,
            },
        },
        "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "status": {"type": "string", "enum": ["pending", "paid", "shipped", "cancelled"]},
            "items": {"type": "array", "minItems": 1, "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                               "price": {"type": "number"}},
                "required": ["sku", "qty", "price"], "additionalProperties": False,
            }},
            "note": {"type": "string"},
        },
        "required": ["id", "status", "items", "note"], "additionalProperties": False,
    },
    "tool_call": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": ["get_weather", "search", "book_flight"]},
            "arguments": {"type": "object", "properties": {
                "query": {"type": "string"}, "limit": {"type": "integer"}, "exact": {"type": "boolean"}},
                "required": ["query", "limit", "exact"], "additionalProperties": False},
        },
        "required": ["name", "arguments"], "additionalProperties": False,
    },
    "event": {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "all_day": {"type": "boolean"},
            "priority": {"type": "string", "enum": ["low", "normal", "high"]},
            "attendees": {"type": "array", "items": {"type": "string"}},
            "duration_h": {"type": "number"},
        },
        "required": ["title", "all_day", "priority", "attendees", "duration_h"], "additionalProperties": False,
    },
}

WORDS = ("alpha beta gamma delta river stone cloud paper orange market north south quiet rapid "
         "silver garden window engine module tensor kernel schedule request token").split()


def _text(rng: random.Random, lo: int = 1, hi: int = 6) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def make_instance(kind: str, rng: random.Random) -> Any:
    """A random document valid against ``SCHEMAS[kind]``."""
    if kind == "person":
        return {"name": _text(rng, 2, 3).title(), "age": rng.randint(0, 150),
                "email": f"{rng.choice(WORDS)}@example.org",
                "tags": [rng.choice(WORDS) for _ in range(rng.randint(0, 5))],
                "address": {"street": f"{rng.randint(1, 999)} {_text(rng, 1, 2)}", "city": _text(rng, 1, 2),
                            "zip": f"{rng.randint(0, 99999):05d}"}}
    if kind == "order":
        return {"id": rng.randint(1, 10**6), "status": rng.choice(["pending", "paid", "shipped", "cancelled"]),
                "items": [{"sku": f"SKU-{rng.randint(100, 999)}", "qty": rng.randint(1, 9),
                           "price": round(rng.uniform(1, 500), 2)} for _ in range(rng.randint(1, 4))],
                "note": _text(rng, 3, 12)}
    if kind == "tool_call":
        return {"name": rng.choice(["get_weather", "search", "book_flight"]),
                "arguments": {"query": _text(rng, 1, 8), "limit": rng.randint(1, 50), "exact": rng.random() < 0.5}}
    return {"title": _text(rng, 2, 6), "all_day": rng.random() < 0.5, "priority": rng.choice(["low", "normal", "high"]),
            "attendees": [_text(rng, 1, 2).title() for _ in range(rng.randint(0, 6))],
            "duration_h": round(rng.uniform(0.25, 8), 2)}


# -- tokenizers -----------------------------------------------------------------


def corpus_files(limit_bytes: int) -> list[str]:
    """Python sources of the installed packages, in a fixed order, up to
    ``limit_bytes``: real text that needs no download."""
    import transformers

    roots = [Path(transformers.__file__).parent, Path(torch.__file__).parent,
             Path(transformers.__file__).parent.parent]  # then every other installed package
    files: list[str] = []
    seen: set[Path] = set()
    total = 0
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            size = path.stat().st_size
            if size < 512 or path in seen:
                continue
            seen.add(path)
            files.append(str(path))
            total += size
            if total >= limit_bytes:
                return files
    return files


def build_tokenizer(vocab_size: int, corpus_mb: int):
    """A byte-level BPE (GPT-2 style) trained on local text, saved under the
    user's cache and reloaded on later runs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = CACHE / f"bpe-{vocab_size}"
    if not (path / "tokenizer.json").exists():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|eos|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        t0 = time.perf_counter()
        tok.train(corpus_files(corpus_mb * 2**20), trainer)
        print(f"trained a {tok.get_vocab_size()}-token BPE in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>")
        fast.save_pretrained(str(path))
    return PreTrainedTokenizerFast.from_pretrained(str(path))


# -- the two libraries behind one shape ------------------------------------------


@dataclass
class Backend:
    name: str
    compile: Callable[[dict], Any]  # schema -> compiled grammar
    new_matcher: Callable[[Any], Any]
    fill: Callable[[list, torch.Tensor], None]  # matchers -> rows 0..n-1 of the bitmask
    accept: Callable[[Any, int], bool]


def xgrammar_backend(tokenizer, vocab_size: int, eos: int, threads: int) -> Backend:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
    batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def fill(matchers: list, bitmask: torch.Tensor) -> None:
        if threads > 1:
            batch.batch_fill_next_token_bitmask(matchers, bitmask)
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)

    return Backend(
        name=f"xgrammar {threads}t",
        compile=lambda schema: compiler.compile_json_schema(json.dumps(schema), any_whitespace=True),
        new_matcher=lambda compiled: xgr.GrammarMatcher(compiled),
        fill=fill,
        accept=lambda m, tok: m.accept_token(tok),
    )


def llguidance_backend(tokenizer, vocab_size: int, eos: int, threads: int) -> Backend:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    executor = llguidance.LLExecutor(num_threads=threads)

    def compile_schema(schema: dict) -> str:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        err = llguidance.LLMatcher.validate_grammar(grammar, lltok)
        if err:
            raise ValueError(err)
        return grammar

    def fill(matchers: list, bitmask: torch.Tensor) -> None:
        if threads > 1:
            lt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        else:
            for i, m in enumerate(matchers):
                lt.fill_next_token_bitmask(m, bitmask, i)

    return Backend(
        name=f"llguidance {threads}t",
        compile=compile_schema,
        new_matcher=lambda grammar: llguidance.LLMatcher(lltok, grammar),
        fill=fill,
        accept=lambda m, tok: m.consume_token(tok),
    )


# -- the measurement ------------------------------------------------------------


@dataclass
class Stream:
    kind: str
    tokens: list[int]
    pos: int = 0
    matcher: Any = None


@dataclass
class Result:
    backend: str
    vocab_size: int
    concurrency: int
    compile_ms: dict[str, float] = field(default_factory=dict)
    new_matcher_us: float = 0.0
    fill_ms_per_step: list[float] = field(default_factory=list)
    accept_ms_per_step: list[float] = field(default_factory=list)
    mask_errors: int = 0

    def summary(self) -> dict:
        fill = self.fill_ms_per_step
        return {
            "backend": self.backend, "vocab_size": self.vocab_size, "concurrency": self.concurrency,
            "steps": len(fill),
            "fill_ms_per_step_median": round(statistics.median(fill), 3),
            "fill_ms_per_step_p90": round(sorted(fill)[int(0.9 * (len(fill) - 1))], 3),
            "fill_us_per_request_token": round(1000 * statistics.median(fill) / self.concurrency, 2),
            "accept_ms_per_step_median": round(statistics.median(self.accept_ms_per_step), 3),
            "compile_ms": {k: round(v, 1) for k, v in self.compile_ms.items()},
            "new_matcher_us": round(self.new_matcher_us, 1),
            "mask_errors": self.mask_errors,
        }


def allowed(bitmask: torch.Tensor, row: int, tok: int) -> bool:
    return bool((int(bitmask[row, tok // 32]) >> (tok % 32)) & 1)


def run(backend: Backend, tokenizer, vocab_size: int, eos: int, concurrency: int, steps: int,
        seed: int) -> Result:
    res = Result(backend.name, vocab_size, concurrency)
    compiled = {}
    for kind, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        compiled[kind] = backend.compile(schema)
        res.compile_ms[kind] = 1000 * (time.perf_counter() - t0)
    rng = random.Random(seed)
    kinds = list(SCHEMAS)

    def new_stream(i: int) -> Stream:
        kind = kinds[i % len(kinds)]
        text = json.dumps(make_instance(kind, rng))
        return Stream(kind, tokenizer.encode(text, add_special_tokens=False) + [eos])

    streams = [new_stream(i) for i in range(concurrency)]
    t0 = time.perf_counter()
    for s in streams:
        s.matcher = backend.new_matcher(compiled[s.kind])
    res.new_matcher_us = 1e6 * (time.perf_counter() - t0) / concurrency
    # Stagger the starts so the batch holds requests at every depth.
    for s in streams:
        for _ in range(rng.randrange(len(s.tokens) - 1)):
            backend.accept(s.matcher, s.tokens[s.pos])
            s.pos += 1
    bitmask = torch.zeros(concurrency, (vocab_size + 31) // 32, dtype=torch.int32)
    for _ in range(steps):
        t0 = time.perf_counter()
        backend.fill([s.matcher for s in streams], bitmask)
        t1 = time.perf_counter()
        for i, s in enumerate(streams):
            tok = s.tokens[s.pos]
            if not allowed(bitmask, i, tok):
                res.mask_errors += 1
            if not backend.accept(s.matcher, tok):
                res.mask_errors += 1
            s.pos += 1
        t2 = time.perf_counter()
        res.fill_ms_per_step.append(1000 * (t1 - t0))
        res.accept_ms_per_step.append(1000 * (t2 - t1))
        for i, s in enumerate(streams):
            if s.pos == len(s.tokens):  # finished: a new request takes its place
                streams[i] = new_stream(i)
                streams[i].matcher = backend.new_matcher(compiled[streams[i].kind])
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 128000])
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                    help="worker threads for the batch fill (1: one matcher after another)")
    ap.add_argument("--corpus-mb", type=int, default=160, help="local text the BPE is trained on")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "grammar_mask"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    rows: list[dict] = []
    for vocab in args.vocab:
        tokenizer = build_tokenizer(vocab, args.corpus_mb)
        size = len(tokenizer)
        eos = tokenizer.convert_tokens_to_ids("<|eos|>")
        for threads in args.threads:
            for make in (xgrammar_backend, llguidance_backend):
                backend = make(tokenizer, size, eos, threads)
                row = run(backend, tokenizer, size, eos, args.concurrency, args.steps, args.seed).summary()
                rows.append(row)
                print(json.dumps(row), flush=True)

    # Side by side: llguidance's fill time over xgrammar's at the same vocab and threads.
    ratios = []
    for row in rows:
        if row["backend"].startswith("xgrammar"):
            other = next(r for r in rows if r["vocab_size"] == row["vocab_size"]
                         and r["backend"] == row["backend"].replace("xgrammar", "llguidance"))
            ratios.append({"vocab_size": row["vocab_size"], "threads": row["backend"].split()[-1],
                           "llguidance_over_xgrammar_fill": round(other["fill_ms_per_step_median"]
                                                                 / row["fill_ms_per_step_median"], 2)})
    import llguidance
    import xgrammar

    meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "llguidance": llguidance.get_version(),
            "xgrammar": getattr(xgrammar, "__version__", None) or _dist_version("xgrammar"),
            "concurrency": args.concurrency, "steps": args.steps, "schemas": list(SCHEMAS),
            "command": "python3 benchmarks/grammar_mask.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": rows, "ratios": ratios}, indent=2))
    out.with_suffix(".md").write_text(_markdown(meta, rows, ratios))
    print(_markdown(meta, rows, ratios))
    return 0


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _markdown(meta: dict, rows: list[dict], ratios: list[dict]) -> str:
    lines = [
        "# Grammar mask cost: xgrammar vs llguidance",
        "",
        f"{meta['concurrency']} concurrent JSON-schema requests ({', '.join(meta['schemas'])}), {meta['steps']} decode "
        f"steps; every step fills one next-token bitmask per request. CPU: {meta['cpus']} cores "
        f"({meta['machine']}); xgrammar {meta['xgrammar']}, {meta['llguidance']}.",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| library | vocab | fill ms/step (median) | p90 | µs per request-token | accept ms/step | "
        "new matcher µs | compile ms (per schema) | mask errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        compile_ms = ", ".join(f"{v:.0f}" for v in r["compile_ms"].values())
        lines.append(f"| {r['backend']} | {r['vocab_size']} | {r['fill_ms_per_step_median']} "
                     f"| {r['fill_ms_per_step_p90']} "
                     f"| {r['fill_us_per_request_token']} | {r['accept_ms_per_step_median']} | {r['new_matcher_us']} "
                     f"| {compile_ms} | {r['mask_errors']} |")
    lines += ["", "| vocab | threads | llguidance fill / xgrammar fill |", "|---|---|---|"]
    lines += [f"| {r['vocab_size']} | {r['threads']} | {r['llguidance_over_xgrammar_fill']} |" for r in ratios]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
