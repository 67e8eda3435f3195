"""Benchmark: the decoder at GPU speed, on random-weight models with the real shapes of the presets.

One run prints, each next to its speed goal (reached / not reached):

  bandwidth     measured device copy bandwidth (one large tensor copy: bytes read + written / time; on a CPU it is a
                host memcpy), and the roofline it implies: tokens/s = batch x bandwidth / weight bytes (every weight
                read once per step, the embedding table counted in full as the issue counts it)
  vanilla       ``decoding.speculative.generate(drafter=None)`` per engine in ``--engines``, batch 1 and 8, a
                random 128-token prompt and 128 new tokens (no eos: every row runs to the budget): tokens/s, ms per
                step and the fraction of the roofline. Goal at Qwen2.5-7B shapes, batch 1: >= 60% of the roofline
  transformers  ``Qwen2ForCausalLM.generate`` on the same shapes (random init, sdpa, greedy, ``min_new_tokens =
                max_new_tokens`` so it never stops early). Goal: ours >= 2x at batch 1
  spec cycle    a Qwen2.5-14B-shape verifier with a DiffuCoder-7B-shape diffusion drafter (``DiffusionDrafter``,
                full attention, shifted logits, as the preset), (K, gamma) in (1, 8), (4, 16), (8, 16): the cost of
                one cycle in vanilla steps = (time per cycle) / (time per vanilla step of the same verifier, same
                engine, same batch). Goals: <= 1.6 at K=1 gamma=8, <= 1.8 at K=4 gamma=16

Shapes (``--shapes real``) come from the models' published ``config.json``; the presets in conf/ name the hub ids
(conf/checkpoint/qwen2.5-14b.yaml, diffucoder-7b.yaml) but not the numbers, so they are written out in ``SHAPES``.
The weights are random (normal, std 0.02) and made on the device in the run's dtype (a 14B model never exists on
the CPU). With random weights the drafter's tokens are almost never accepted, so a speculative cycle emits one
token: the cost per cycle is what is measured here, not the speedup (that needs trained pairs: bench/decode.py).
Cycles are counted from ``DecodeMetrics``: ``nfe`` minus the prefill is the number of batched verify forwards,
i.e. loop iterations (``metrics.cycles`` sums over rows, so it is B times that when rows finish together). Times are
whole ``generate`` calls, the prompt's prefill included, on both sides of every ratio (per step and per cycle alike).

Timing: every measured call runs once as a warm-up with the same arguments (allocations, CUDA-graph captures,
kernel selection), then ``--repeats`` times; the median counts. ``torch.cuda.synchronize`` brackets every timing.
Models are freed between sections. ``--budget-s`` stops starting new measurements once that much wall time has
passed (bench/gpu.sh uses it so one slow engine cannot eat the whole check); skipped rows say so. Engines are
tried in the order given, so list the one you care about first. Not a test: nothing is asserted.

    python bench/gpu_decode.py                                   # CUDA: real shapes, bf16 (not yet timed on one)
    python bench/gpu_decode.py --engines eager --json out.json   # before the static/graphs engine exists
    python bench/gpu_decode.py --shapes tiny                     # CPU: scaled-down shapes, fp32, seconds (a smoke run)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import statistics
import time

import torch
from _timing import sync, timed

from streakline.decoding.drafters import DiffusionDrafter
from streakline.decoding.speculative import SpecConfig, generate
from streakline.models import Transformer, TransformerConfig

# Qwen2.5-7B / -14B(-Instruct) and DiffuCoder-7B-Instruct (Dream architecture from Qwen2.5-Coder-7B: the 7B shapes,
# full attention, logits shifted by one) as their config.json files give them. rope_theta and rms_norm_eps change
# values, not speed, so the 14B shape keeps the 7B's.
QWEN7 = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    qkv_bias=True,
    tie_embeddings=False,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
)
QWEN14 = dict(QWEN7, hidden_size=5120, intermediate_size=13824, num_layers=48, num_heads=40, num_kv_heads=8)
# Scaled-down stand-ins with the same structure (GQA, biases, untied read-out) for a CPU smoke run.
TINY7 = dict(QWEN7, vocab_size=1024, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2)
TINY14 = dict(TINY7, hidden_size=192, intermediate_size=512, num_layers=3, num_heads=6, num_kv_heads=2)
SHAPES = {
    "real": {"qwen2.5-7b": QWEN7, "qwen2.5-14b": QWEN14, "diffucoder-7b": QWEN7},
    "tiny": {"qwen2.5-7b": TINY7, "qwen2.5-14b": TINY14, "diffucoder-7b": TINY7},
}
DRAFTER = dict(attention="full", shift=True, family="dream")
SPEC_POINTS = ((1, 8), (4, 16), (8, 16))
# the speed goals: gpt-fast-class decoding, and a speculative cycle that costs little more than a step
GOAL_ROOFLINE = 0.60  # vanilla, 7B shapes, batch 1: fraction of the HBM roofline
GOAL_VS_HF = 2.0  # vanilla / transformers generate, 7B shapes, batch 1
GOAL_CYCLE = {(1, 8): 1.6, (4, 16): 1.8}  # vanilla steps per speculative cycle


def verdict(ok: bool, args) -> bool | str:
    """What a goal row records: reached (True) or not (False); at tiny shapes the goals do not apply."""
    return "n/a (tiny shapes)" if args.shapes == "tiny" else ok


def goal(v: bool | str) -> str:
    return v if isinstance(v, str) else ("reached" if v else "NOT reached")


class Budget:
    """Wall-clock allowance: ``left()`` is False once ``seconds`` have passed (None: no limit)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds, self.t0 = seconds, time.perf_counter()

    def left(self) -> bool:
        return self.seconds is None or time.perf_counter() - self.t0 < self.seconds


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    # Modules built under this context allocate their parameters in ``dtype`` directly: a 14B model in fp32 first
    # would need 60 GB and a second copy to convert.
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@torch.no_grad()
def random_init(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """In place on the parameters' device, like ``Transformer.init_weights`` (unit norms, zero biases, normal
    matrices) but without its CPU generator, which would draw every 7B-scale matrix on the host first."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)


def build_ours(shape: dict, device: str, dtype: torch.dtype, seed: int, **extra) -> Transformer:
    cfg = TransformerConfig(**shape, **extra)
    with default_dtype(dtype), torch.device(device):
        model = Transformer(cfg)
    random_init(model, seed)
    if hasattr(model, "fuse_projections"):  # q/k/v and gate/up as one matmul each, for inference
        model.fuse_projections()
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def release_memory() -> None:
    """Give the memory of dropped models back (call after ``del``), so the next section starts with the device
    empty."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def copy_bandwidth(device: str, mib: int, repeats: int) -> float:
    """Bytes per second of ``dst.copy_(src)`` for a ``mib`` MiB tensor, counting the bytes read and written."""
    n = mib * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first touch of the pages / lazy allocations
    times = [timed(lambda: dst.copy_(src), device)[1] for _ in range(max(repeats, 5))]
    return 2 * n / statistics.median(times)


def engine_kw(engine: str, have_engines: bool) -> dict:
    # Before the engine lands, "eager" is today's path: the keyword is simply not passed.
    return {"engine": engine} if have_engines else {}


def measure(call, device: str, repeats: int) -> tuple[float, object]:
    """Median seconds of ``call()`` over ``repeats`` runs after one warm-up, and the last result."""
    call()
    times, out = [], None
    for _ in range(repeats):
        out, seconds = timed(call, device)
        times.append(seconds)
    return statistics.median(times), out


def loop_iterations(metrics, prompt_len: int) -> int:
    """Batched verify forwards of a decode: every verifier forward but the prompt's prefill."""
    return metrics.nfe - (1 if prompt_len > 1 else 0)


def run_vanilla(model, prompts, args, engine: str, have_engines: bool) -> dict:
    cfg = SpecConfig(max_new_tokens=args.new, eos_token_id=None, seed=args.seed, **engine_kw(engine, have_engines))
    seconds, res = measure(lambda: generate(model, prompts, cfg), args.device, args.repeats)
    steps = loop_iterations(res.metrics, len(prompts[0]))
    new = sum(len(t) for t in res.tokens)
    return {"seconds": seconds, "new_tokens": new, "steps": steps, "tokens_per_s": new / seconds,
            "step_ms": 1e3 * seconds / steps}  # fmt: skip


def run_hf(hf, prompts, args) -> dict:
    ids = torch.tensor(prompts, device=args.device)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new, min_new_tokens=args.new,
              do_sample=False, pad_token_id=0, use_cache=True)  # fmt: skip
    seconds, out = measure(lambda: hf.generate(ids, **kw), args.device, args.repeats)
    new = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"seconds": seconds, "new_tokens": new, "tokens_per_s": new / seconds}


def run_spec(verifier, drafter, prompts, args, engine, have_engines, K: int, gamma: int) -> dict:
    cfg = SpecConfig(max_new_tokens=args.new, gamma=gamma, K=K, eos_token_id=None, seed=args.seed,
                     **engine_kw(engine, have_engines))  # fmt: skip
    seconds, res = measure(lambda: generate(verifier, prompts, cfg, drafter=drafter), args.device, args.spec_repeats)
    m = res.metrics
    cycles = loop_iterations(m, len(prompts[0]))
    return {"seconds": seconds, "cycles": cycles, "row_cycles": m.cycles, "cycle_ms": 1e3 * seconds / cycles,
            "tokens_per_cycle": m.tokens_per_verifier_call, "accepted_per_cycle": m.accepted_per_cycle}  # fmt: skip


def attempt(rows: list, key: dict, budget: Budget, fn) -> dict | None:
    """Run one measurement unless the budget is spent; a failure is recorded and printed, not raised, so one broken
    engine leaves the other rows standing."""
    if not budget.left():
        rows.append({**key, "skipped": "time budget (--budget-s) spent"})
        return None
    try:
        row = {**key, **fn()}
    except Exception as e:  # reported in the table and the JSON
        msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        rows.append({**key, "error": msg})
        if isinstance(e, torch.cuda.OutOfMemoryError):
            release_memory()
        return None
    rows.append(row)
    return row


def print_missing(row: dict, label: str) -> bool:
    if "skipped" in row or "error" in row:
        print(f"{label}  {'skipped: ' + row['skipped'] if 'skipped' in row else 'failed: ' + row['error']}")
        return True
    return False


def vanilla_header(name: str, args) -> None:
    print(f"\nours vanilla, {name} shapes ({args.new} new tokens after a {args.prompt_len}-token prompt)")
    print(f"{'engine':<8}{'batch':>6}{'tok/s':>10}{'ms/step':>9}{'roofline':>10}{'fraction':>10}  goal")


def section_vanilla(name, model, roofline, prompts_by_batch, args, engines, have_engines, budget, results):
    """Vanilla rows for one model (after ``vanilla_header``); returns {(engine, batch): row} of the rows that ran."""
    out = {}
    for engine in engines:
        for b in args.batches:
            label = f"{engine:<8}{b:>6}"
            if engine != "eager" and not have_engines:
                row = {"model": name, "engine": engine, "batch": b,
                       "skipped": "SpecConfig has no 'engine' field (an older checkout)"}  # fmt: skip
                results["vanilla"].append(row)
                print_missing(row, label)
                continue
            key = {"model": name, "engine": engine, "batch": b}
            call = functools.partial(run_vanilla, model, prompts_by_batch[b], args, engine, have_engines)
            row = attempt(results["vanilla"], key, budget, call)
            if row is None:
                print_missing(results["vanilla"][-1], label)
                continue
            row["roofline_tokens_per_s"] = b * roofline
            row["fraction_of_roofline"] = row["tokens_per_s"] / (b * roofline)
            note = ""
            if name == "qwen2.5-7b" and b == 1:
                row["goal_roofline"] = verdict(row["fraction_of_roofline"] >= GOAL_ROOFLINE, args)
                note = f">= {GOAL_ROOFLINE:.0%}: {goal(row['goal_roofline'])}"
            print(f"{label}{row['tokens_per_s']:>10.1f}{row['step_ms']:>9.2f}{b * roofline:>10.1f}"
                  f"{row['fraction_of_roofline']:>10.1%}  {note}")  # fmt: skip
            out[(engine, b)] = row
    return out


def build_hf(shape: dict, device: str, dtype: torch.dtype, seed: int):
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"],
        max_position_embeddings=shape["max_position_embeddings"],
        rope_theta=shape["rope_theta"],
        rms_norm_eps=shape["rms_norm_eps"],
        tie_word_embeddings=shape["tie_embeddings"],
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)  # transformers initialises from the global generator
    with default_dtype(dtype), torch.device(device):
        model = transformers.Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = None  # random weights, no stop token: every row runs to the budget
    return model.eval()


def section_hf(shape, args, dtype, prompts_by_batch, ours, budget, results) -> None:
    try:
        import transformers
    except ImportError:
        print("\ntransformers is not installed: the transformers generate rows are skipped")
        results["hf"].append({"skipped": "transformers is not installed"})
        return
    transformers.logging.set_verbosity_error()  # generation-flag chatter would bury the table
    hf = None
    try:
        hf = build_hf(shape, args.device, dtype, args.seed)
        print(f"\ntransformers {transformers.__version__} generate ({hf.config._attn_implementation}, greedy), "
              "qwen2.5-7b shapes")  # fmt: skip
        print(f"{'batch':>6}{'tok/s':>10}{'ours/hf':>9}{'best ours (engine)':>22}  goal")
        for b in args.batches:
            call = functools.partial(run_hf, hf, prompts_by_batch[b], args)
            row = attempt(results["hf"], {"model": "qwen2.5-7b", "batch": b}, budget, call)
            if row is None:
                print_missing(results["hf"][-1], f"{b:>6}")
                continue
            mine = [(r["tokens_per_s"], e) for (e, bb), r in ours.items() if bb == b]
            if mine:
                best, engine = max(mine)
                row["ours_over_hf"] = best / row["tokens_per_s"]
                row["ours_engine"] = engine
                note = ""
                if b == 1:
                    row["goal_vs_hf"] = verdict(row["ours_over_hf"] >= GOAL_VS_HF, args)
                    note = f">= {GOAL_VS_HF:g}x: {goal(row['goal_vs_hf'])}"
                print(f"{b:>6}{row['tokens_per_s']:>10.1f}{row['ours_over_hf']:>9.2f}"
                      f"{best:>13.1f} ({engine})  {note}")  # fmt: skip
            else:
                print(f"{b:>6}{row['tokens_per_s']:>10.1f}{'-':>9}")
    except Exception as e:  # a transformers API change must not take the other sections down
        results["hf"].append({"error": f"{type(e).__name__}: {e}"[:300]})
        print(f"  failed: {type(e).__name__}: {e}"[:300])
    finally:
        del hf
        release_memory()


def section_spec(verifier, drafter, args, engines, have_engines, steps, prompts_by_batch, budget, results) -> None:
    print(f"\nspeculative cycle, qwen2.5-14b-shape verifier + diffucoder-7b-shape diffusion drafter ({args.new} new)")
    print(f"{'engine':<8}{'batch':>6}{'K':>3}{'gamma':>6}{'ms/cycle':>10}{'ms/step':>9}{'cost':>7}{'tok/cyc':>8}  goal")
    if not engines:
        results["spec"].append({"skipped": "no engine gave a vanilla step time for the verifier"})
        print("skipped: no engine gave a vanilla step time for the verifier")
    for engine in engines:
        for b in args.batches:
            for K, gamma in SPEC_POINTS:
                label = f"{engine:<8}{b:>6}{K:>3}{gamma:>6}"
                key = {"engine": engine, "batch": b, "K": K, "gamma": gamma}
                base = steps.get((engine, b))
                if base is None:
                    row = {**key, "skipped": f"no vanilla step time for engine {engine} batch {b} to divide by"}
                    results["spec"].append(row)
                    print_missing(row, label)
                    continue
                row = attempt(results["spec"], key, budget,
                              lambda e=engine, b=b, K=K, g=gamma: run_spec(verifier, drafter, prompts_by_batch[b],
                                                                           args, e, have_engines, K, g))  # fmt: skip
                if row is None:
                    print_missing(results["spec"][-1], label)
                    continue
                row["vanilla_step_ms"] = base["step_ms"]
                row["cost_in_vanilla_steps"] = row["cycle_ms"] / base["step_ms"]
                limit = GOAL_CYCLE.get((K, gamma)) if b == 1 else None
                note = ""
                if limit is not None:
                    row["goal_cycle"] = verdict(row["cost_in_vanilla_steps"] <= limit, args)
                    note = f"<= {limit:g}: {goal(row['goal_cycle'])}"
                print(f"{label}{row['cycle_ms']:>10.2f}{base['step_ms']:>9.2f}{row['cost_in_vanilla_steps']:>7.2f}"
                      f"{row['tokens_per_cycle']:>8.2f}  {note}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default=None, help="default: real on CUDA, tiny otherwise")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                    help="default: bfloat16 for real shapes, float32 for tiny")  # fmt: skip
    ap.add_argument("--engines", nargs="+", default=None,
                    help="SpecConfig.engine values for the vanilla rows, in this order (default: graphs static eager "
                         "on CUDA, eager static elsewhere)")  # fmt: skip
    ap.add_argument(
        "--spec-engines",
        nargs="+",
        default=None,
        help="engines of the 14B vanilla and cycle rows (default: the first of --engines that works)",
    )
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=None, help="default: 128 (tiny: 16)")
    ap.add_argument("--new", type=int, default=None, help="new tokens per row (default: 128; tiny: 8)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per vanilla / hf row, median (3; tiny 1)")
    ap.add_argument("--spec-repeats", type=int, default=1, help="timed runs per speculative row (median)")
    ap.add_argument("--copy-mib", type=int, default=None, help="bandwidth test tensor size (default 1024; tiny 64)")
    ap.add_argument("--budget-s", type=float, default=None, help="start no new measurement after this many seconds")
    ap.add_argument("--skip-hf", action="store_true", help="leave out the transformers rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write every number here (rewritten after each section)")
    args = ap.parse_args()
    on_cuda = args.device.startswith("cuda")
    args.shapes = args.shapes or ("real" if on_cuda else "tiny")
    tiny = args.shapes == "tiny"
    args.dtype = args.dtype or ("float32" if tiny else "bfloat16")
    args.prompt_len = args.prompt_len or (16 if tiny else 128)
    args.new = args.new or (8 if tiny else 128)
    args.copy_mib = args.copy_mib or (64 if tiny else 1024)
    args.repeats = args.repeats or (1 if tiny else 3)
    args.engines = args.engines or (["graphs", "static", "eager"] if on_cuda else ["eager", "static"])
    dtype = getattr(torch, args.dtype)
    shapes = SHAPES[args.shapes]
    budget = Budget(args.budget_s)
    wall = time.perf_counter()

    have_engines = "engine" in {f.name for f in dataclasses.fields(SpecConfig)}
    where = torch.cuda.get_device_name() if on_cuda else f"CPU ({torch.get_num_threads()} threads)"
    print(f"{where}; torch {torch.__version__}; {args.shapes} shapes in {args.dtype}; engines {' '.join(args.engines)}")
    if not have_engines:
        print("SpecConfig has no 'engine' field yet (an older checkout without the static/graphs engine): 'eager' runs "
              "today's path, the other engines' rows are skipped")  # fmt: skip
    if not on_cuda and args.shapes == "real":
        print("note: real shapes on a CPU take a very long time; --shapes tiny is the smoke run")
    results: dict = {"args": vars(args), "device": where, "torch": torch.__version__, "have_engines": have_engines,
                     "vanilla": [], "hf": [], "spec": []}  # fmt: skip

    def save() -> None:
        results["wall_s"] = time.perf_counter() - wall
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)

    gen = torch.Generator().manual_seed(args.seed)

    def prompts(vocab: int) -> dict[int, list[list[int]]]:
        return {b: torch.randint(0, vocab, (b, args.prompt_len), generator=gen).tolist() for b in args.batches}

    # bandwidth and the roofline it implies
    bw = copy_bandwidth(args.device, args.copy_mib, args.repeats)
    results["copy_bandwidth_bytes_per_s"] = bw
    kind = "device-to-device copy" if on_cuda else "host memcpy"
    print(f"\ncopy bandwidth ({kind}, {args.copy_mib} MiB, read + write): {bw / 1e12:.3f} TB/s")
    save()

    # Qwen2.5-7B shapes: ours per engine, then transformers on the same shapes
    model = build_ours(shapes["qwen2.5-7b"], args.device, dtype, args.seed)
    wb = weight_bytes(model)
    roofline = bw / wb
    results["qwen2.5-7b"] = {"weight_bytes": wb, "roofline_tokens_per_s": roofline}
    print(f"qwen2.5-7b shapes: {wb / 1e9:.2f} GB of weights -> roofline {roofline:.1f} tokens/s at batch 1")
    p7 = prompts(shapes["qwen2.5-7b"]["vocab_size"])
    vanilla_header("qwen2.5-7b", args)
    ours7 = section_vanilla("qwen2.5-7b", model, roofline, p7, args, args.engines, have_engines, budget, results)
    del model
    release_memory()
    save()
    if not args.skip_hf:
        section_hf(shapes["qwen2.5-7b"], args, dtype, p7, ours7, budget, results)
        save()

    # Qwen2.5-14B verifier: its vanilla step (per engine: the divisor of the cycle cost), then the cycles
    verifier = build_ours(shapes["qwen2.5-14b"], args.device, dtype, args.seed + 1)
    wb14 = weight_bytes(verifier)
    roof14 = bw / wb14
    results["qwen2.5-14b"] = {"weight_bytes": wb14, "roofline_tokens_per_s": roof14}
    print(f"\nqwen2.5-14b shapes: {wb14 / 1e9:.2f} GB of weights -> roofline {roof14:.1f} tokens/s at batch 1")
    p14 = prompts(shapes["qwen2.5-14b"]["vocab_size"])
    # The verifier's vanilla step divides the cycle's time, so it runs on the cycle's engines only; without
    # --spec-engines that is the first engine in --engines whose rows work (a broken engine falls through to the next).
    steps: dict = {}
    vanilla_header("qwen2.5-14b", args)
    for engine in args.spec_engines or args.engines:
        got = section_vanilla("qwen2.5-14b", verifier, roof14, p14, args, [engine], have_engines, budget, results)
        steps.update(got)
        if got and not args.spec_engines:
            args.spec_engines = [engine]
            break
    save()
    shape_d = shapes["diffucoder-7b"]
    drafter_model = build_ours(shape_d, args.device, dtype, args.seed + 2, mask_token_id=shape_d["vocab_size"] - 1,
                               **DRAFTER)  # fmt: skip
    drafter = DiffusionDrafter(drafter_model)  # the project's defaults: temperature 1.5, top-k 64
    section_spec(verifier, drafter, args, args.spec_engines or [], have_engines, steps, p14, budget, results)
    del verifier, drafter_model, drafter
    release_memory()
    sync(args.device)
    if on_cuda:
        results["cuda_memory_allocated_at_end"] = torch.cuda.memory_allocated()
        if torch.cuda.memory_allocated() > 2**30:
            print(f"\nnote: {torch.cuda.memory_allocated() / 2**30:.1f} GiB still allocated after every model was "
                  "freed (a cache or graph pool that outlives its model?)")  # fmt: skip

    print("\nsummary of the speed goals")
    for r in results["vanilla"]:
        if "goal_roofline" in r:
            print(f"  vanilla {r['engine']} 7B batch 1 at {r['fraction_of_roofline']:.1%} of the roofline "
                  f"(goal >= {GOAL_ROOFLINE:.0%}): {goal(r['goal_roofline'])}")  # fmt: skip
    for r in results["hf"]:
        if "goal_vs_hf" in r:
            print(f"  vanilla ({r['ours_engine']}) / transformers generate, 7B batch 1: {r['ours_over_hf']:.2f}x "
                  f"(goal >= {GOAL_VS_HF:g}x): {goal(r['goal_vs_hf'])}")  # fmt: skip
    for r in results["spec"]:
        if "goal_cycle" in r:
            print(f"  cycle K={r['K']} gamma={r['gamma']} ({r['engine']}, batch 1): {r['cost_in_vanilla_steps']:.2f} "
                  f"vanilla steps (goal <= {GOAL_CYCLE[(r['K'], r['gamma'])]:g}): {goal(r['goal_cycle'])}")  # fmt: skip
    missing = [r for sec in ("vanilla", "hf", "spec") for r in results[sec] if "skipped" in r or "error" in r]
    if missing:
        print(f"  {len(missing)} row(s) skipped or failed (see above)")
    if tiny:
        print("  (tiny shapes: the goals are for real shapes on a GPU; this run only shows that the script works)")
    results["goals"] = {
        "roofline_fraction_7b_batch1": GOAL_ROOFLINE,
        "vs_transformers_7b_batch1": GOAL_VS_HF,
        "cycle_vanilla_steps_batch1": {f"K={k} gamma={g}": v for (k, g), v in GOAL_CYCLE.items()},
    }
    save()
    print(f"\ntotal {time.perf_counter() - wall:.0f} s")


if __name__ == "__main__":
    main()
