"""What one eager decode step costs in operations, not seconds: per decoder
layer and for the rest of the step (metadata, embedding, rope tables, final
norm, LM head, sampling), the torch ops dispatched, the kernels they would
launch on a GPU, the Triton launches and the host syncs. Counted on a
Llama-shaped model (GQA) at batch 1 and 8, on the Triton lane
(``FLUIDSERVE_KERNELS=triton``: the GPU's plan and launches, kernels run by
Triton's interpreter) and on the CPU kernels' lane, plus a timing of the
eager decode step on the CPU lane.

    python benchmarks/op_counts.py                          # this tree
    git archive <commit> | tar -x -C /tmp/base
    python benchmarks/op_counts.py --baseline-tree /tmp/base  # and that tree, in the same run
    python benchmarks/op_counts.py --lanes cuda --dtype bfloat16 --repeats 0   # on a GPU

With ``--baseline-tree`` every measurement also runs against that checkout
(in a subprocess importing it as ``fluidserve``), the timings alternating
between the two trees, so the before/after ratio comes from one run.

What counts:
* **ops**: every aten op a ``TorchDispatchMode`` sees, views included;
* **kernels**: the ops that run a kernel on a GPU (not views, aliases or
  allocations), plus every Triton launch;
* **syncs**: host reads of device data (``.item()``, ``.tolist()``,
  ``.numpy()``, ``bool(t)``, device-to-host ``.to``/``.cpu()``), counted
  when the tensor read is device-resident (a parameter, a KV cache, or made
  by an op of the step), and host waits (``synchronize`` of the runtime, an
  event, a stream, or ``torch.cuda.synchronize``).

The metadata region is the model runner's ``prepare`` (host lists into the
step's buffers, attention plans). On the CPU its device buffer is its host
buffer, so the step's input tensors count as device-resident from the moment
``prepare`` returns them: a read of them in the forward is a sync, while the
CPU kernels' plan, built inside ``prepare`` from those buffers, reads host
memory (those kernels only run on a CPU).
``--host-timing`` adds a timing of the Triton lane's decode step with every
launch stubbed: the host work the GPU path pays around its kernels (its
Python, checks, argument building and torch ops), beside Triton's own launch
cost, which only a GPU can time (``profile_decode.py``); at 8 and at 32
layers, whose difference is the host work of one decoder layer.

Writes benchmarks/results/op_counts.json and .md (op_counts-<gpu>.* with
``--lanes cuda``; ``--tag T`` appends ``-T``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PACKAGE_DIRS = ("engine", "kernels", "scheduler", "kvcache", "serve")

# Llama-3-8B's attention structure (32 query heads over 8 KV heads, 128 per
# head) at a width two CPU cores run; op counts do not depend on the width.
SHAPE = dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=4, num_attention_heads=32,
             num_key_value_heads=8, head_dim=128, vocab_size=32000, max_position_embeddings=4096,
             rope_theta=500000.0)
# The timed models: one whose decode step is nearly all per-op host work
# (what fusing removes; on a GPU, launches), and one whose GEMMs weigh more.
TIMING_SHAPES = {
    "overhead-bound": dict(SHAPE, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1024),
    "cpu-small-gqa": dict(SHAPE, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=64),
}
# The host lane's models: the overhead-bound one at two depths, so that the
# difference, per layer, is what a decoder layer costs the host.
HOST_SHAPES = {"overhead-bound": TIMING_SHAPES["overhead-bound"],
               "overhead-bound, 32 layers": dict(TIMING_SHAPES["overhead-bound"], num_hidden_layers=32)}
CONTEXT = 48  # tokens of each sequence before the counted decode step
BLOCK_SIZE = 16

# Ops that launch nothing on a GPU: allocations and host-side bookkeeping.
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
             "detach_", "alias", "resolve_conj", "resolve_neg", "item", "_local_scalar_dense", "is_nonzero", "set_"}
# Ops that read a device tensor's value on the host.
READS = {"item", "_local_scalar_dense", "is_nonzero", "equal", "allclose"}


@dataclass
class Tally:
    ops: int = 0
    kernels: int = 0
    triton: int = 0
    syncs: int = 0
    waits: int = 0
    names: collections.Counter = field(default_factory=collections.Counter)
    sync_sites: collections.Counter = field(default_factory=collections.Counter)

    def record(self) -> dict:
        return {"ops": self.ops, "kernels": self.kernels, "triton": self.triton, "syncs": self.syncs,
                "waits": self.waits, "names": dict(self.names.most_common()),
                "sync_sites": dict(self.sync_sites.most_common())}


def _op_name(func) -> str:
    return func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)


def _aliases(name: str, inputs: list, out) -> bool:
    """Whether an op only made views of its first input (a view, or a
    ``.to``/``.contiguous`` that had nothing to do): no kernel. Ops marked as
    views that copy (``reshape`` of a strided tensor, ``.float()``) do launch."""
    import torch
    from torch.utils._pytree import tree_flatten

    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    if not inputs or not outs or name.endswith("_"):  # in-place ops return their input, having run
        return False
    base = inputs[0].untyped_storage().data_ptr()
    return all(o is inputs[0] or o.untyped_storage().data_ptr() == base for o in outs)


def _caller() -> str:
    """file:line of the innermost frame of the package that led here."""
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if any(part in PACKAGE_DIRS for part in path.parts[-3:-1]) and "site-packages" not in path.parts:
            return f"{path.parent.name}/{path.name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class OpCounter:
    """Counts ops, launches and syncs by region while active (``counting``).
    Regions are set by the caller (``region``) or by module hooks."""

    def __init__(self) -> None:
        self.tallies: dict[str, Tally] = collections.defaultdict(Tally)
        self.region = "other"
        self.depth = 0  # inside a Triton launch: the interpreter's own copies are not the model's
        self._device: dict[int, weakref.ref] = {}  # id -> the tensor (tensors compare by value)

    # -- what is device-resident ----------------------------------------------
    def mark_device(self, *tensors) -> None:
        import torch

        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t)

    def _add(self, t) -> None:
        self._device[id(t)] = weakref.ref(t)

    def _has(self, t) -> bool:
        ref = self._device.get(id(t))
        return ref is not None and ref() is t

    def on_device(self, t) -> bool:
        import torch

        if not isinstance(t, torch.Tensor):
            return False
        if t.device.type != "cpu":
            return True
        return self._has(t) or (t._base is not None and self._has(t._base))

    # -- events ---------------------------------------------------------------
    def tally(self) -> Tally:
        return self.tallies[self.region]

    def op(self, func, args, kwargs, out) -> None:
        import torch
        from torch.utils._pytree import tree_flatten

        name = _op_name(func)
        t = self.tally()
        t.ops += 1
        inputs = [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
        if name not in NO_KERNEL and not _aliases(name, inputs, out):
            t.kernels += 1
            t.names[name] += 1
        if name in READS and inputs and self.on_device(inputs[0]):
            self.sync(name)
        # An op's output lives where its inputs do; a factory op's where it
        # is told to (``device=``), else on the host (``torch.tensor(list)``).
        if any(self.on_device(a) for a in inputs) if inputs else kwargs.get("device") is not None:
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    self._add(o)

    def copy_to_host(self, func, args, kwargs) -> None:
        import torch

        device = kwargs.get("device")
        if device is None or torch.device(device).type != "cpu" or not args:
            return
        if self.on_device(args[0]) and (args[0].device.type != "cpu" or _op_name(func) == "to"):
            self.sync("non_blocking copy to host" if kwargs.get("non_blocking") else "copy to host")

    def sync(self, what: str) -> None:
        t = self.tally()
        t.syncs += 1
        t.sync_sites[f"{what} @ {_caller()}"] += 1

    def wait(self, what: str) -> None:
        t = self.tally()
        t.waits += 1
        t.sync_sites[f"{what} (wait) @ {_caller()}"] += 1

    def launch(self, name: str) -> None:
        t = self.tally()
        t.triton += 1
        t.kernels += 1
        t.names[f"triton:{name}"] += 1

    @contextmanager
    def in_region(self, name: str):
        before, self.region = self.region, name
        try:
            yield
        finally:
            self.region = before


def _patch(obj, attr: str, make):
    """Replace ``obj.attr`` with ``make(original)``; returns the undo."""
    had = attr in vars(obj)
    original = getattr(obj, attr)
    setattr(obj, attr, make(original))

    def undo():
        if had:
            setattr(obj, attr, original)
        else:
            delattr(obj, attr)

    return undo


@contextmanager
def counting(counter: OpCounter):
    """Counts every op, Triton launch, host read and host wait of the
    enclosed code into ``counter``."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if counter.depth:
                return func(*args, **kwargs)
            counter.copy_to_host(func, args, kwargs)
            out = func(*args, **kwargs)
            counter.op(func, args, kwargs, out)
            return out

    def reader(what):
        def make(original):
            def read(t, *a, **k):
                if not counter.depth and counter.on_device(t):
                    counter.sync(what)
                return original(t, *a, **k)
            return read
        return make

    def waiter(what):
        def make(original):
            def wait(*a, **k):
                counter.wait(what)
                return original(*a, **k)
            return wait
        return make

    def launcher(original):
        def run(fn, *a, **k):
            if k.get("warmup"):
                return original(fn, *a, **k)
            counter.launch(getattr(fn, "__name__", "kernel").lstrip("_"))
            counter.depth += 1
            try:
                return original(fn, *a, **k)
            finally:
                counter.depth -= 1
        return run

    from fluidserve.engine import runtime

    undo = [_patch(torch.Tensor, "tolist", reader("tolist")), _patch(torch.Tensor, "numpy", reader("numpy")),
            _patch(runtime.DeviceRuntime, "synchronize", waiter("runtime.synchronize")),
            _patch(runtime._DoneEvent, "synchronize", waiter("event.synchronize")),
            _patch(torch.cuda, "synchronize", waiter("torch.cuda.synchronize")),
            _patch(torch.cuda.Event, "synchronize", waiter("event.synchronize")),
            _patch(torch.cuda.Stream, "synchronize", waiter("stream.synchronize"))]
    if "triton" in sys.modules or os.environ.get("FLUIDSERVE_KERNELS") == "triton":
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        from fluidserve.kernels import launch

        # Relaunching skips JITFunction.run, where launches are counted; it
        # launches the same kernels, so counting takes Triton's path.
        was_on = launch.set_enabled(False)
        undo += [_patch(InterpretedFunction, "run", launcher), _patch(JITFunction, "run", launcher),
                 lambda: launch.set_enabled(was_on)]
    try:
        with Mode():
            yield counter
    finally:
        for u in reversed(undo):
            u()


# -- the model and its decode step ---------------------------------------------


# The families --arch counts: a Llama, and a Qwen3 (q and k RMS-normed per head before rope).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def build_model_dir(root: Path, shape: dict, arch: str = "llama") -> Path:
    from fluidserve.engine.tiny_model import save_byte_tokenizer, tiny_config

    config = tiny_config(arch, **shape)
    config.architectures = [ARCHITECTURES[arch]]
    config.save_pretrained(root)
    save_byte_tokenizer(root)
    return root


def make_worker(model_dir: Path, dtype: str, batch: int, device: str = "cpu", **settings):
    """A worker over ``model_dir`` (random weights unless ``settings`` say
    otherwise: ``load_format="auto"`` reads a checkpoint) with room for
    ``batch`` sequences of CONTEXT tokens."""
    from fluidserve.engine.config import EngineConfig
    from fluidserve.engine.worker import Worker

    blocks = batch * (-(-(CONTEXT + 1) // BLOCK_SIZE)) + 1
    config = EngineConfig.create(model=str(model_dir), device=device, dtype=dtype, num_kv_blocks=blocks,
                                 block_size=BLOCK_SIZE, max_model_len=CONTEXT + 16,
                                 **{"load_format": "dummy", **settings})  # fmt: skip
    worker = Worker(config, str(model_dir))
    worker.init_cache(blocks)
    return worker


def decode_inputs(batch: int):
    """(prefill, decode) ModelInputs: ``batch`` sequences of CONTEXT tokens
    on reversed block tables (block 0 left for nothing), then one token each."""
    from fluidserve.engine import SamplingParams
    from fluidserve.engine.batch import ModelInput, SampleSpec

    per_seq = -(-(CONTEXT + 1) // BLOCK_SIZE)
    blocks = list(range(batch * per_seq, 0, -1))
    tables = [blocks[i * per_seq:(i + 1) * per_seq] for i in range(batch)]

    def slot(s: int, p: int) -> int:
        return tables[s][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE

    greedy = [SampleSpec(SamplingParams(temperature=0.0), seed=None) for _ in range(batch)]
    ids = [f"r{s}" for s in range(batch)]
    prefill = ModelInput(
        input_ids=[(7 * s + p) % 250 for s in range(batch) for p in range(CONTEXT)],
        positions=[p for _ in range(batch) for p in range(CONTEXT)],
        slot_mapping=[slot(s, p) for s in range(batch) for p in range(CONTEXT)],
        query_start_loc=[CONTEXT * s for s in range(batch + 1)], seq_lens=[CONTEXT] * batch,
        block_tables=tables, sample_indices=[CONTEXT * (s + 1) - 1 for s in range(batch)], samples=greedy,
        sample_ids=ids,
    )
    decode = ModelInput(
        input_ids=[(3 * s + 1) % 250 for s in range(batch)], positions=[CONTEXT] * batch,
        slot_mapping=[slot(s, CONTEXT) for s in range(batch)], query_start_loc=list(range(batch + 1)),
        seq_lens=[CONTEXT + 1] * batch, block_tables=tables, sample_indices=list(range(batch)), samples=greedy,
        sample_ids=ids,
    )
    return prefill, decode


@contextmanager
def regions(counter: OpCounter, worker):
    """Attribute ops to the parts of a step: module hooks on the model's
    parts, and the runner's ``prepare`` and the sampler wrapped."""
    import fluidserve.engine.worker as worker_module

    model = worker.model.model
    parts = {"embedding": model.embed_tokens, "rope tables": model.rotary, "final norm": model.norm,
             "lm head": worker.model.lm_head}
    parts.update({f"layer {i}": layer for i, layer in enumerate(model.layers)})
    handles = []
    for name, module in parts.items():
        stack = []

        def pre(_m, _a, name=name, stack=stack):
            stack.append(counter.region)
            counter.region = name

        def post(_m, _a, _o, stack=stack):
            counter.region = stack.pop()

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    runner, sample = worker.runner, worker_module.sample

    def prepare(*a, **k):
        with counter.in_region("metadata"):
            input_ids, positions, meta, sample_idx = type(runner).prepare(runner, *a, **k)
        # The step's inputs sit in device memory from here on (on the CPU the
        # runner's host buffer is its device buffer, so they are marked here).
        counter.mark_device(input_ids, positions, sample_idx, meta.slot_mapping, meta.block_tables,
                            meta.seq_lens, meta.query_start_loc)
        for plan in meta._plans.values():  # the work plans travel in the same upload
            while plan is not None:
                counter.mark_device(plan.work, plan.unit_offsets, plan.merge_tokens, plan.merge_num_splits)
                plan = plan.decode_part
        return input_ids, positions, meta, sample_idx

    def sampling(*a, **k):
        with counter.in_region("sampling"):
            return sample(*a, **k)

    runner.prepare = prepare
    worker_module.sample = sampling
    try:
        yield
    finally:
        del runner.prepare
        worker_module.sample = sample
        for h in handles:
            h.remove()


def _succeeded(result):
    """A step's result, raising if the step failed: the worker would serve
    on, but a measurement of a failed step measures the wrong thing."""
    # getattr: a baseline tree's StepResult may predate these fields.
    failure = getattr(result, "failed", None) or getattr(result, "failed_rows", None)
    if failure:
        raise RuntimeError(f"the measured step failed: {failure}")
    return result


def count_step(model_dir: Path, dtype: str, batch: int, device: str = "cpu", **settings) -> dict:
    """Op counts of one decode step (after a prefill and one uncounted
    decode); ``settings``: the engine's, as ``make_worker`` takes them."""
    import torch

    worker = make_worker(model_dir, dtype, batch, device, **settings)
    prefill, decode = decode_inputs(batch)
    _succeeded(worker.execute(prefill))
    _succeeded(worker.execute(decode))  # first-use work (plans' caches, Triton's rewrite) stays out of the count
    counter = OpCounter()
    counter.mark_device(*worker.model.parameters(), *worker.model.buffers(),
                        *(t for kv in worker.kv_caches for t in kv))
    with torch.inference_mode(), regions(counter, worker), counting(counter):
        result = worker.execute(decode)
    assert len(_succeeded(result).sampled) == batch
    return {name: t.record() for name, t in counter.tallies.items()}


def time_step(model_dir: Path, dtype: str, batch: int, rounds: int,
              stub_launches: bool = False, **settings) -> dict[str, list[float]]:
    """Wall and process-CPU seconds of each of ``rounds`` eager decode steps
    (``Worker.execute``); CPU time is the less disturbed by other processes.
    ``stub_launches`` (the Triton lane): every Triton launch returns at once,
    so what is timed is the host work around the kernels (the step's Python,
    its checks and argument building, the torch ops), which a GPU pays on
    top of Triton's own launch cost. ``settings``: the engine's, as
    ``make_worker`` takes them."""
    if stub_launches:
        from triton.runtime.interpreter import InterpretedFunction

        _patch(InterpretedFunction, "run", lambda original: lambda *a, **k: None)
    worker = make_worker(model_dir, dtype, batch, **settings)
    prefill, decode = decode_inputs(batch)
    _succeeded(worker.execute(prefill))
    for _ in range(3):
        _succeeded(worker.execute(decode))
    wall, cpu = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        result = worker.execute(decode)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        _succeeded(result)
    return {"wall": wall, "cpu": cpu}


# -- one tree's measurements, in this process or a subprocess ---------------------------------


def measure(job: dict) -> dict:
    """Run one job: {"kind": "count", lane, dtype, batch} or {"kind": "time", shape, dtype, batch, rounds,
    threads}; the lane ``cuda`` counts on the GPU."""
    with tempfile.TemporaryDirectory() as tmp:
        shape = SHAPE if job["kind"] == "count" else {**TIMING_SHAPES, **HOST_SHAPES}[job["shape"]]
        model_dir = build_model_dir(Path(tmp), shape, job.get("arch", "llama"))
        if job["kind"] == "count":
            return count_step(model_dir, job["dtype"], job["batch"], "cuda" if job["lane"] == "cuda" else "cpu")
        import torch

        torch.set_num_threads(job["threads"])
        return time_step(model_dir, job["dtype"], job["batch"], job["rounds"], stub_launches=job["lane"] == "triton")


def run_job(job: dict, tree: Path | None) -> dict:
    """``measure(job)`` in a fresh process importing ``tree`` (None: this
    checkout) as ``fluidserve``, on the job's kernel lane."""
    env = dict(os.environ)
    env.pop("FLUIDSERVE_KERNELS", None)
    env.pop("TRITON_INTERPRET", None)
    if job.get("lane") == "triton":
        env.update(FLUIDSERVE_KERNELS="triton", TRITON_INTERPRET="1")
    with tempfile.TemporaryDirectory() as shim:
        if tree is not None:
            pkg = Path(shim) / "fluidserve"
            pkg.mkdir()
            for d in PACKAGE_DIRS:
                (pkg / d).symlink_to(Path(tree).resolve() / d)
            env["PYTHONPATH"] = os.pathsep.join([shim, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        done = subprocess.run([sys.executable, __file__, "--job", json.dumps(job)], env=env,
                              capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"job {job} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the report ----------------------------------------------------------------------


CLOCKS = ("wall", "cpu")
OUTSIDE = ("metadata", "embedding", "rope tables", "final norm", "lm head", "sampling", "other")
FIELDS = ("ops", "kernels", "triton", "syncs", "waits")


def summarise(counts: dict) -> dict:
    """Per layer (the last one: the first also sets up the step's shared
    scratch), each outside part, and step totals."""
    layers = sorted((k for k in counts if k.startswith("layer ")), key=lambda k: int(k.split()[1]))
    per_layer = {f: counts[layers[-1]][f] for f in FIELDS}
    outside = {k: {f: counts[k][f] for f in FIELDS} for k in OUTSIDE if k in counts}
    total = {f: sum(c[f] for c in counts.values()) for f in FIELDS}
    return {"layers": len(layers), "per_layer": per_layer, "first_layer": {f: counts[layers[0]][f] for f in FIELDS},
            "kernels_equal_across_layers": len({counts[k]["kernels"] for k in layers}) == 1,
            "per_layer_kernels": counts[layers[-1]]["names"], "outside": outside, "total": total,
            "sync_sites": {k: c["sync_sites"] for k, c in counts.items() if c["sync_sites"]}}


def git_label() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *PACKAGE_DIRS], cwd=ROOT, capture_output=True,
                           text=True)
    return head.stdout.strip() + (" with working-tree changes" if dirty.stdout.strip() else "")


def render(record: dict) -> str:
    trees = list(record["trees"])
    named = "; ".join(f"**{t}** = {record['trees'][t]}" for t in trees)
    if not record["lanes"]:  # timings alone
        return "\n".join(["# Eager decode step: host time", "", f"Trees: {named}; model family {record['arch']}.", "",
                          *render_timing(record["timing"], trees, record["batches"])])
    family = {"qwen3": "Qwen3 (q and k normed per head)"}.get(record.get("arch", "llama"), "Llama")
    lines = ["# Eager decode step: ops, kernels and syncs", "",
             f"{family}-shaped model ({SHAPE['num_hidden_layers']} layers, hidden {SHAPE['hidden_size']}, "
             f"{SHAPE['num_attention_heads']} query / {SHAPE['num_key_value_heads']} KV heads of "
             f"{SHAPE['head_dim']}), {CONTEXT}-token contexts, dtype {record['dtype']}. Trees: {named}.", "",
             "**kernels** = ops that launch a GPU kernel (no views, aliases, allocations) + Triton launches; "
             "**syncs** = host reads of device data; **waits** = host waits on the device. "
             "`_linear_pointwise` is oneDNN's linear standing in for a GEMM (one `mm` launch on a GPU). "
             "On the cpu lane the device is the CPU, so its syncs are host reads of host memory.", ""]
    batch = str(record["batches"][-1])
    for lane in record["lanes"]:
        per = [record["counts"][t][lane][batch] for t in trees]
        lines.append(f"- {lane} lane, batch {batch}: kernels per layer "
                     + " -> ".join(str(p["per_layer"]["kernels"]) for p in per) + ", per step "
                     + " -> ".join(str(p["total"]["kernels"]) for p in per) + "; syncs inside the layers "
                     + " -> ".join(str(p["per_layer"]["syncs"] + p["per_layer"]["waits"]) for p in per)
                     + ", per step " + " -> ".join(str(p["total"]["syncs"] + p["total"]["waits"]) for p in per))
    lines.append("")
    for lane in record["lanes"]:
        lines += [f"## {lane} lane", "", "| tree | batch | per layer: ops / kernels / triton / syncs | "
                  "outside the layers: ops / kernels / triton / syncs / waits | whole step: kernels / syncs |",
                  "|---|---|---|---|---|"]
        for batch in record["batches"]:
            for tree in trees:
                s = record["counts"][tree][lane][str(batch)]
                p, o = s["per_layer"], s["outside"]
                out = {f: sum(v[f] for v in o.values()) for f in FIELDS}
                lines.append(f"| {tree} | {batch} | {p['ops']} / {p['kernels']} / {p['triton']} / {p['syncs']} | "
                             f"{out['ops']} / {out['kernels']} / {out['triton']} / {out['syncs']} / {out['waits']} | "
                             f"{s['total']['kernels']} / {s['total']['syncs']} |")
        lines.append("")
        for tree in trees:
            s = record["counts"][tree][lane][str(record["batches"][-1])]
            lines.append(f"{tree}, batch {record['batches'][-1]}, kernels of one layer: "
                         + ", ".join(f"{k} {v}" for k, v in s["per_layer_kernels"].items()))
            lines.append("")
            lines.append(f"{tree}, outside the layers (ops / kernels / syncs / waits): "
                         + "; ".join(f"{k} {v['ops']}/{v['kernels']}/{v['syncs']}/{v['waits']}"
                                     for k, v in s["outside"].items()))
            lines.append("")
            if s["sync_sites"]:
                lines.append(f"{tree}, sync sites: " + "; ".join(
                    f"{region}: " + ", ".join(f"{site} x{n}" for site, n in sites.items())
                    for region, sites in s["sync_sites"].items()))
                lines.append("")
    if record.get("timing"):
        lines += render_timing(record["timing"], trees, record["batches"])
    lines += ["vLLM's Llama layer (vllm/model_executor/models/llama.py) for comparison: fused residual-add + "
              "RMSNorm (2 per layer), QKVParallelLinear (1 GEMM), rotary in place (1), the KV write and "
              "attention (2), o_proj (1), MergedColumnParallelLinear gate/up (1), SiluAndMul (1), down_proj (1): "
              "10 kernels per layer.", ""]
    return "\n".join(lines)


def render_timing(tm: dict, trees: list[str], batches: list[int]) -> list[str]:
    lines = ["## Eager decode step time", "",
             f"`Worker.execute` of one decode step on the CPU kernels (and, where a row says so, on the Triton "
             f"lane with every launch stubbed), median over {tm['repeats']} alternating "
             f"runs per tree x {tm['rounds']} steps, {tm['device']}. Wall time, and the process's CPU time "
             "(user + system, less disturbed by other load). Models: "
             + "; ".join(f"**{name}** {s['num_hidden_layers']} layers, hidden {s['hidden_size']}, "
                         f"{s['num_attention_heads']} query / {s['num_key_value_heads']} KV heads of {s['head_dim']}, "
                         f"vocab {s['vocab_size']}" for name, s in TIMING_SHAPES.items()) + ".", "",
             "| model | batch | clock | " + " | ".join(f"{t} ms" for t in trees)
             + (" | before / after |" if len(trees) > 1 else " |"),
             "|---|---|---|" + "---|" * (len(trees) + (len(trees) > 1))]
    for shape in tm["median_ms"]:
        for batch in batches:
            for clock in CLOCKS:
                ms = [tm["median_ms"][shape][clock][t][str(batch)] for t in trees]
                spread = [run_range(tm["samples_ms"][shape][clock][t][str(batch)], tm["rounds"]) for t in trees]
                row = f"| {shape} | {batch} | {clock} | " + " | ".join(
                    f"{m:.2f} ({lo:.2f}-{hi:.2f})" for m, (lo, hi) in zip(ms, spread))
                lines.append(row + (f" | {ms[0] / ms[1]:.2f}x |" if len(trees) > 1 else " |"))
    lines += ["", "In brackets: the lowest and highest median of one run, the spread the load of the "
                  "machine puts on one figure.", ""]
    (shallow, low), (deep, high) = ((timing_key(name, "triton"), shape) for name, shape in HOST_SHAPES.items())
    if deep in tm["median_ms"]:
        layers = high["num_hidden_layers"] - low["num_hidden_layers"]
        cpu = tm["median_ms"][shallow]["cpu"], tm["median_ms"][deep]["cpu"]
        per_layer = {(t, b): 1e3 * (cpu[1][t][str(b)] - cpu[0][t][str(b)]) / layers
                     for t in trees for b in batches}
        lines += ["Host work of one decoder layer on the Triton lane (launches stubbed; the "
                  f"{high['num_hidden_layers']}-layer step less the {low['num_hidden_layers']}-layer one, over "
                  f"{layers} layers, CPU time): "
                  + "; ".join(f"{t}, batch {b}: {us:.0f} us" for (t, b), us in per_layer.items())
                  + ". Triton's own launch cost comes on top (`launch_overhead.md`). A batch of one row runs its "
                  "linears as Triton GEMVs (stubbed here); larger batches run them as torch linears, which the "
                  "CPU computes for real, so their figure holds that compute too.", ""]
    return lines


def run_range(samples: list[float], rounds: int) -> tuple[float, float]:
    medians = [statistics.median(samples[i:i + rounds]) for i in range(0, len(samples), rounds)]
    return min(medians), max(medians)


def count_all(trees: dict, args) -> dict:
    counts: dict = {name: {lane: {} for lane in args.lanes} for name in trees}
    for lane in args.lanes:
        for batch in args.batches:
            for name, tree in trees.items():
                job = {"kind": "count", "lane": lane, "dtype": args.dtype, "batch": batch, "arch": args.arch}
                counts[name][lane][str(batch)] = s = summarise(run_job(job, tree))
                print(f"{name:>9} {lane:>6} batch {batch}: per layer {s['per_layer']}, total {s['total']}",
                      flush=True)
    return counts


# The host lane: the Triton lane's eager decode step with every launch stubbed.
HOST_LANE = " (Triton lane, launches not run: the GPU path's host work)"


def timing_key(shape: str, lane: str) -> str:
    return shape + (HOST_LANE if lane == "triton" else "")


def time_all(trees: dict, args) -> dict:
    """Every tree's runs alternate, and which goes first flips each round,
    so neither a change in the machine's load nor going first or second
    (the measured bias is a few percent) falls on one tree."""
    timed = [(shape, "cpu") for shape in TIMING_SHAPES]
    if args.host_timing:
        timed += [(shape, "triton") for shape in HOST_SHAPES]
    samples = {timing_key(shape, lane): {c: {n: {str(b): [] for b in args.batches} for n in trees} for c in CLOCKS}
               for shape, lane in timed}
    for i in range(args.repeats):
        order = list(trees.items())[::-1 if i % 2 else 1]
        for shape, lane in timed:
            for batch in args.batches:
                for name, tree in order:
                    job = {"kind": "time", "lane": lane, "shape": shape, "dtype": args.dtype, "batch": batch,
                           "rounds": args.rounds, "threads": args.threads, "arch": args.arch}
                    seconds = run_job(job, tree)
                    for clock in CLOCKS:
                        samples[timing_key(shape, lane)][clock][name][str(batch)] += seconds[clock]

    def ms(f):
        return {shape: {c: {n: {b: f(v) for b, v in per.items()} for n, per in by_clock.items()}
                        for c, by_clock in by_shape.items()} for shape, by_shape in samples.items()}

    median_ms = ms(lambda v: 1e3 * statistics.median(v))
    for shape, by_clock in median_ms.items():
        print(f"{shape}: median ms {by_clock}", flush=True)
    return {"rounds": args.rounds, "repeats": args.repeats, "threads": args.threads,
            "device": f"CPU ({platform.processor() or platform.machine()}, {args.threads} torch threads)",
            "median_ms": median_ms, "samples_ms": ms(lambda v: [round(1e3 * x, 3) for x in v])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-tree", type=Path, help="a checkout of the tree to compare with (git archive)")
    ap.add_argument("--baseline-label", default=None, help="what the baseline tree is (default: its path)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--arch", default="llama", choices=sorted(ARCHITECTURES),
                    help="the model family (qwen3: q and k RMS-normed per head before rope)")
    ap.add_argument("--lanes", nargs="*", default=["triton", "cpu"], choices=["triton", "cpu", "cuda"],
                    help="cuda: count on a GPU (with --repeats 0, since the timing is the CPU lane's); none: "
                         "timings alone (a tree too old for the counter's hooks)")
    ap.add_argument("--rounds", type=int, default=15, help="timed decode steps per run")
    ap.add_argument("--repeats", type=int, default=5, help="alternating timing runs per tree (0: no timing)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the timed steps (one: a parallel region on a loaded machine waits "
                         "for its slowest thread)")
    ap.add_argument("--host-timing", action="store_true",
                    help="also time the Triton lane's decode step with its launches stubbed (the host work a GPU "
                         "pays around its kernels)")
    ap.add_argument("--tag", default="", help="suffix of the results' file name")
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        print(json.dumps(measure(json.loads(args.job))))
        return
    trees: dict[str, Path | None] = {}
    if args.baseline_tree is not None:
        trees["before"] = args.baseline_tree
    trees["after" if args.baseline_tree is not None else "this tree"] = None
    labels = {name: (args.baseline_label or str(tree)) if tree is not None else git_label()
              for name, tree in trees.items()}
    counts = count_all(trees, args)
    timing = time_all(trees, args) if args.repeats else None
    record = {"trees": labels, "arch": args.arch, "dtype": args.dtype, "batches": args.batches, "lanes": args.lanes,
              "shape": SHAPE, "timing_shapes": TIMING_SHAPES, "host_shapes": HOST_SHAPES, "context": CONTEXT,
              "counts": counts, "timing": timing}
    from dummy_models import device_name, device_slug, save_results

    stem = "op_counts" + (f"-{device_slug(device_name('cuda'))}" if "cuda" in args.lanes else "")
    stem += f"-{args.tag}" if args.tag else ""
    save_results(RESULTS / stem, record, render(record))


if __name__ == "__main__":
    main()
