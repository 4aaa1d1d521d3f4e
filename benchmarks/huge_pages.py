"""CPU decode with the model's weights in 2 MiB pages against 4 KiB ones,
side by side in one process: does backing the weights with huge pages pay?

A decode step on the CPU streams every weight it uses from memory; in 4 KiB
pages that is a TLB entry, and a new stream for the hardware prefetcher,
every 4 KiB. torch's allocator asks for huge pages only where
``THP_MEM_ALLOC_ENABLE`` is set before its first large allocation, and
oneDNN's reordered weights never do, so under the kernel's usual THP mode
(``madvise``) an engine's weights sit in 4 KiB pages. Here, after an engine
has loaded and packed its model, ``advise_model`` has the kernel move the
memory of every tensor its modules hold (the packed linears, the experts'
panels, the embedding; not the weights a packed linear never reads) into
huge pages in place: ``madvise(MADV_HUGEPAGE)`` and ``MADV_COLLAPSE``
(Linux 6.1) over the whole 2 MiB pages inside each.

Per model shape, four engines load the same checkpoint, built in the order
small, huge, huge, small: in one process the engine built later ran up to
8% faster with the same pages (two engines in 4 KiB pages, built in turn),
which one engine of each would count as the pages' doing. Rounds time
every engine once, in turn (the order reversed each round): greedy decode
of ``--tokens`` tokens for a batch of 1 and of ``--batch`` prompts. A way's
figure is output tokens per second over the median of its two engines'
rounds; each engine's own is recorded too. All must give the same tokens
(checked).

Shapes: ``dense`` (Llama, hidden 1024, 8 layers, MLP 2816, vocab 32000:
600 MB in float32, far past the cache), ``cpu-small`` (benchmarks/
dummy_models.py's, 150 MB) and ``qwen3-moe`` (benchmarks/models_vs_vllm.py's
Qwen3-MoE experts, 64 of 192 features, 8 a token, in 8 layers over 2 KV
heads).

    python benchmarks/huge_pages.py
    python benchmarks/huge_pages.py --models dense --dtype bfloat16 --rounds 7

Writes JSON + markdown to ``benchmarks/results/huge_pages{--tag}.{json,md}``.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import errno
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from dummy_models import PRESETS, device_name, save_results

RESULTS = Path(__file__).resolve().parent / "results"
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
_madvise = ctypes.CDLL(None, use_errno=True).madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


@dataclasses.dataclass
class Advised:
    """Bytes moved into huge pages, bytes left in small ones (the ends of
    tensors, tensors under 2 MiB, what the kernel refused), the first
    refusal's reason, the seconds it took."""

    collapsed: int = 0
    left: int = 0
    refused: str | None = None
    seconds: float = 0.0

    def summary(self) -> str:
        text = (f"{self.collapsed / 2**20:.0f} MiB of weights moved into 2 MiB pages in {self.seconds:.1f} s, "
                f"{self.left / 2**20:.0f} MiB left in small ones")
        return text + (f" ({self.refused})" if self.refused else "")


def advise(address: int, nbytes: int, done: Advised) -> None:
    """The whole 2 MiB pages in [address, address + nbytes) into huge pages."""
    start, end = -(-address // HUGE_PAGE) * HUGE_PAGE, (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        done.left += nbytes
        return
    if _madvise(start, end - start, MADV_HUGEPAGE) or _madvise(start, end - start, MADV_COLLAPSE):
        code = ctypes.get_errno()  # EINVAL: a kernel before 6.1; EAGAIN, ENOMEM: no free huge page
        done.refused = done.refused or f"madvise: {errno.errorcode.get(code, code)}, {os.strerror(code)}"
        done.left += nbytes
        return
    done.collapsed += end - start
    done.left += nbytes - (end - start)


def _tensors(value) -> list[torch.Tensor]:
    """The tensors a module attribute holds: itself, a list, tuple or
    dict's, a dataclass's fields' (cpu_moe.PackedExperts)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in _tensors(getattr(value, f.name))]
    return []


def advise_model(model: nn.Module) -> Advised:
    """Every CPU tensor a module of ``model`` holds into huge pages, each
    memory once; not the weights of a linear that runs on its packed copy
    (engine/parallel.py's ``_packed``), which a step never reads."""
    done, seen, start = Advised(), set(), time.perf_counter()
    for module in model.modules():
        unread = "_parameters" if getattr(module, "_packed", None) is not None else None
        for name, value in vars(module).items():
            for t in [] if name == unread else _tensors(value):
                if t.device.type != "cpu":
                    continue
                # a reordered oneDNN weight is opaque: no storage, its memory through mkldnn's ops
                address, nbytes = ((torch.ops.mkldnn.data_ptr(t), torch.ops.mkldnn._nbytes(t)) if t.is_mkldnn
                                   else (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
                if address not in seen and nbytes:
                    seen.add(address)
                    advise(address, nbytes, done)
    done.seconds = time.perf_counter() - start
    return done


SHAPES = {
    "dense": ("llama", dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                            num_key_value_heads=4, head_dim=64, vocab_size=32000)),
    "cpu-small": ("llama", PRESETS["cpu-small"]),
    "qwen3-moe": ("qwen3_moe", dict(hidden_size=512, intermediate_size=1536, moe_intermediate_size=192,
                                    num_experts=64, num_experts_per_tok=8, num_hidden_layers=8,
                                    num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=32000)),
}


def thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    return text[text.index("[") + 1:text.index("]")] if "[" in text else text.strip()


def engine(path: str, dtype: str, huge: bool):
    from fluidserve.engine import LLM

    llm = LLM(model=path, device="cpu", dtype=dtype, num_kv_blocks=512, max_num_seqs=64)
    return llm, advise_model(llm.engine.executor.worker.model) if huge else Advised()


def run_shape(name: str, dtype: str, rounds: int, tokens: int, batch: int, root: Path) -> list[dict]:
    from fluidserve.engine import SamplingParams
    from fluidserve.engine.tiny_model import build_tiny_model

    arch, overrides = SHAPES[name]
    path = str(build_tiny_model(root / name, arch, **overrides))
    built = [("4 KiB pages", engine(path, dtype, False)), ("2 MiB pages", engine(path, dtype, True)),
             ("2 MiB pages", engine(path, dtype, True)), ("4 KiB pages", engine(path, dtype, False))]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    rows = []
    for n in (1, batch):
        prompts = [[5 + i, 6, 7, 8 + i] for i in range(n)]
        outs = {str([o.outputs[0].token_ids for o in llm.generate(prompts, params)]) for _, (llm, _) in built}
        assert len(outs) == 1, f"{name}: the engines' tokens differ"
        times: list[list[float]] = [[] for _ in built]
        for r in range(rounds):
            for i in (range(len(built)) if r % 2 == 0 else reversed(range(len(built)))):
                start = time.perf_counter()
                built[i][1][0].generate(prompts, params)
                times[i].append(time.perf_counter() - start)
        tps = {w: n * tokens / statistics.median([t for (way, _), ts in zip(built, times) if way == w for t in ts])
               for w in ("4 KiB pages", "2 MiB pages")}
        rows.append(dict(model=name, dtype=dtype, batch=n, tokens=tokens,
                         small_tok_s=tps["4 KiB pages"], huge_tok_s=tps["2 MiB pages"],
                         speedup=tps["2 MiB pages"] / tps["4 KiB pages"],
                         engines=[dict(way=w, built=i, tok_s=n * tokens / statistics.median(ts))
                                  for i, ((w, _), ts) in enumerate(zip(built, times))],
                         advised=built[1][1][1].summary()))
        print(rows[-1], flush=True)
    for _, (llm, _) in built:
        llm.engine.shutdown()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [row for name in args.models
                for row in run_shape(name, args.dtype, args.rounds, args.tokens, args.batch, Path(tmp))]
    record = dict(benchmark="huge_pages", device=device_name("cpu"), torch=torch.__version__, thp_mode=thp_mode(),
                  command=" ".join(["python", *sys.argv]), rows=rows)
    lines = ["# CPU decode with the weights in 2 MiB pages against 4 KiB pages", "",
             f"Command: `{record['command']}`; {record['device']}; kernel THP mode `{record['thp_mode']}`. Four "
             "engines over the same checkpoint in one process, built in the order 4 KiB, 2 MiB, 2 MiB, 4 KiB; "
             "rounds time each in turn; greedy decode, output tokens per second over the median of a way's "
             "rounds (each engine's own in the last column, in the order built); all give the same tokens.", "",
             "| model | dtype | batch | 4 KiB pages tok/s | 2 MiB pages tok/s | speed-up | each engine |",
             "|---|---|---:|---:|---:|---:|---|"]
    lines += [f"| {r['model']} | {r['dtype']} | {r['batch']} | {r['small_tok_s']:.1f} | {r['huge_tok_s']:.1f} | "
              f"{r['speedup']:.2f}x | " + " / ".join(f"{e['tok_s']:.1f}" for e in r["engines"]) + " |" for r in rows]
    lines += ["", "What a huge-page engine's load did: " + "; ".join(
        f"{r['model']}: {r['advised']}" for r in rows if r["batch"] == 1)]
    save_results(RESULTS / f"huge_pages{args.tag}", record, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
