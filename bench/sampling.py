"""Benchmark: how fast ``stage=trajectories`` samples SmolLM2-135M-Instruct, old path against new, side by side.

Every setting samples the same prompts (the smol data preset's mix through the chat template, ``--prompts`` of
them, one completion each, ``--new`` tokens at most, the preset's temperature and top-p) through the stage's own
worker (``pipelines.trajectories.ShardWorker``: the verifier built as the stage builds it, the shard and its feature
file written), one shard, in one process:

  old         data.batching=fixed data.batch_size=16 precision=fp32: what the stage did before continuous batching
              (fixed batches of 16 through the speculative decoder, a second forward for the layer states)
  new         the defaults: data.batching=continuous, the batch from memory, precision=auto (bf16 where the CPU
              multiplies it natively: AMX or AVX512-BF16; stage=doctor says which)
  new fp32    the same at precision=fp32 (the rate on a CPU without native bf16)
  new -feat   the defaults without data.feature_layers: what the layer states cost
  hf          transformers' own ``generate`` on the same weights, prompts and sampling settings, in the precision
              and at the batch size ``new`` used (fixed batches, left padding)

With ``--features`` (default the smol DFlash drafter's ``2 10 18 26``) the stage rows store the verifier's layer
states, as ``make demo`` does. Each row prints completion tokens, seconds, tokens/s and the ratios to ``old`` and to
``hf``; then the feature overhead (new -feat / new) and, for the new path, how its seconds split (prefill, decode
steps) and how many decode row-steps ran empty. Completion lengths differ between settings (another sampling
stream), which is why the rates are tokens/s. Not a test: nothing is asserted.

    python bench/sampling.py                           # 64 prompts x 96 tokens: about 6 minutes on 2 cores
    python bench/sampling.py --prompts 128 --only new hf
    python bench/sampling.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from streakline.config import compose_config
from streakline.world.imports import attach_imports

SETTINGS = {
    "old": ["data.batching=fixed", "data.batch_size=16", "precision=fp32"],
    "new": [],
    "new fp32": ["precision=fp32"],
    "new -feat": ["data.feature_layers=[]"],
}


def _cfg(args, extra: list[str]):
    layers = ",".join(str(i) for i in args.features)
    overrides = [
        "model=smol", "data=smol", f"run_root={args.run_root}", f"data.max_prompts={args.prompts}",
        f"data.max_new_tokens={args.new}", "data.num_shards=1", f"data.feature_layers=[{layers}]",
    ]  # fmt: skip
    return attach_imports(compose_config(overrides + extra))


def stage_row(args, name: str, folder: str) -> dict:
    from streakline.artifacts import config_hash
    from streakline.models.tokenizer import tokenizer_hash
    from streakline.pipelines.common.lookup import trajectories_key
    from streakline.pipelines.common.roles import required_tokenizer
    from streakline.pipelines.trajectories import ShardWorker, _job, _Plan

    cfg = _cfg(args, SETTINGS[name])
    key = trajectories_key(cfg, tokenizer_hash(required_tokenizer(cfg, "verifier", "trajectories")))
    plan = _Plan(cfg, stage_key=key, folder=f"{folder}/{config_hash(key)}")
    started = time.perf_counter()
    worker = ShardWorker(_job(cfg, key), {0: (plan.pieces[0], plan.metas[0], plan.folder)})
    built = time.perf_counter()
    result = worker.run(0)
    seconds = time.perf_counter() - built
    row = {"setting": name, "tokens": result["tokens"], "seconds": seconds, "build_s": built - started}
    row["dtype"] = str(next(worker.verifier.parameters()).dtype).removeprefix("torch.")
    stats = getattr(worker.backend, "stats", None)
    if stats:
        row["stats"] = dict(stats)
        row["rows"] = worker.backend.last_rows
    return row, plan


@torch.no_grad()
def hf_row(args, plan, dtype: str, batch: int) -> dict:
    import transformers

    cfg = plan.cfg
    folder = cfg.model.verifier.path
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    eos = [2]  # <|im_end|>, the smol preset's eos
    tokens, started = 0, time.perf_counter()
    for i in range(0, len(plan.prompts), batch):
        chunk = plan.prompts[i : i + batch]
        P = max(map(len, chunk))
        ids = torch.tensor([[eos[0]] * (P - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in chunk])
        out = model.generate(
            ids, attention_mask=mask, do_sample=cfg.data.temperature > 0, temperature=cfg.data.temperature,
            top_p=cfg.data.top_p, top_k=0, max_new_tokens=cfg.data.max_new_tokens, eos_token_id=eos,
            pad_token_id=eos[0],
        )  # fmt: skip
        for row in out[:, P:].tolist():
            tokens += next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
    return {"setting": "hf", "tokens": tokens, "seconds": time.perf_counter() - started, "dtype": dtype}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-root", default="runs")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new", type=int, default=96)
    parser.add_argument("--features", type=int, nargs="*", default=[2, 10, 18, 26])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    parser.add_argument("--only", nargs="*", default=[*SETTINGS, "hf"], choices=[*SETTINGS, "hf"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from streakline.models.precision import detect

    print(f"CPU bf16: {detect('cpu')}; threads {torch.get_num_threads()}; {args.prompts} prompts x {args.new} tokens")
    rows, plan = [], None
    with tempfile.TemporaryDirectory() as folder:
        for name in [n for n in SETTINGS if n in args.only]:
            row, plan = stage_row(args, name, folder)
            rows.append(row)
            batch = f", rows {row['rows']}" if "rows" in row else ""
            rate = row["tokens"] / row["seconds"]
            what = f"{row['tokens']:6d} tokens {row['seconds']:7.1f} s {rate:7.1f} tok/s"
            print(f"  {name:10s} {what} ({row['dtype']}{batch})", flush=True)
    new = next((r for r in rows if r["setting"] == "new"), None)
    if "hf" in args.only:
        if plan is None:
            _, plan = stage_row(args, "new", tempfile.mkdtemp())
        row = hf_row(args, plan, new["dtype"] if new else "bfloat16", new.get("rows", 64) if new else 64)
        rows.append(row)
    rate = {r["setting"]: r["tokens"] / r["seconds"] for r in rows}
    print(f"\n{'setting':10s} {'dtype':9s} {'tokens':>7s} {'s':>7s} {'tok/s':>7s} {'/old':>6s} {'/hf':>6s}")
    for r in rows:
        vs = [f"{rate[r['setting']] / rate[b]:6.2f}" if b in rate else "     -" for b in ("old", "hf")]
        print(f"{r['setting']:10s} {r['dtype']:9s} {r['tokens']:7d} {r['seconds']:7.1f} {rate[r['setting']]:7.1f} "
              f"{vs[0]} {vs[1]}")  # fmt: skip
    if "new" in rate and "new -feat" in rate:
        print(f"layer states cost: new -feat / new = {rate['new -feat'] / rate['new']:.3f} (goal <= 1.15)")
    if new and "stats" in new:
        s = new["stats"]
        prefill = f"prefill {s['prefill_s']:.1f} s in {s['prefill_forwards']} forwards"
        decode = f"decode {s['decode_s']:.1f} s in {s['decode_forwards']} steps"
        print(f"new: {prefill}, {decode}, {s['idle_row_steps']} of {s['row_steps']} row-steps empty")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
