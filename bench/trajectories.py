"""Benchmark: trajectory sampling throughput of ``stage=trajectories`` on the tiny verifier, side by side in one run.

Runs the real stage (``run_stage``) on the same prompts for every setting (``data.max_prompts=64``,
``data.samples_per_prompt=1``, ``data.max_new_tokens=64``, ``data.num_shards=2``, the data preset's temperature and
top-p) and measures:

  local batch 1 / 8 / 32     ``launcher=local``: one process, the verifier built once, shards in turn
  ray 1w / 2w batch 8        ``launcher=ray launcher.workers=1`` / ``2``: a local Ray started by the stage, one actor
                             per worker slot (1 CPU each), each actor builds its own verifier

It prints one table (rows, completion tokens, seconds, rows/s, tokens/s and the tok/s ratio against local batch 1;
tok/s rather than rows/s because the batch size changes the random stream and so the completion lengths), then the
Ray scaling ratio 2 workers / 1 worker, then where each setting's seconds went. Not a test: nothing is asserted.

A decoder batch never spans shards, so the batch really used is at most the rows in a shard: the default 2 shards of
32 rows make batch 32 real; with ``--shards 8`` (8 rows a shard) ``data.batch_size=32`` would decode batches of 8.
The ``eff`` column shows the batch used.

What the seconds are. ``wall`` is the whole ``run_stage`` call. ``stage`` is the stage's own ``metrics["seconds"]``:
it starts after the world lookup, tokenizer load, prompt encoding and shard checks, and covers ``_generate`` (for
``launcher=local`` that includes building the verifier in ``ShardWorker``; for Ray it includes ``ray.init``, the
actor processes starting, each actor building its verifier, and ``ray.shutdown``) plus the validation of every shard
read back. rows/s, tok/s and the ratio use ``stage``. ``gen`` is the pure sampling window, from the first shard
starting to the last shard finishing on any worker (timestamps the workers record), so ``gen tok/s`` is throughput
with every fixed cost left out; at 64 prompts the fixed costs are a large share, so look at both. The breakdown
splits ``stage`` into ``startup`` (call to first shard: Ray start + actor start + model build; local: model build),
``load`` (the longest verifier build among the workers, part of startup), ``gen``, ``tail`` (last shard to the
end of the fan-out: Ray's result collection and shutdown) and ``rest`` (validation, manifest). Ray's own overhead is
``startup - load + tail``; a bare ``ray.init() + ray.shutdown()`` in this process is timed once as well.

Threads: ``--threads`` (default 1) sets torch's intra-op threads in this process, which is where the local rows
run. Needed because on a 2-core machine with another process busy on one core, torch's default of 2 threads made
decoding about 100x slower here (2 tok/s against 190 with 1 thread, batch 1: the threads wait on each other at
every op while one of them cannot get a core). One thread also matches a Ray actor, which Ray starts with
OMP_NUM_THREADS equal to its CPU share (1); the thread counts the workers saw are printed. With ``--threads 2`` a
single process uses both cores through intra-op threads while 2 Ray workers take one core each (and 1 worker only
one), so on a 2-core machine the Ray scaling ratio says little about a cluster, where each worker owns a GPU (or a
node); with 1 thread everywhere it is at least a per-core comparison. Another process busy on a core skews every
row, Ray's 2-worker row most, so every setting runs ``--repeats`` times (default 3), interleaved (all settings,
then all again), and the table shows each setting's run with the median stage seconds.

    python bench/trajectories.py                              # CPU, about 5 minutes
    python bench/trajectories.py --shards 2                   # batch 32 really decodes 32 rows at a time
    python bench/trajectories.py --max-prompts 16 --new 32 --json out.json

Every measurement uses a fresh experiment name under ``--run-root`` (the tiny world must already be built there),
because a folder that already holds shards would skip them; those experiment folders are deleted at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import time
import uuid
from pathlib import Path

# The stage's progress bar would bury the table; tqdm reads this environment default.
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

import streakline.launch.ray_pool as ray_pool  # noqa: E402
import streakline.pipelines.trajectories as traj  # noqa: E402
from streakline.config import compose_config  # noqa: E402
from streakline.pipelines import run_stage  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TIMINGS = "bench_timings.jsonl"  # written by the workers into the measurement's own experiment folder
BASE = "local batch 1"
SETTINGS = [  # (name, launcher overrides, batch size)
    (BASE, ["launcher=local"], 1),
    ("local batch 8", ["launcher=local"], 8),
    ("local batch 32", ["launcher=local"], 32),
    ("ray 1 worker batch 8", ["launcher=ray", "launcher.workers=1"], 8),
    ("ray 2 workers batch 8", ["launcher=ray", "launcher.workers=2"], 8),
]
RAY_1, RAY_2 = SETTINGS[3][0], SETTINGS[4][0]


class TimedShardWorker(traj.ShardWorker):
    """The stage's worker, unchanged, plus wall-clock stamps of its model build and of each shard.

    The stamps go to a file rather than the return value because the stage consumes the results itself. time.time()
    rather than perf_counter() because Ray actors are other processes and the stamps must share one clock.
    """

    def __init__(self, job, work) -> None:
        t0 = time.time()
        super().__init__(job, work)
        cfg = job["cfg"]
        self._log = Path(cfg["run_root"]) / cfg["experiment"]["name"] / TIMINGS
        self._write({"event": "init", "start": t0, "end": time.time()})

    def run(self, shard: int):
        t0 = time.time()
        result = super().run(shard)
        self._write({"event": "shard", "shard": shard, "start": t0, "end": time.time(), **result})
        return result

    def _write(self, record: dict) -> None:
        record.update(pid=os.getpid(), threads=torch.get_num_threads())
        with open(self._log, "a") as f:  # one short line per write: appends from two actors do not interleave
            f.write(json.dumps(record) + "\n")


@contextlib.contextmanager
def instrumented(marks: dict, local: bool):
    """Swap in the timed worker and stamp the Ray fan-out's start and end; restored afterwards.

    ``_generate`` looks both names up at call time (module global / import inside the function), so patching the
    module attributes is enough. Under Ray the subclass goes in as ``run_on_ray``'s argument instead of through the
    module global: it is defined in ``__main__`` and shipped to the actors by value, while its base must stay
    findable by name for cloudpickle to send it by reference.
    """
    real_worker, real_fan_out = traj.ShardWorker, ray_pool.run_on_ray

    def timed_fan_out(worker_cls, *args, **kwargs):
        marks["call"] = time.time()
        try:
            return real_fan_out(TimedShardWorker, *args, **kwargs)
        finally:
            marks["return"] = time.time()

    ray_pool.run_on_ray = timed_fan_out
    if local:
        traj.ShardWorker = TimedShardWorker
    try:
        yield
    finally:
        traj.ShardWorker, ray_pool.run_on_ray = real_worker, real_fan_out


def measure(args, name: str, launcher: list[str], batch: int, experiments: list[Path]) -> dict:
    experiment = f"bench-traj-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    experiments.append(Path(args.run_root) / experiment)  # registered before the run, so a failure still cleans up
    cfg = compose_config(
        [
            "stage=trajectories",
            "model=tiny",
            f"run_root={args.run_root}",
            f"experiment.name={experiment}",
            f"data.max_prompts={args.max_prompts}",
            "data.samples_per_prompt=1",
            f"data.max_new_tokens={args.new}",
            f"data.num_shards={args.shards}",
            f"data.batch_size={batch}",
            *launcher,
        ]
    )
    marks: dict = {}
    chatter = io.StringIO()  # the stage's own prints; kept for the json, not shown
    with instrumented(marks, local="launcher=local" in launcher), contextlib.redirect_stdout(chatter):
        t0 = time.perf_counter()
        result = run_stage(cfg)
        wall = time.perf_counter() - t0
    log = experiments[-1] / TIMINGS
    events = [json.loads(line) for line in log.read_text().splitlines()]
    inits = [e for e in events if e["event"] == "init"]
    shards = [e for e in events if e["event"] == "shard"]
    m = result.metrics
    first, last = min(e["start"] for e in shards), max(e["end"] for e in shards)
    # Local runs have no fan-out call: their window opens when the worker starts building the verifier.
    call = marks.get("call", min(e["start"] for e in inits))
    done = marks.get("return", last)
    n_shards = min(args.shards, m["rows"])
    return {
        "setting": name,
        "experiment": experiment,
        "batch": batch,
        "effective_batch": min(batch, -(-m["rows"] // n_shards)),  # the largest shard's rows cap a batch
        "rows": m["rows"],
        "tokens": m["completion_tokens"],
        "wall_s": wall,
        "stage_s": m["seconds"],
        "gen_s": last - first,
        "startup_s": first - call,
        "load_s": max(e["end"] - e["start"] for e in inits),
        "tail_s": done - last,
        "rest_s": m["seconds"] - (done - call),
        "workers": len({e["pid"] for e in inits}),
        "worker_threads": sorted({e["threads"] for e in events}),
        "shards_per_worker": sorted(sum(e["pid"] == i["pid"] for e in shards) for i in inits),
        "finish_reasons": m.get("finish_reasons"),
        "stage_output": chatter.getvalue(),
    }


def median_row(runs: list[dict]) -> dict:
    """The run with the median stage time (a whole run, so its parts still add up)."""
    return sorted(runs, key=lambda r: r["stage_s"])[len(runs) // 2]


def bare_ray_start() -> float:
    import ray

    # Same arguments as run_on_ray, so this is the fixed price every Ray measurement pays twice (start, stop).
    t0 = time.perf_counter()
    ray.init(include_dashboard=False, log_to_driver=True, logging_level="WARNING")
    ray.shutdown()
    return time.perf_counter() - t0


def print_tables(rows: dict[str, dict], bare_ray: float) -> dict:
    base = rows[BASE]["tokens"] / rows[BASE]["stage_s"]
    base_gen = rows[BASE]["tokens"] / rows[BASE]["gen_s"]
    head = (
        f"{'setting':<24}{'eff':>4}{'rows':>6}{'tokens':>8}{'wall s':>8}{'stage s':>9}{'rows/s':>8}{'tok/s':>8}"
        f"{'ratio':>7}{'gen s':>8}{'gen tok/s':>10}{'gen ratio':>10}"
    )
    print(head)
    for name, r in rows.items():
        tok_s, gen_tok_s = r["tokens"] / r["stage_s"], r["tokens"] / r["gen_s"]
        r.update(rows_per_s=r["rows"] / r["stage_s"], tokens_per_s=tok_s, gen_tokens_per_s=gen_tok_s)
        r.update(ratio_vs_base=tok_s / base, gen_ratio_vs_base=gen_tok_s / base_gen)
        print(
            f"{name:<24}{r['effective_batch']:>4}{r['rows']:>6}{r['tokens']:>8}{r['wall_s']:>8.1f}{r['stage_s']:>9.1f}"
            f"{r['rows_per_s']:>8.1f}{tok_s:>8.0f}{r['ratio_vs_base']:>7.2f}{r['gen_s']:>8.1f}{gen_tok_s:>10.0f}"
            f"{r['gen_ratio_vs_base']:>10.2f}"
        )

    capped = [name for name, r in rows.items() if r["effective_batch"] < r["batch"]]
    if capped:
        print(f"  note: batches cut to the rows in a shard for {', '.join(capped)} (fewer shards: --shards)")
    scaling = {}
    if RAY_1 in rows and RAY_2 in rows:
        one, two = rows[RAY_1], rows[RAY_2]
        scaling = {
            "stage": two["tokens_per_s"] / one["tokens_per_s"],
            "gen": two["gen_tokens_per_s"] / one["gen_tokens_per_s"],
        }
        print(
            f"\nRay scaling, 2 workers / 1 worker (tok/s): {scaling['stage']:.2f} on stage seconds, "
            f"{scaling['gen']:.2f} on the sampling window alone"
        )
        if one["tokens"] != two["tokens"]:  # shard seeds do not depend on the worker count, so this should not happen
            print(f"  note: token counts differ ({one['tokens']} vs {two['tokens']}) although the shards are the same")

    print("\nwhere the stage seconds went (startup includes load; Ray overhead = startup - load + tail)")
    print(
        f"{'setting':<24}{'startup':>9}{'load':>7}{'gen':>8}{'tail':>7}{'rest':>7}{'ray ovh':>9}"
        f"{'workers':>9}{'threads':>9}{'shards':>9}"
    )
    for name, r in rows.items():
        ray_ovh = r["startup_s"] - r["load_s"] + r["tail_s"] if name.startswith("ray") else None
        r["ray_overhead_s"] = ray_ovh
        print(
            f"{name:<24}{r['startup_s']:>9.1f}{r['load_s']:>7.1f}{r['gen_s']:>8.1f}{r['tail_s']:>7.1f}"
            f"{r['rest_s']:>7.1f}{'-' if ray_ovh is None else f'{ray_ovh:.1f}':>9}{r['workers']:>9}"
            f"{','.join(map(str, r['worker_threads'])):>9}{'/'.join(map(str, r['shards_per_worker'])):>9}"
        )
    print(f"bare ray.init() + ray.shutdown() in this process: {bare_ray:.1f} s")
    return scaling


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-prompts", type=int, default=64)
    ap.add_argument("--new", type=int, default=64, help="data.max_new_tokens (eos stops earlier)")
    ap.add_argument("--shards", type=int, default=2, help="data.num_shards (2: a 32-row shard, so batch 32 is real)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the local rows (0: torch's default)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per setting, interleaved; the median is shown")
    ap.add_argument("--run-root", default=str(REPO / "runs"), help="where the tiny world is already built")
    ap.add_argument("--json", default=None, help="also write every number here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    wall = time.perf_counter()
    experiments: list[Path] = []
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in SETTINGS}
    try:
        # Warm-up, discarded: the first stage run in a process pays lazy imports and first-call allocations, which
        # would otherwise land on whichever row runs first.
        warm = argparse.Namespace(**{**vars(args), "max_prompts": 4, "new": 8, "shards": 1})
        measure(warm, "warm-up", ["launcher=local"], 4, experiments)
        bare_ray = bare_ray_start()
        print(
            f"tiny verifier, {args.max_prompts} prompts x 1 sample, max {args.new} new tokens, {args.shards} shards; "
            f"torch {torch.__version__} ({torch.get_num_threads()} threads in this process), {os.cpu_count()} cores; "
            f"{args.repeats} run(s) per setting; 1-minute load average {os.getloadavg()[0]:.1f}\n"
        )
        for _ in range(args.repeats):
            for name, launcher, batch in SETTINGS:
                runs[name].append(measure(args, name, launcher, batch, experiments))
        rows = {name: median_row(rs) for name, rs in runs.items()}
        scaling = print_tables(rows, bare_ray)
    finally:
        for folder in experiments:  # only the folders this run created
            shutil.rmtree(folder, ignore_errors=True)
    total = time.perf_counter() - wall
    # Other processes on the machine are the main noise source; the load average shows whether there were any.
    print(f"\ntotal {total:.0f} s; 1-minute load average at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            out = {"args": vars(args), "bare_ray_s": bare_ray, "scaling_2_over_1": scaling, "runs": runs}
            json.dump({**out, "wall_s": total}, f, indent=2)


if __name__ == "__main__":
    main()
