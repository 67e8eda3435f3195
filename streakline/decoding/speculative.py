"""The speculative decoder: one loop and one KV-cache discipline for vanilla, AR-draft and diffusion-draft decoding.

Every number this project reports goes through ``generate``. A cycle of the loop is

    draft    the drafter proposes K chains of G tokens after the pending token (vanilla: nothing, G = 0)
    verify   one verifier forward over [pending, K chains] with tree attention (``tree.py``)
    accept   an acceptance rule (``acceptance.py``) picks a chain, accepts a prefix of it and draws the token that
             ends the cycle (replacement or bonus) from the logits already computed: no second verifier pass
    commit   the accepted path's K/V is moved into place in the verifier cache (``kernels.compact_kv``); the
             emitted tokens are appended, stop criteria checked, finished rows leave the batch

The pending token is the last committed token, whose K/V is not yet in the cache: the prompt's last token at the
start (so the prefill runs ``prompt[:-1]``), the cycle's replacement/bonus token afterwards. Feeding it with the
drafts is what gives ``p_1`` without an extra forward. Vanilla decoding is the same loop with G = 0.

Batches take ragged prompts (left padding). Rows accept different numbers of tokens; the cache keeps the rejected
slots of shorter rows as masked-out holes so all rows share one cache length.

At verifier temperature 0 every rule is exact-greedy and the output equals the verifier's own greedy output token
for token; at T > 0 the output distribution equals the verifier's (``tests/decoding/test_lossless.py``).

    from streakline.decoding import DiffusionDrafter, SpecConfig, generate
    res = generate(verifier, [[5, 6, 7]], SpecConfig(max_new_tokens=64, gamma=8, K=4, temperature=1.0),
                   drafter=DiffusionDrafter(drafter_model, temperature=1.5))
    res.tokens, res.metrics.to_dict()
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from streakline.models import KVCache, Transformer

from .acceptance import get_rule
from .kernels import compact_kv
from .metrics import DecodeMetrics
from .stopping import StopCriteria
from .tree import ChainTree
from .vanilla import left_pad


@dataclass(kw_only=True)
class SpecConfig:
    """One decode's settings (keyword-only). ``gamma``/``K`` are ignored without a drafter."""

    max_new_tokens: int
    gamma: int = 8
    K: int = 1
    temperature: float = 0.0  # verifier temperature
    acceptance: str = "greedy_acceptance"
    selection: str = "streak_score"  # or "longest"
    eos_token_id: int | list[int] | None = None
    stop_strings: tuple[str, ...] = ()
    seed: int = 0


@dataclass
class DecodeResult:
    tokens: list[list[int]]  # generated ids per prompt, cut after a stop
    metrics: DecodeMetrics


class _Clock:
    """Adds wall time to ``metrics.time_s[phase]``; synchronises a GPU so the split is honest."""

    def __init__(self, metrics: DecodeMetrics, device: torch.device) -> None:
        self.metrics, self.cuda = metrics, device.type == "cuda"
        self.t = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.metrics.time_s[phase] += now - self.t
        self.t = now


def _segments(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Right-aligned ``[B, n]`` ids and their validity (None when all rows have the same length)."""
    ids, mask = left_pad(rows)
    ragged = len({len(r) for r in rows}) > 1
    return ids.to(device), (mask.bool().to(device) if ragged else None)


@torch.no_grad()
def generate(
    verifier: Transformer,
    prompts: list[list[int]],
    cfg: SpecConfig,
    drafter=None,
    tokenizer=None,
) -> DecodeResult:
    """Decode every prompt (lists of verifier token ids) with ``drafter`` (None = vanilla). Returns tokens + metrics.

    ``tokenizer`` is needed only for ``cfg.stop_strings``.
    """
    device = verifier.embed.weight.device
    G = cfg.gamma if drafter is not None else 0
    K = cfg.K if drafter is not None else 1
    if drafter is not None and (G < 1 or K < 1):
        raise ValueError(f"a drafter needs gamma >= 1 and K >= 1, got gamma={G}, K={K}")
    rule = get_rule(cfg.acceptance, cfg.temperature, K)
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list | tuple) else [cfg.eos_token_id]
    stop = StopCriteria(cfg.max_new_tokens, eos, cfg.stop_strings, tokenizer)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    metrics = DecodeMetrics(gamma=G, K=K, batch_size=len(prompts))
    wall = time.perf_counter()
    clock = _Clock(metrics, device)

    ids, mask = left_pad(prompts)
    ids, mask = ids.to(device), mask.to(device)
    B, P = ids.shape
    capacity = P + 2 * (cfg.max_new_tokens + K * G + 1)
    cache = KVCache.for_model(verifier, B, capacity)
    ragged = bool((mask == 0).any())
    if P > 1:
        pre = mask[:, :-1]
        verifier.hidden(ids[:, :-1], attention_mask=pre if ragged else None, cache=cache)
        metrics.nfe += 1
    pending = ids[:, -1]
    pos = mask.sum(1) - 1  # position id of the pending token
    if drafter is not None:
        drafter.reset(B, capacity)
    new_ids, new_valid = ids, (mask.bool() if ragged else None)
    clock.lap("prefill")

    tree = ChainTree(K, G, device)
    rows = list(range(B))  # original index of each active row
    out: list[list[int]] = [[] for _ in range(B)]
    while rows:
        b = len(rows)
        q = None
        if drafter is not None:
            proposal = drafter.propose(new_ids, new_valid, gamma=G, K=K, generator=generator, iid=rule.iid)
            drafts = proposal.tokens
            q = proposal.q if rule.needs_q else None
            metrics.drafter_forwards += proposal.forwards
        else:
            drafts = torch.zeros(b, 1, 0, dtype=torch.long, device=device)
        clock.lap("draft")

        logits = verifier(
            tree.tokens(pending, drafts), position_ids=tree.positions(pos), cache=cache, attn_mask=tree.mask(b)
        )
        metrics.nfe += 1
        clock.lap("verify")

        if q is not None and q.shape[-1] < logits.shape[-1]:  # a drafter vocabulary mapped onto a padded verifier one
            q = torch.nn.functional.pad(q, (0, logits.shape[-1] - q.shape[-1]))
        res = rule.verify(
            tree.per_chain(logits), drafts, q, temperature=cfg.temperature, selection=cfg.selection, generator=generator
        )
        accepted = res.accepted.tolist()
        next_tokens = res.next_token.tolist()
        chosen = res.chosen.tolist()
        chains = drafts[torch.arange(b, device=device), res.chosen].tolist()
        clock.lap("accept")

        if G:
            start = cache.length - tree.size
            n = 1 + max(accepted)
            if b == 1 and chosen[0] == 0:
                cache.crop(start + n)  # chain 0 is already in place
            else:
                index = tree.path_index(res.chosen, start, n)
                keep = None
                if min(accepted) + 1 < n:  # rows that accepted less keep masked-out holes
                    keep = torch.arange(n, device=device)[None] <= res.accepted[:, None]
                cache.gather(index, start, keep=keep, copy=compact_kv)
        emitted, finished = [], []
        for i, row in enumerate(rows):
            new = chains[i][: accepted[i]] + [next_tokens[i]]
            metrics.record_cycle(accepted[i], chosen[i])
            out[row].extend(new)
            cut = stop.cut(out[row], len(new))
            if cut is not None:
                del out[row][cut:]
                finished.append(i)
            emitted.append(new)
        pending = res.next_token
        pos = pos + res.accepted + 1
        if finished:
            keep_rows = [i for i in range(b) if i not in finished]
            if keep_rows:
                index = torch.tensor(keep_rows, device=device)
                cache.keep_rows(index)
                if drafter is not None:
                    drafter.keep_rows(index)
                pending, pos = pending[index], pos[index]
            rows = [rows[i] for i in keep_rows]
            emitted = [emitted[i] for i in keep_rows]
        if rows and drafter is not None:
            new_ids, new_valid = _segments(emitted, device)
        clock.lap("commit")

    metrics.new_tokens = sum(len(o) for o in out)
    metrics.wall_s = time.perf_counter() - wall
    return DecodeResult(tokens=out, metrics=metrics)
