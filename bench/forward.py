"""Benchmark: our transformer core against `transformers` on the same weights, side by side in one run.

Measures, for the tiny verifier's shapes (Qwen2 layout, fp32 on CPU by default, or bf16 on a GPU):
  - prefill of 512 tokens (batch 1),
  - KV-cached greedy decode, batch 1 and batch 8 (128-token prompt, 64 new tokens).
Prints tokens/s for both and the ratio ours / transformers (> 1 means we are faster). Timings are medians of
several repeats, interleaved so that machine noise hits both sides alike. Not a test: nothing is asserted.

    python bench/forward.py                 # CPU
    python bench/forward.py --device cuda --dtype bfloat16 --hidden 1024 --layers 16
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch
import transformers
from _timing import timed

from streakline.models import KVCache, Transformer, TransformerConfig, save_pretrained


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)

    cfg = TransformerConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_layers=args.layers,
        num_heads=max(1, args.hidden // 64),
        num_kv_heads=max(1, args.hidden // 128),
        qkv_bias=True,
        family="qwen2",
        max_position_embeddings=4096,
    )
    ours = Transformer(cfg).init_weights(seed=0).to(args.device, dtype).eval()
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(ours, tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, attn_implementation="sdpa")
    hf = hf.to(args.device).eval()
    print(
        f"model: {cfg.num_parameters() / 1e6:.1f}M params, {args.dtype} on {args.device}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    )

    prefill_ids = torch.randint(0, args.vocab, (1, args.prefill), device=args.device)

    def ours_prefill():
        ours(prefill_ids, logits_to_keep=1)

    def hf_prefill():
        hf(prefill_ids, logits_to_keep=1, use_cache=False)

    def decode_pair(batch: int):
        prompt = torch.randint(0, args.vocab, (batch, args.prompt), device=args.device)

        def run_ours():
            cache = KVCache.for_model(ours, batch, capacity=args.prompt + args.new)
            nxt = ours(prompt, cache=cache, logits_to_keep=1).argmax(-1)
            for _ in range(args.new - 1):
                nxt = ours(nxt, cache=cache).argmax(-1)

        def run_hf():
            out = hf(prompt, use_cache=True, logits_to_keep=1)
            past, nxt = out.past_key_values, out.logits.argmax(-1)
            for _ in range(args.new - 1):
                out = hf(nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits.argmax(-1)

        return run_ours, run_hf

    cases = [("prefill 512 (tok/s)", ours_prefill, hf_prefill, args.prefill)]
    for b in (1, 8):
        o, h = decode_pair(b)
        cases.append((f"decode batch {b} (tok/s)", o, h, b * args.new))

    print(f"{'case':<24}{'ours':>12}{'transformers':>14}{'ratio':>8}")
    with torch.inference_mode():
        for name, fo, fh, tokens in cases:
            fo(), fh()  # warm-up
            to, th = [], []
            for _ in range(args.repeats):
                to.append(timed(fo, args.device)[1])
                th.append(timed(fh, args.device)[1])
            o, h = tokens / statistics.median(to), tokens / statistics.median(th)
            print(f"{name:<24}{o:>12.0f}{h:>14.0f}{o / h:>8.2f}")


if __name__ == "__main__":
    main()
