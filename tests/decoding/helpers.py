"""Hand-built verifier / drafter pairs for the decoder tests: small vocabularies so drafts are sometimes right.

- ``verifier(seed)``: a random causal model with sharp logits (std 0.1 weights, so argmax near-ties are rare).
- ``shifted_copy(model, mode)``: a diffusion drafter sharing the verifier's weights, shifted, so slot 1 is read from
  the last context token, i.e. the verifier's own next-token logit: slot 1 is always right at temperature 0 and the
  later slots (read at mask tokens) only sometimes. Exercises acceptance, self-selection and the KV path moves.
- ``random_drafter(seed, ...)``: an unrelated drafter, whose drafts are almost never right.
- ``chi2_pvalue(counts, probs)``: the sampling tests' goodness-of-fit test; ``sampled_pairs(model, drafter, ...)``
  runs it on the first two tokens of a sampled decode under two acceptance rules.
"""

import copy
from dataclasses import replace

import torch
from omegaconf import DictConfig, OmegaConf

from streakline.models import Transformer
from tests.models.helpers import tiny_config

V = 13  # small: random chains match the verifier often enough to exercise every branch
MASK = V - 1


def verifier(seed: int = 0, vocab: int = V) -> Transformer:
    return Transformer(tiny_config("qwen2", vocab_size=vocab)).init_weights(seed=seed, std=0.1).eval()


def shifted_copy(model: Transformer, mode: str = "prefix_causal") -> Transformer:
    drafter = copy.deepcopy(model)
    drafter.config = replace(model.config, attention=mode, shift=True, mask_token_id=model.config.vocab_size - 1)
    return drafter


def random_drafter(seed: int = 1, mode: str = "prefix_causal", shift: bool = False, vocab: int = V) -> Transformer:
    cfg = tiny_config("qwen2", vocab_size=vocab, attention=mode, shift=shift, mask_token_id=vocab - 1)
    return Transformer(cfg).init_weights(seed=seed, std=0.1).eval()


def causal_copy(model: Transformer, seed: int | None = None) -> Transformer:
    """The verifier itself as an AR drafter (always right at T=0), or a fresh random causal model for ``seed``."""
    if seed is None:
        return copy.deepcopy(model)
    return Transformer(model.config).init_weights(seed=seed, std=0.1).eval()


def decoder_settings(name: str, **overrides) -> DictConfig:
    """A ``decoder`` config as ``speculative_setup`` reads it: one chain, greedy acceptance, 8 new tokens, lookup of
    suffixes of 3 down to 2 tokens; ``overrides`` replace any field."""
    fields = {"name": name, "K": 1, "gamma": None, "temperature": 0.0, "drafter_temperature": 1.5, "top_k": 64,
              "acceptance": "greedy_acceptance", "selection": "streak_score", "argmax_chain": True,
              "max_new_tokens": 8, "stop_strings": [], "ngram_max": 3, "ngram_min": 2}  # fmt: skip
    return OmegaConf.create({**fields, **overrides})


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of observed ``counts`` against the distribution ``probs`` (same shape); cells
    expecting fewer than 5 draws are pooled into one, as the approximation needs."""
    counts, expected = counts.flatten().double(), probs.flatten().double() * float(counts.sum())
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = (((obs - exp) ** 2) / exp)[keep].sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def sampled_pairs(model: Transformer, drafter, prompt: list[int], samples: int, gamma: int = 3) -> dict:
    """Per rule (greedy acceptance with K = 3, or K = 1 for a one-chain drafter; leviathan), the decode result and
    the chi-square p-value of its first two tokens against the verifier's exact joint distribution of them, at T = 1
    (``samples`` copies of ``prompt`` in one batch, each row an independent draw)."""
    from streakline.decoding.speculative import SpecConfig, generate

    V = model.config.vocab_size
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt]))[0, -1], -1)
        p2 = torch.softmax(model(torch.tensor([prompt + [a] for a in range(V)]))[:, -1], -1)
    exact = p1[:, None] * p2
    chains = 1 if getattr(drafter, "kind", None) in ("ngram", "dflash_lookup") else 3  # one-chain drafters
    out = {}
    for rule, K in (("greedy_acceptance", chains), ("leviathan", 1)):
        cfg = SpecConfig(max_new_tokens=2, gamma=gamma, K=K, temperature=1.0, acceptance=rule, seed=3)
        res = generate(model, [prompt] * samples, cfg, drafter=drafter)
        counts = torch.zeros(V * V, dtype=torch.float64)
        for t in res.tokens:
            counts[t[0] * V + t[1]] += 1
        out[rule] = (res, chi2_pvalue(counts, exact))
    return out
