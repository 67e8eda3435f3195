"""Benchmark: block-diffusion decoders on the tiny target, side by side in one run (the SPOT paper's table).

Rows, each against ``static`` (the draft-free reference, one commit per forward):

  static / threshold        draft-free (threshold: Fast-dLLM's rule at decoder.threshold)
  spiffy D=10 D*=3          the calibrated graph (stage=spiffy), pruned to 3 states per forward
  spot D=8 / D=20           the order-model tree (stage=spot)
  spot-gamma D=20           the same with nodes below prefix mass 0.02 dropped

For each temperature (0, and 1 with coupled noise) it prints NFE per generated token, fewer forwards than static
(x), tokens/s and its ratio to static, mean draft states verified per forward, and whether the tokens equal the
draft-free decoder's (they must, at every temperature). Then the cost of one verification forward over 1 + D
copies of a block (D = 1, 8, 20) relative to a plain forward of one block, with a prompt-sized cached prefix.

The tiny world and the SPOT / Spiffy artifacts are built first when missing (stage=bootstrap / spot / spiffy,
cached). Timing is prompt-major (every method on prompt 0, then prompt 1, ...) so machine noise hits all rows
alike; wall-clock on 2 shared CPU cores says little about a GPU, NFE does. Not a test: nothing is asserted.

    python bench/dllm.py --threads 1 --prompts 5          # CPU, a few minutes once the artifacts exist
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _timing import timed

from streakline.config import compose_config
from streakline.data.benchmarks import load_benchmark, prompt_text
from streakline.decoding.block_diffusion import BlockDecodeConfig, decode_blocks
from streakline.decoding.registry import block_drafter
from streakline.decoding.vanilla import left_pad
from streakline.models import KVCache, build
from streakline.pipelines import run_stage
from streakline.pipelines.common.prompts import encode
from streakline.pipelines.common.roles import device as default_device
from streakline.pipelines.common.roles import role_tokenizer
from streakline.world import attach_world


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=5, help="per benchmark (tiny-math, tiny-code)")
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--model", default="tiny", help="world preset (micro: a seconds-long smoke run)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    cfg = compose_config(["stage=decode", f"model={args.model}"])
    attach_world(cfg, device=default_device())
    run_stage(compose_config(["stage=spot", f"model={args.model}"]))  # cached when already built
    from streakline.pipelines.common.lookup import locate_graph as spiffy_graph
    from streakline.pipelines.common.lookup import locate_order_model as spot_model

    device = default_device()
    target = build(cfg.model.target, "target", device=device).eval()
    tok = role_tokenizer(cfg, "target")
    prompts = [
        encode(tok, prompt_text(r)) for b in ("tiny-math", "tiny-code") for r in load_benchmark(b, limit=args.prompts)
    ]
    spot = spot_model(cfg)

    def methods_at(T: float) -> dict:
        # A Spiffy graph is calibrated for one temperature (stage=spiffy, cached); the order model serves any.
        run_stage(compose_config(["stage=spiffy", f"model={args.model}", f"stage.temperature={T}"]))
        graph = spiffy_graph(cfg, temperature=T)
        return {
            "static": ("static", None),
            "threshold": ("threshold", None),
            "spiffy D=10 D*=3": ("static", block_drafter("spiffy", graph, {"prune": 3}, device=device)),
            "spot D=8": (
                "static",
                block_drafter("spot", spot, {"budget": 8, "prefix_mass_floor": None}, device=device),
            ),
            "spot D=20": (
                "static",
                block_drafter("spot", spot, {"budget": 20, "prefix_mass_floor": None}, device=device),
            ),
            "spot-gamma D=20": (
                "static",
                block_drafter("spot", spot, {"budget": 20, "prefix_mass_floor": 0.02}, device=device),
            ),
        }

    eos = tok.eos_token_id
    for T in args.temperatures:
        methods = methods_at(T)
        stats = {m: {"nfe": 0, "tokens": 0, "drafts": 0, "forwards": 0, "times": [], "outs": []} for m in methods}
        for _ in range(args.repeats):
            totals = dict.fromkeys(methods, 0.0)
            for p in prompts:
                ids, mask = (t.to(device) for t in left_pad([p]))
                for name, (rule, drafter) in methods.items():
                    bcfg = BlockDecodeConfig(
                        rule=rule,
                        threshold=cfg.decoder.threshold,
                        max_new_tokens=args.new,
                        eos_token_id=eos,
                        temperature=T,
                        seed=0,
                    )
                    res, sec = timed(
                        lambda i=ids, m=mask, c=bcfg, d=drafter: decode_blocks(target, i, m, c, drafter=d), device
                    )
                    totals[name] += sec
                    if _ == 0:
                        s = stats[name]
                        s["nfe"] += res.nfe
                        s["tokens"] += len(res.tokens[0])
                        s["drafts"] += sum(res.drafts_per_forward)
                        s["forwards"] += res.nfe
                        s["outs"].append(res.tokens[0])
            for name in methods:
                stats[name]["times"].append(totals[name])
        ref = stats["static"]
        ref_tps = ref["tokens"] / statistics.median(ref["times"])
        print(f"\n== T={T:g}, {len(prompts)} prompts, {args.new} new tokens, {args.threads} thread(s), {device}")
        print(
            f"{'method':18s} {'NFE/tok':>8s} {'fewer fwd':>9s} {'tok/s':>8s} {'vs static':>9s} "
            f"{'drafts/fwd':>10s} {'lossless':>8s}"
        )
        for name, s in stats.items():
            tps = s["tokens"] / statistics.median(s["times"])
            ref_outs = stats["threshold" if methods[name][0] == "threshold" else "static"]["outs"]
            same = "yes" if s["outs"] == ref_outs else "NO"
            print(
                f"{name:18s} {s['nfe'] / s['tokens']:8.3f} {ref['nfe'] / s['nfe']:8.2f}x {tps:8.1f} "
                f"{tps / ref_tps:8.2f}x {s['drafts'] / s['forwards']:10.2f} {same:>8s}"
            )

    # Verification-forward cost: 1 + D copies of a block vs one block, on a cached prefix of a prompt's size.
    L = target.config.block_size
    P = 4 * L
    print(f"\n== verification forward cost (block L={L}, cached prefix {P} tokens), median of 20")
    prefix = torch.randint(0, target.config.vocab_size - 1, (1, P), device=device)
    base = None
    for D in (0, 1, 8, 20):
        n = 1 + D
        ids = torch.randint(0, target.config.vocab_size - 1, (1, n * L), device=device)
        copy = torch.arange(n * L, device=device) // L
        explicit = (copy[:, None] == copy[None, :])[None]
        pos = (P + torch.arange(L, device=device)).repeat(n)[None]
        cache = KVCache.for_model(target, 1, capacity=P + n * L)
        with torch.no_grad():
            target(prefix, cache=cache)
            times = []
            for _ in range(20):
                _, sec = timed(
                    lambda i=ids, p=pos, c=cache, e=explicit: target(i, position_ids=p, cache=c, attn_mask=e), device
                )
                cache.crop(P)
                times.append(sec)
        t = statistics.median(times)
        base = base or t
        label = "plain block" if D == 0 else f"D={D}"
        print(f"{label:12s} {t * 1e3:8.2f} ms  {t / base:5.2f}x a plain forward")


if __name__ == "__main__":
    main()
