"""Benchmark: the three training-side savings of stage ``distill``, each against its plain alternative, in one run.

1. Packed windows vs one window per forward. A drafter of the ``tiny-drafter`` shape (freshly initialised: timing
   does not depend on the weights), gamma 8, W=8 windows per trajectory, on synthetic trajectories (random ids,
   prompt 64 + completion 192 tokens) cut by ``TrajectoryWindows``. Both rows run ``DraftTrainModule`` forward +
   backward of the ``streak`` loss on the same batches and the same model: once on its packed path
   (``batch.pack`` + ``hidden`` with the packed mask + gather) and once with ``module.packed = False``, the path a
   ``full``-attention drafter takes (``unpack_windows`` + ``hidden`` with ``prefix_len``, one row per window). The
   drafter is ``prefix_causal``, so both must give the same loss (docs/algorithms.md section 6); the largest difference
   is printed. Reports label tokens/s (valid labelled slots per second) and packed / per-window.
2. Label log-prob memory at vocabulary 151,936, hidden 1024, M=512 labelled slots: ``chunked_logprobs`` (chunk
   8192) vs ``naive_logprobs``, forward + backward into both the hidden states and the output matrix. "Peak extra"
   is the high-water mark of bytes held by tensors that ops create during the call: a ``TorchDispatchMode`` adds
   each new storage an op returns (views and in-place results of existing storages add nothing) and a weakref
   finaliser on the storage subtracts it when it is freed. That counts what the allocator is asked for, not what
   the process's RSS does (glibc may keep freed pages), and it works the same on CPU and CUDA. It is printed with
   and without the ``[V, H]`` output-matrix gradient, which training needs either way; on CUDA the allocator's own
   ``max_memory_allocated`` over the call is printed too. Also the median time of each. ``chunked`` is the flat
   path (backward multiplies every chunk again: a GPU's, and a CPU's past ``chunked.KEEP_CPU_BYTES``); ``kept`` is
   the path a CPU takes under that budget (backward reads forward's chunk products); ``--autocast`` runs forward
   under bf16 autocast as ``stage=distill`` does, ``--frozen-head`` freezes the output matrix as a DFlash drafter's
   is (``--vocab 49152 --hidden 576 --slots 1000``: SmolLM2's head as the study trains it).
3. ZeRO-0 vs 2 vs 3 on 2 ranks: ``stage=distill`` on the micro world (built in a temporary run_root, with its
   trajectories) through ``torch.distributed.run --nproc_per_node=2`` (gloo on CPU, fp32, streak loss, activation
   checkpointing off for all three so only the ZeRO stage differs). Step time comes from ``metrics.jsonl``: logging
   every step, the trainer's ``step_time`` is each step's own time and ``label_tokens_seen`` counts the labelled
   tokens of all ranks so far (``alignment/telemetry.py``), which give the elapsed time and the throughput at every
   step; the first ``--zero-skip`` steps (DeepSpeed's first-step setup) are left out. Wall time per launch is
   printed too, split at the last metrics line's modification time into start-up (processes, imports, DeepSpeed
   setup) and save + exit (final DeepSpeed checkpoint, export; ZeRO-3 consolidates its shards there). The micro
   drafter is tiny, so this measures ZeRO's own overheads (collectives, partitioning, gathers), not compute.

Timings in 1 and 2 are medians of interleaved repeats, so machine noise hits both sides alike; the three ZeRO
launches run one after another. Other work on the machine distorts everything here (on 2 busy cores the packed path
slowed ten-fold, the per-window one three-fold), so run it alone. The first DeepSpeed launch after another Python
environment used ``~/.cache/torch_extensions`` rebuilds DeepSpeed's ``deepspeed_shm_comm`` op (about 40 s on 2
cores), which lands in that launch's start-up column. Not a test: nothing is asserted. Temporary folders are
removed at the end.

    python bench/train.py                          # CPU; about 2 minutes on 2 quiet cores
    python bench/train.py --skip zero --json out.json
    python bench/train.py --device cuda --skip zero
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from itertools import islice
from pathlib import Path

import datasets
import torch
from _timing import timed
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from streakline.alignment import chunked
from streakline.alignment.data import TrajectoryWindows
from streakline.alignment.losses import DEFAULT_CHUNK, LossSettings, chunked_logprobs, naive_logprobs
from streakline.alignment.trainer import DraftTrainModule
from streakline.config import compose_config
from streakline.models import build

ROOT = Path(__file__).resolve().parents[1]
GAMMA, WINDOWS = 8, 8
ZERO_STAGES = [
    ("zero-0", ["trainer=cpu", "trainer.zero_stage=0"]),
    ("zero-2", ["trainer=zero2", "trainer.precision=fp32"]),
    ("zero-3", ["trainer=zero3", "trainer.precision=fp32"]),
]


# ----------------------------------------------------------------------------------------------------------------
# 1. packed vs one window per forward


def _synthetic_windows(n: int, prompt: int, completion: int, vocab: int, mask_id: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    # Ids below the mask id: a label equal to the mask id would be indistinguishable from an invalid slot's filler.
    ids = torch.randint(0, mask_id, (n, prompt + completion), generator=gen).tolist()
    dataset = datasets.Dataset.from_dict(
        {
            "prompt_id": [f"p{i}" for i in range(n)],
            "sample_index": [0] * n,
            "seed": list(range(n)),
            "finish_reason": ["length"] * n,
            "prompt_ids": [row[:prompt] for row in ids],
            "completion_ids": [row[prompt:] for row in ids],
        }
    )
    return TrajectoryWindows(dataset, gamma=GAMMA, mask_id=mask_id, windows_per_seq=WINDOWS, seed=seed)


def bench_packing(args) -> dict:
    cfg = compose_config(["model=tiny"])
    drafter = build(cfg.model.drafter, "drafter", device=args.device).train()
    if drafter.config.attention != "prefix_causal":
        raise SystemExit(f"the tiny drafter preset is {drafter.config.attention!r}; packing needs prefix_causal")
    vocab = drafter.config.vocab_size
    # A freshly built preset has no tokenizer, hence no mask token: the last id plays it.
    mask_id = drafter.config.mask_token_id if drafter.config.mask_token_id is not None else vocab - 1
    settings = LossSettings(name="streak")
    packed = DraftTrainModule(drafter, settings, mask_id=mask_id)
    # The same module on the full-attention path: one row per window, prefix_len telling the prefix_causal drafter
    # where the window starts. Same drafter object, so same weights, same kernels; only the layout differs.
    per_window = DraftTrainModule(drafter, settings, mask_id=mask_id)
    per_window.packed = False

    windows = _synthetic_windows(args.trajectories, args.prompt, args.completion, vocab, mask_id, seed=0)
    batches = list(islice(windows.batches(args.batch), args.pack_repeats + 1))

    def step(module, batch):
        drafter.zero_grad(set_to_none=True)
        loss, _ = module(batch)
        loss.backward()
        return float(loss.detach())

    step(packed, batches[0]), step(per_window, batches[0])  # warm-up
    times = {"packed": [], "per_window": []}
    tokens, max_diff = [], 0.0
    for batch in batches[1:]:
        lp, seconds = timed(lambda batch=batch: step(packed, batch), args.device)
        times["packed"].append(seconds)
        lw, seconds = timed(lambda batch=batch: step(per_window, batch), args.device)
        times["per_window"].append(seconds)
        tokens.append(int(batch.valid.sum()))
        max_diff = max(max_diff, abs(lp - lw))
    label_tokens = statistics.median(tokens)
    rate = {k: label_tokens / statistics.median(v) for k, v in times.items()}
    b = batches[1]
    S = b.clean.shape[1] + WINDOWS * GAMMA
    print(
        f"\n1. packed vs one window per forward: tiny-drafter shape ({drafter.config.num_parameters() / 1e6:.2f}M "
        f"params, V={vocab}), gamma {GAMMA}, W={WINDOWS}, {args.batch} trajectories/batch "
        f"(prompt {args.prompt} + completion {args.completion}), fwd+bwd of the streak loss, median of "
        f"{args.pack_repeats} batches"
    )
    print(
        f"   one batch: packed {args.batch} rows x {S} tokens; per-window {int(b.window_valid.sum())} rows x up to "
        f"{int(b.offsets.max()) + GAMMA} tokens; {int(label_tokens)} label tokens"
    )
    print(f"   {'path':<14}{'ms/batch':>10}{'label tok/s':>13}")
    for k, label in (("packed", "packed"), ("per_window", "per-window")):
        print(f"   {label:<14}{1e3 * statistics.median(times[k]):>10.1f}{rate[k]:>13.0f}")
    ratio = rate["packed"] / rate["per_window"]
    agree = "same loss" if max_diff <= 1e-4 else "LOSSES DIFFER"
    print(f"   packed / per-window: {ratio:.2f}x    max |loss diff| {max_diff:.2e} ({agree}, tolerance 1e-4)")
    return {
        "params": drafter.config.num_parameters(),
        "batch_trajectories": args.batch,
        "label_tokens_per_batch": label_tokens,
        "ms_per_batch": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "label_tokens_per_s": rate,
        "ratio_packed_over_per_window": ratio,
        "max_loss_diff": max_diff,
    }


# ----------------------------------------------------------------------------------------------------------------
# 2. label log-prob memory


class _LiveBytes(TorchDispatchMode):
    """Bytes held by the storages that ops create while the mode is on, as a timeline (see the module docstring).

    ``peak(excluding=...)`` is the high-water mark, leaving out the storages behind the given tensors (which must
    still be alive, e.g. a ``.grad``)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []  # (storage number, +bytes when created / -bytes when freed)
        self.alive: dict[int, int] = {}  # data pointer -> storage number, for storages created here and not freed

    def _freed(self, ptr: int, number: int, nbytes: int) -> None:
        self.alive.pop(ptr, None)
        self.events.append((number, -nbytes))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An output sharing an argument's storage (a view, an in-place op) allocated nothing new.
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in inputs or ptr in self.alive:
                continue
            number = len(self.events)
            self.alive[ptr] = number
            self.events.append((number, nbytes))
            # The storage object outlives every view of it, so its finaliser runs exactly when the memory is freed.
            weakref.finalize(storage, self._freed, ptr, number, nbytes)
        return out

    def peak(self, excluding: tuple[torch.Tensor, ...] = ()) -> int:
        skip = {self.alive.get(t.untyped_storage().data_ptr()) for t in excluding}
        live = top = 0
        for number, delta in self.events:
            if number not in skip:
                live += delta
                top = max(top, live)
        return top


def bench_logprob_memory(args) -> dict:
    M, H, V, device = args.slots, args.hidden, args.vocab, args.device
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    hidden0 = torch.randn(M, H, generator=gen).to(device, dtype)
    weight0 = (torch.randn(V, H, generator=gen) * 0.02).to(device, dtype)
    ids = torch.randint(0, V, (M, 1), generator=gen).to(device)
    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=args.autocast)

    def flat(h, w):
        # past KEEP_CPU_BYTES (and on a GPU) backward multiplies every chunk again: memory flat in V
        keep, chunked.KEEP_CPU_BYTES = chunked.KEEP_CPU_BYTES, 0
        try:
            return chunked_logprobs(h, w, ids, chunk=args.chunk)
        finally:
            chunked.KEEP_CPU_BYTES = keep

    fns = {
        "naive": lambda h, w: naive_logprobs(h, w, ids),
        "chunked": flat,
        # on a CPU, under KEEP_CPU_BYTES: backward reuses the chunk products forward made
        "kept": lambda h, w: chunked_logprobs(h, w, ids, chunk=args.chunk),
    }

    def call(fn):
        # Fresh leaves each time, so no gradient from a previous call is alive (or counted) during this one.
        h, w = hidden0.clone().requires_grad_(True), weight0.clone().requires_grad_(args.train_head)
        with autocast:
            out = fn(h, w)
        out.sum().backward()

    out = {}
    for name, fn in fns.items():
        call(fn)  # warm-up
        h, w = hidden0.clone().requires_grad_(True), weight0.clone().requires_grad_(args.train_head)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        with _LiveBytes() as mode:
            with autocast:
                result = fn(h, w)
            result.sum().backward()
        grads = (w.grad,) if w.grad is not None else ()
        out[name] = {
            "peak_mb": mode.peak() / 2**20,
            "peak_without_weight_grad_mb": mode.peak(excluding=grads) / 2**20,
        }
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            out[name]["cuda_allocator_peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        del h, w
    times = {name: [] for name in fns}
    for _ in range(args.mem_repeats):
        for name, fn in fns.items():
            times[name].append(timed(lambda fn=fn: call(fn), device)[1])
    for name in fns:
        out[name]["ms"] = 1e3 * statistics.median(times[name])

    mv = M * V * 4 / 2**20
    into = "hidden and output matrix" if args.train_head else "hidden (output matrix frozen)"
    print(
        f"\n2. label log-prob memory: V={V}, H={H}, M={M} labelled slots, {args.dtype} on {device}"
        f"{', bf16 autocast' if args.autocast else ''}, fwd+bwd into {into}; chunk {args.chunk}; one fp32 [M, V] = "
        f"{mv:.0f} MiB, [V, H] grad = {V * H * weight0.element_size() / 2**20:.0f} MiB"
    )
    cuda = device.startswith("cuda")
    head = f"   {'path':<10}{'peak extra MiB':>15}{'w/o [V,H] grad':>16}" + (f"{'allocator MiB':>14}" if cuda else "")
    print(head + f"{'ms':>9}")
    for name in fns:
        r = out[name]
        cells = f"{r['peak_mb']:>15.1f}{r['peak_without_weight_grad_mb']:>16.1f}"
        cells += f"{r['cuda_allocator_peak_mb']:>14.1f}" if cuda else ""
        print(f"   {name:<10}{cells}{r['ms']:>9.0f}")
    n, c, k = out["naive"], out["chunked"], out["kept"]
    ratios = {
        "peak": n["peak_mb"] / c["peak_mb"],
        "peak_without_weight_grad": n["peak_without_weight_grad_mb"] / max(c["peak_without_weight_grad_mb"], 1e-9),
        "time_chunked_over_naive": c["ms"] / n["ms"],
        "time_kept_over_chunked": k["ms"] / c["ms"],
    }
    print(
        f"   naive / chunked memory: {ratios['peak']:.2f}x (w/o grad {ratios['peak_without_weight_grad']:.1f}x);   "
        f"chunked / naive time: {ratios['time_chunked_over_naive']:.2f}x;   kept / chunked time: "
        f"{ratios['time_kept_over_chunked']:.2f}x"
    )
    return {"V": V, "H": H, "M": M, "dtype": args.dtype, "chunk": args.chunk, **out, "ratios": ratios}


# ----------------------------------------------------------------------------------------------------------------
# 3. ZeRO stages on 2 ranks


def _micro_overrides(root: Path, steps: int, args) -> list[str]:
    return [
        "model=micro",
        f"run_root={root}",
        "experiment.name=bench",
        f"data.max_prompts={args.zero_prompts}",
        "data.samples_per_prompt=1",
        "data.max_new_tokens=32",
        "data.num_shards=2",
        "data.batch_size=8",
        "method=streak",
        f"trainer.max_steps={steps}",
        f"trainer.micro_batch_size={args.zero_batch}",
        "trainer.windows_per_seq=4",
        "trainer.lr=1e-3",
        "trainer.warmup_steps=2",
        f"trainer.save_every={steps}",
        f"trainer.eval_every={steps}",
        "trainer.log_every=1",
        "trainer.eval_prompts=0",  # no held-out evaluation: it is not training and would add to the wall time
        "trainer.wandb_project=null",
    ]


def bench_zero(args) -> dict:
    from streakline.pipelines import run_stage

    world, steps = 2, args.zero_steps
    root = Path(tempfile.mkdtemp(prefix="bench-train-"))
    try:
        t0 = time.perf_counter()
        base = _micro_overrides(root, steps, args)
        # The stages' own reports and progress bars would bury the tables; they are shown only when a stage fails.
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                run_stage(compose_config(["stage=bootstrap", "model=micro", f"run_root={root}"]))
                run_stage(compose_config(["stage=trajectories", *base]))
        except BaseException:
            print(log.getvalue())
            raise
        setup_s = time.perf_counter() - t0
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline")
        rows = {}
        for name, extra in ZERO_STAGES:
            # Every stage trains the same steps on the same data: only the ZeRO stage (and its defaults) differ.
            over = [*base, *extra, "trainer.activation_checkpointing=false", "trainer.lr=1e-3"]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                   "launch.py", "stage=distill", *over]  # fmt: skip
            t1 = time.time()  # wall clock, to compare with file modification times
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
            t2 = time.time()
            if proc.returncode != 0:
                print(f"   {name}: torchrun failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
                rows[name] = None
                continue
            metrics = sorted(root.glob("bench/distill/*/metrics.jsonl"), key=lambda p: p.stat().st_mtime)[-1]
            lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
            rate = {x["step"]: x["label_tokens_per_s"] for x in lines if "label_tokens_per_s" in x}
            seen = {x["step"]: x["label_tokens_seen"] for x in lines if "label_tokens_seen" in x}
            # alignment/telemetry.py: with log_every=1 each record's step_time is that step's own (training only)
            step_time = {x["step"]: x["step_time"] for x in lines if "step_time" in x}
            elapsed = {n: sum(step_time[m] for m in range(1, n + 1)) for n in step_time}
            k = args.zero_skip
            step_s = (elapsed[steps] - elapsed[k]) / (steps - k)
            # The last metrics line is written right after the last step, before the final checkpoint and export:
            # its modification time splits the launch's wall time into start-up, training loop, and save + exit.
            loop_end = metrics.stat().st_mtime
            rows[name] = {
                "step_ms": 1e3 * step_s,
                "first_steps_ms": 1e3 * elapsed[k] / k,
                "label_tokens_per_s": (seen[steps] - seen[k]) / (elapsed[steps] - elapsed[k]),
                "logged_label_tokens_per_s": rate[steps],
                "final_loss": lines[-1].get("loss"),
                "wall_s": t2 - t1,
                "startup_s": loop_end - elapsed[steps] - t1,
                "save_exit_s": t2 - loop_end,
            }
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(
        f"\n3. ZeRO stages on {world} CPU ranks (gloo, fp32): micro world stage=distill, streak loss, {steps} steps, "
        f"micro-batch {args.zero_batch} x 4 windows per rank, no activation checkpointing; step time over steps "
        f"{args.zero_skip + 1}..{steps}; world + trajectories built in {setup_s:.0f} s"
    )
    print(
        f"   {'stage':<8}{'ms/step':>9}{'vs 0':>7}{'label tok/s':>13}{f'first {args.zero_skip} ms':>13}"
        f"{'wall s':>8}{'vs 0':>7}{'start s':>9}{'save+exit s':>13}{'loss':>8}"
    )
    ref = rows.get("zero-0")
    for name, r in rows.items():
        if r is None:
            print(f"   {name:<8}{'failed':>9}")
            continue
        vs = r["step_ms"] / ref["step_ms"] if ref else math.nan
        vw = r["wall_s"] / ref["wall_s"] if ref else math.nan
        print(
            f"   {name:<8}{r['step_ms']:>9.1f}{vs:>7.2f}{r['label_tokens_per_s']:>13.0f}{r['first_steps_ms']:>13.0f}"
            f"{r['wall_s']:>8.1f}{vw:>7.2f}{r['startup_s']:>9.1f}{r['save_exit_s']:>13.1f}{r['final_loss']:>8.3f}"
        )
    return {"world": world, "steps": steps, "skip": args.zero_skip, "setup_s": setup_s, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["packing", "memory", "zero"])
    ap.add_argument("--json", default=None)
    g = ap.add_argument_group("1. packing")
    g.add_argument("--batch", type=int, default=8, help="trajectories per batch (W=8 windows each)")
    g.add_argument("--trajectories", type=int, default=64)
    g.add_argument("--prompt", type=int, default=64)
    g.add_argument("--completion", type=int, default=192)
    g.add_argument("--pack-repeats", type=int, default=6, help="timed batches")
    g = ap.add_argument_group("2. label log-prob memory")
    g.add_argument("--vocab", type=int, default=151936)
    g.add_argument("--hidden", type=int, default=1024)
    g.add_argument("--slots", type=int, default=512)
    g.add_argument("--chunk", type=int, default=DEFAULT_CHUNK)
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--mem-repeats", type=int, default=3)
    g.add_argument("--autocast", action="store_true", help="forward under bf16 autocast, as stage=distill's")
    g.add_argument("--frozen-head", dest="train_head", action="store_false",
                   help="the output matrix frozen, as a DFlash drafter's (the verifier's head)")  # fmt: skip
    g = ap.add_argument_group("3. ZeRO")
    g.add_argument("--zero-steps", type=int, default=60)
    g.add_argument("--zero-skip", type=int, default=2, help="first steps left out of the step time")
    g.add_argument("--zero-batch", type=int, default=4, help="micro-batch per rank (trajectories)")
    g.add_argument("--zero-prompts", type=int, default=32)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}")
    t0 = time.perf_counter()
    result = {}
    if "packing" not in args.skip:
        result["packing"] = bench_packing(args)
    if "memory" not in args.skip:
        result["memory"] = bench_logprob_memory(args)
    if "zero" not in args.skip:
        result["zero"] = bench_zero(args)
    print(f"\n{time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
