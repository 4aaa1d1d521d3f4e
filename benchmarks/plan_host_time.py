"""Host time of the attention planner and of a step's inputs per step, for
one or more source trees side by side (say this tree and a git checkout of
an older commit), each in its own process so their packages never mix.

The Triton attention kernel reads a work plan that the host builds before
every step: ``paged_attention.plan_for`` for an eager step (decode-only,
prompts, mixed), ``cuda_graphs.plan_decode`` for a decode step replayed from
a CUDA graph. Both run on the engine's thread between steps, so their time
adds to every eager step's latency and, under asynchronous scheduling, eats
into the host's lead over the device. The shapes are a Llama-3-8B layer's on
an H100/H200 (8 KV heads, group 4: 32-token prefill tiles, 4-token decode
tiles, 33 units per KV head for a launch with prefill tiles, 49 for a
decode-only one, as the engine sizes them on a 132-SM card) at the batch sizes and
contexts of ``kernel_bench.py`` and ``attention_tuning.py``, and a short mixed
step (a small prompt beside a few decodes); ``plan_for`` gives a mixed step
the plan, one launch or two, its cost model predicts faster
(``packing.predicted_us``), building the second only where its floor
leaves it a chance.

The "inputs" rows time ``ModelRunner.prepare`` of an eager step on the
Triton kernels' path: the whole host side of a step's inputs (token ids,
positions, slots, the block tables of 16-token blocks, the plan) laid out
for the device, everything but the copy itself (the CPU's buffer is its
device buffer); "graph step" rows the same for a decode step replayed from
a CUDA graph (``Bucket.write``: the bucket's inputs and its static plan).
Each call is the next step of the same rows: a sixteenth of them gained a
block since the last, as 16-token blocks fill in decode, under the table
keys the engine sends (a tree whose worker mirrors the tables copies only
those); one row sends every table under a new key each step, the mirror's
worst case. The "over Ray" rows add what the Ray executor does to a step's
input on its way to a rank: cut to what the ranks lack (a tree whose
executor sends tables' tails), pickled and unpickled (protocol 5, as Ray's
serializer does plain data), then prepared: the engine's and one rank's
host time together; at two ranks, so the input is pickled twice (Ray
serialises each call's arguments), once for rank 0 and once for rank 1 (a
tree that sends rank 0 alone the sampler rows it lacks sends rank 1 none).
Rows marked "sampled" or with a penalty carry a SampleSpec a row as the
engine keeps it, 64 outputs each, one more every step (and the prompt where
the repetition penalty counts it).

    git archive REV | tar -x -C /tmp/old
    python benchmarks/plan_host_time.py . /tmp/old --names new old

Each figure is the median thread CPU time of 200 calls (after 20; 50 after 5
for the inputs), with the heap frozen as the server freezes it
(engine/heap.py); the median of ``--rounds`` processes per tree,
interleaved. Writes benchmarks/results/plan_host_time{--tag}.{json,md}.
"""

from __future__ import annotations

import argparse

import tree_compare

_PROBE = tree_compare.TREE_PACKAGES + r'''
import dataclasses, gc, json, os, pickle, random, time
os.environ.update(FLUIDSERVE_KERNELS="triton", TRITON_INTERPRET="1")  # the runner takes the GPU's path
import torch
from fluidserve.engine import cuda_graphs
from fluidserve.engine.batch import ModelInput, SampleSpec
from fluidserve.engine.sampling_params import SamplingParams
from fluidserve.engine.layers import PagedAttention
from fluidserve.engine.model_runner import ModelRunner
from fluidserve.kernels import paged_attention

UNITS = 33  # a launch with prefill tiles: two programs per SM
DECODE_UNITS = 49  # a decode-only launch: three
# A Llama-3-8B layer's query and cache: 32 query heads over 8 KV heads of 128 (32-token prefill tiles, 4-token
# decode tiles). Empty: the planner reads their shapes only.
QUERY = torch.empty((0, 32, 128), dtype=torch.bfloat16)
KEY_CACHE = torch.empty((0, 16, 8, 128), dtype=torch.bfloat16)


def lens(chunk, decodes, lo, hi):
    rng = random.Random(0)
    head = [chunk] if chunk else []
    return head + [1] * decodes, head + [rng.randint(lo, hi) for _ in range(decodes)]


def eager(q, s):  # the engine's call before an eager step, two launches where its rule picks them
    units = DECODE_UNITS if max(q) == 1 else UNITS
    return lambda: paged_attention.plan_for(QUERY, KEY_CACHE, q, s, num_units=units, decode_units=DECODE_UNITS)


def graph(s):
    splits = cuda_graphs.max_splits_for(len(s))
    return lambda: cuda_graphs.plan_decode(s, num_units=DECODE_UNITS, max_splits=splits, sliding_window=None)


paged_attention.INTERPRETER_UNITS = UNITS  # the runner plans for an H100/H200's units too
RUNNER = ModelRunner(torch.nn.ModuleList([PagedAttention(32, 8, 128, 128 ** -0.5)]), torch.device("cpu"),
                     torch.bfloat16)
CACHES = [(KEY_CACHE, KEY_CACHE)]


KEYED = "table_keys" in ModelInput.__dataclass_fields__  # a tree whose worker mirrors the block tables
if KEYED:
    from fluidserve.engine import block_tables
    MIRROR = block_tables.BlockTableMirror()
SENDER = getattr(block_tables, "BlockTableSender", None) if KEYED else None  # a tree that sends tables' tails
# A tree whose SampleSpec still counts a row's outputs (num_output_tokens, since dropped).
COUNTED = {"num_output_tokens": 64} if "num_output_tokens" in SampleSpec.__dataclass_fields__ else {}
if os.path.exists(os.path.join(sys.argv[1], "engine", "sample_specs.py")):  # a tree that sends rank 0 the rows it lacks
    from fluidserve.engine import sample_specs as SAMPLES
else:
    SAMPLES = None
NEXT_KEY = [0]


def decode_step(q, s, fresh_keys=False, params=None):
    """A step of these lengths as the engine sends it, and a call that sends
    it again as the next step: a sixteenth of the rows (in turn) gained a
    block, as decoding 16-token blocks does; ``fresh_keys``: every table
    under a key the worker has not seen (every row new to it, the mirror's
    worst case). ``params``: every row samples with them, its SampleSpec
    as the engine keeps it (the last 64 tokens of its context its outputs,
    one more each step; the prompt beside them where a repetition penalty
    counts it)."""
    starts, blocks, tables = [0], 1, []
    for n, length in zip(q, s):
        starts.append(starts[-1] + n)
        tables.append(list(range(blocks, blocks + -(-length // 16))))
        blocks += len(tables[-1])
    t = starts[-1]
    pos = [p for n, length in zip(q, s) for p in range(length - n, length)]
    inp = ModelInput(input_ids=[7] * t, positions=pos, slot_mapping=pos, query_start_loc=starts, seq_lens=s,
                     block_tables=tables, sample_indices=[e - 1 for e in starts[1:]])
    if params is not None:
        rng = random.Random(1)
        history = params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
        inp.samples = [SampleSpec(params=dataclasses.replace(params), seed=None,
                                  prompt_token_ids=[rng.randrange(50_000) for _ in range(max(length - 64, 1))]
                                  if params.repetition_penalty != 1.0 else [],
                                  output_token_ids=[rng.randrange(50_000) for _ in range(64)] if history else [],
                                  **COUNTED) for length in s]
        inp.sample_ids = [f"llm-{i}-0" for i in range(len(s))]
    turn = [0]

    def next_step():  # a new input each step, as the engine sends
        for table in tables[turn[0] % 16::16]:
            table.append(table[-1] + 1)
        for spec in inp.samples:
            if spec.output_token_ids:
                spec.output_token_ids.append(7)
            if COUNTED:
                spec.num_output_tokens += 1
        turn[0] += 1
        step = dataclasses.replace(inp)
        if KEYED and (fresh_keys or not inp.table_keys):
            step.retired_keys, inp.table_keys = inp.table_keys, list(range(NEXT_KEY[0], NEXT_KEY[0] + len(tables)))
            step.table_keys = inp.table_keys
            NEXT_KEY[0] += len(tables)
        return step
    return next_step


def inputs(q, s, fresh_keys=False):  # the engine's eager step: ModelRunner.prepare of these lengths
    step = decode_step(q, s, fresh_keys)
    return lambda: RUNNER.prepare(step(), CACHES)


def over_ray(q, s, params=None):
    """A step through the Ray executor at two ranks: cut to what they lack,
    pickled for each (Ray serialises each call's arguments), rank 0's
    unpickled, its rows taken in, then prepared."""
    step = decode_step(q, s, params=params)
    wire = SENDER().wire if SENDER is not None else (lambda inp: inp)
    if SAMPLES is None:
        def ranks(inp):
            return inp, inp
    else:
        sender, mirror = SAMPLES.SampleSpecSender(), SAMPLES.SampleSpecMirror()

        def ranks(inp):
            return sender.wire(inp), dataclasses.replace(inp, samples=[]) if inp.samples else inp

    def call():
        first, rest = ranks(wire(step()))
        got = pickle.loads(pickle.dumps(first, protocol=5))
        pickle.dumps(rest, protocol=5)
        if SAMPLES is not None:
            mirror.sync(got)
        RUNNER.prepare(got, CACHES)
    return call


def graph_step(s):  # a graphed decode step's host side: the bucket's inputs and static plan (Bucket.write)
    size = cuda_graphs.pick_bucket(len(s), cuda_graphs.DEFAULT_CAPTURE_SIZES)
    partials = paged_attention.split_buffer_sizes(size, cuda_graphs.max_splits_for(size), 32, 128)
    spec = cuda_graphs._PlanSpec(windows=[None], num_units={None: DECODE_UNITS}, group=4, num_q_heads=32,
                                 head_dim=128, partials=tuple(torch.empty(n) for n in partials), num_kv_heads=8,
                                 merge_counts=torch.zeros(size * 8, dtype=torch.int32))
    bucket = cuda_graphs.Bucket(size, -(-max(s) // 16) + 64, 16, torch.device("cpu"), spec)  # room to grow
    step = decode_step([1] * len(s), s)
    return (lambda: bucket.write(step(), MIRROR)) if KEYED else (lambda: bucket.write(step()))


cases = {}
for b, lo, hi in [(1, 16384, 16384), (8, 4096, 4096), (64, 512, 4096), (64, 16384, 16384), (128, 16384, 16384),
                  (256, 512, 4096), (256, 512, 32768)]:
    q, s = lens(0, b, lo, hi)
    shape = f"{b} x {lo}" if lo == hi else f"{b} x {lo}-{hi}"
    cases[f"decode {shape}, eager"] = eager(q, s)
    cases[f"decode {shape}, graph"] = graph(s)
for n in (2048, 8192):
    cases[f"prompt {n}"] = eager([n], [n])
for chunk, decodes, hi in [(128, 4, 1024), (512, 16, 4096), (2048, 128, 32768), (8192, 128, 32768)]:
    cases[f"mixed {chunk} + {decodes} x 512-{hi}"] = eager(*lens(chunk, decodes, 512, hi))
for chunk, b, lo, hi in [(0, 1, 16384, 16384), (0, 64, 512, 4096), (0, 256, 512, 4096), (0, 256, 512, 32768),
                         (2048, 128, 512, 32768)]:
    shape = (f"{b} x {lo}" if lo == hi else f"{b} x {lo}-{hi}") + (f" + a {chunk}-token chunk" if chunk else "")
    cases[f"inputs: decode {shape}"] = inputs(*lens(chunk, b, lo, hi))
cases["inputs: decode 256 x 512-32768, every table new"] = inputs(*lens(0, 256, 512, 32768), fresh_keys=True)
for b, lo, hi in [(64, 512, 4096), (256, 512, 32768)]:
    cases[f"inputs over Ray: decode {b} x {lo}-{hi}"] = over_ray(*lens(0, b, lo, hi))
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=1024)
for b, lo, hi, params, what in [
        (256, 512, 4096, SAMPLED, "sampled"),
        (64, 512, 4096, dataclasses.replace(SAMPLED, repetition_penalty=1.1), "repetition penalty"),
        (256, 512, 4096, dataclasses.replace(SAMPLED, frequency_penalty=0.5), "frequency penalty"),
        (64, 16384, 16384, dataclasses.replace(SAMPLED, repetition_penalty=1.1), "repetition penalty")]:
    shape = f"{b} x {lo}" if lo == hi else f"{b} x {lo}-{hi}"
    cases[f"inputs over Ray: decode {shape}, {what}"] = over_ray(*lens(0, b, lo, hi), params=params)
for b, lo, hi in [(1, 200, 200), (1, 16384, 16384), (8, 4096, 4096), (64, 512, 4096), (64, 16384, 16384),
                  (256, 512, 4096)]:
    shape = f"{b} x {lo}" if lo == hi else f"{b} x {lo}-{hi}"
    cases[f"inputs: graph step, decode {shape}"] = graph_step(lens(0, b, lo, hi)[1])

gc.collect(); gc.freeze(); gc.set_threshold(20_000, *gc.get_threshold()[1:])
out = {}
for name, call in cases.items():
    times = []
    warm, calls = (5, 50) if name.startswith("inputs") else (20, 200)
    for k in range(warm + calls):
        t0 = time.thread_time()
        call()
        if k >= warm:
            times.append(time.thread_time() - t0)
    out[name] = sorted(times)[len(times) // 2]
print(json.dumps(out))
'''


def _describe(cmd: str, args: argparse.Namespace, result: tree_compare.Comparison) -> str:
    return (f"Command: `{cmd}`; thread CPU time, median of {args.rounds} processes per tree (each the median of "
            f"200 calls), in brackets the lowest process's (a process now and then runs 1.5-2x slower "
            f"throughout); {result.load()}. "
            "Llama-3-8B shapes on an H100/H200 (33 units per KV head with prefill tiles, 49 decode-only); eager: "
            "`paged_attention.plan_for`, "
            "graph: `cuda_graphs.plan_decode`; inputs: `ModelRunner.prepare` of an eager step on the Triton "
            "kernels' path (its plan and the block tables of 16-token blocks included; medians of 50 calls), "
            "each call the next step of the same rows, a sixteenth of them a block longer, under the engine's "
            "table keys where the tree has them (\"every table new\": under new keys each step); over Ray: the "
            "same, the input cut to what the ranks lack where the tree's executor does so, pickled for two ranks, "
            "rank 0's unpickled and taken in (the engine's and one rank's host time together; \"sampled\" or a "
            "penalty: a SampleSpec a row, 64 outputs each, the prompt where a repetition penalty counts it); "
            "graph step: `Bucket.write` of a decode step replayed from a CUDA graph (its inputs and static "
            "plan).")


def main(argv: list[str] | None = None) -> int:
    return tree_compare.main(argv, doc=__doc__, probe=_PROBE, stem="plan_host_time",
                             title="Host time of the attention planner and of the step's inputs per step",
                             describe=_describe)


if __name__ == "__main__":
    raise SystemExit(main())
