"""Continuous batching: sample many prompts from one verifier at the machine's limit (``stage=trajectories``).

A fixed batch decodes until its longest row ends, so after the first rows finish most of the batch computes tokens
nobody keeps. Here a batch of ``rows`` slots decodes from a ``RowCache`` (``models/row_cache.py``, each row its own
length): a row that ends leaves its slot, and the next waiting prompt takes it after a prefill of the newly admitted
prompts (right-padded, in one forward). Once no prompt waits, the slots still decoding are packed together when
half the batch is idle, so the last rows do not pay for the empty ones.

What a row is, and why it does not depend on its batch mates:

- at temperature 0 the argmax of the row's own logits, so in fp32 a row equals that prompt decoded alone (the
  tests check it; in bf16 a batch of another shape can round a near-tie the other way);
- at temperature > 0 each row draws from its own ``torch.Generator`` seeded with the row's seed (one uniform a
  token, inverse-CDF over the tempered, nucleus-filtered distribution), so which rows share a step changes nothing
  but float rounding;
- with ``feature_layers``, the verifier's layer states of every prompt and completion token, taken from the same
  forwards that produce the tokens: the prefill gives the prompt's, each decode step the state of the token it
  feeds, and a finished row feeds its last token once more. They equal a second pass over the finished row
  (``alignment.dflash.verifier_features``) up to float rounding (test).

    sampler = ContinuousSampler(model, SampleSettings(max_new_tokens=128, temperature=1.0), rows=64)
    samples = sampler.sample(prompts, seeds)        # one Sample per prompt, in order

Tests: ``pytest tests/decoding/test_batching.py``; speed: ``python bench/trajectories.py``.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from streakline.models.kv_cache import free_bytes
from streakline.models.row_cache import RowCache

from .backends import Sample, SampleSettings
from .stopping import StopCriteria

NUCLEUS_SHORTCUT = 64  # top_p < 1: the nucleus is searched in the top 64 first, the full sort only when it is wider
PREFILL_TOKENS = 8192  # at most this many (padded) prompt tokens in one prefill forward: bounds its activations
PREFILL_PADDING = 1.15  # a prefill forward's padded tokens stay within this factor of its real ones
MEMORY_SHARE = 0.5  # auto rows use at most this share of the free memory (the rest: activations, the shard's rows)


def auto_rows(model, capacity: int, pending: int, cap: int, feature_width: int = 0) -> int:
    """How many rows to decode together: ``cap`` (AUTO_BATCH_CAP for the device), fewer when there are fewer
    prompts, or when the KV cache, a step's float32 logits and the rows' stored features would pass
    ``MEMORY_SHARE`` of the free memory."""
    cfg, p = model.config, next(model.parameters())
    per_row = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * capacity * p.element_size()
    per_row += 3 * 4 * cfg.vocab_size + 2 * feature_width * capacity
    free = free_bytes(p.device)
    fit = cap if free is None else max(1, int(free * MEMORY_SHARE) // per_row)
    return max(1, min(cap, pending, fit))


class _Row:
    """A slot's current request: which prompt, its generator, what it has produced so far."""

    __slots__ = ("index", "prompt", "tokens", "topk_ids", "topk_lps", "feats", "generator", "reason", "tail")

    def __init__(self, index: int, prompt: list[int], seed: int | None) -> None:
        self.index, self.prompt = index, prompt
        self.tokens: list[int] = []
        self.topk_ids: list[list[int]] = []
        self.topk_lps: list[list[float]] = []
        self.feats: list[np.ndarray] = []
        self.generator = None
        if seed is not None:
            self.generator = torch.Generator().manual_seed(int(seed))
        self.reason: str | None = None
        self.tail = False  # finished, and feeding its last token once more for that token's layer states


class ContinuousSampler:
    """Samples ``settings`` completions for many prompts through ``rows`` slots of one ``RowCache``."""

    def __init__(
        self,
        model,
        settings: SampleSettings,
        tokenizer=None,
        *,
        rows: int | None = None,
        feature_layers: Sequence[int] = (),
        row_cap: int = 64,
    ) -> None:
        if not 0.0 < settings.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {settings.top_p}")
        self.model, self.settings, self.tokenizer = model, settings, tokenizer
        self.rows, self.row_cap = rows, row_cap
        self.layers = tuple(int(i) for i in feature_layers)
        eos = settings.eos_token_id
        eos = list(eos) if isinstance(eos, list | tuple) else [eos]
        self.stop = StopCriteria(settings.max_new_tokens, eos, settings.stop_strings, tokenizer)
        self.device = model.embed.weight.device
        self.last_rows = 0  # the batch the last sample() decoded (auto or set)
        self.stats = collections.Counter()  # forwards, row-steps, idle row-steps, seconds (what the bench reports)

    @torch.no_grad()
    def sample(
        self,
        prompts: Sequence[list[int]],
        seeds: Sequence[int] | None = None,
        on_row: Callable[[int, Sample], None] | None = None,
    ) -> list[Sample]:
        """One Sample per prompt, in order (``extra["features"]``: ``[tokens, L*H]`` float16 with feature_layers).
        ``seeds``: one per prompt, needed when temperature > 0. ``on_row(index, sample)`` as each row finishes."""
        s = self.settings
        if s.temperature > 0 and (seeds is None or len(seeds) != len(prompts)):
            raise ValueError("sampling at temperature > 0 needs one seed per prompt")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if not prompts:
            return []
        capacity = max(len(p) for p in prompts) + s.max_new_tokens
        width = len(self.layers) * self.model.config.hidden_size
        B = self.rows or auto_rows(self.model, capacity, len(prompts), self.row_cap, width)
        B = self.last_rows = min(B, len(prompts))
        cache = RowCache.for_model(self.model, B, capacity)
        # longest first: an admission pads to its longest prompt, so like lengths go in together, and the longest
        # rows start early rather than run alone at the end. Rows do not depend on the order.
        queue = collections.deque(sorted(range(len(prompts)), key=lambda i: -len(prompts[i])))
        slots: list[_Row | None] = [None] * B
        pending = torch.zeros(B, dtype=torch.long, device=self.device)  # the token each slot feeds next
        out: list[Sample | None] = [None] * len(prompts)

        def finish(b: int) -> None:
            row = slots[b]
            sample = Sample(
                completion_ids=row.tokens,
                finish_reason=row.reason,
                topk_ids=row.topk_ids if s.topk_logprobs else None,
                topk_logprobs=row.topk_lps if s.topk_logprobs else None,
            )
            if self.layers:
                sample.extra["features"] = np.concatenate(row.feats, axis=0)
            out[row.index] = sample
            slots[b] = None
            if on_row is not None:
                on_row(row.index, sample)

        while queue or any(r is not None for r in slots):
            free = [b for b, r in enumerate(slots) if r is None]
            active = len(slots) - len(free)
            if queue and free and (len(free) >= max(1, len(slots) // 16) or active == 0):
                started = time.perf_counter()
                self._admit(cache, slots, pending, free, queue, prompts, seeds, finish)
                self.stats["prefill_s"] += time.perf_counter() - started
                continue
            if not queue and 0 < active <= len(slots) // 2:  # the tail of the work: pack the live rows
                keep = [b for b, r in enumerate(slots) if r is not None]
                cache.keep_rows(torch.tensor(keep, device=self.device))
                slots, pending = [slots[b] for b in keep], pending[keep]
            started = time.perf_counter()
            self._step(cache, slots, pending, finish)
            self.stats["decode_s"] += time.perf_counter() - started
        return out

    # ------------------------------------------------------------------------------------------ the two forwards
    def _admit(self, cache, slots, pending, free, queue, prompts, seeds, finish) -> None:
        """Prefill as many waiting prompts as there are free slots, and sample their first token. The queue is
        longest first, so the prompts taken come in falling length; they are cut into groups that pad at most
        PREFILL_PADDING over their real tokens and hold at most PREFILL_TOKENS, one forward each (a forward more
        costs one read of the weights; padding costs compute on every layer)."""
        groups: list[list[int]] = []
        for _ in range(len(free)):
            if not queue:
                break
            n = len(prompts[queue[0]])
            group = groups[-1] if groups else None
            if group is not None:
                longest, real = len(prompts[group[0]]), sum(len(prompts[j]) for j in group) + n
                if longest * (len(group) + 1) <= min(PREFILL_TOKENS, PREFILL_PADDING * real):
                    group.append(queue.popleft())
                    continue
            groups.append([queue.popleft()])
        at = 0
        for take in groups:
            rows = free[at : at + len(take)]
            at += len(take)
            self._prefill(cache, slots, pending, rows, take, prompts, seeds, finish)

    def _prefill(self, cache, slots, pending, rows, take, prompts, seeds, finish) -> None:
        T = max(len(prompts[i]) for i in take)
        ids = torch.zeros(len(take), T, dtype=torch.long)
        valid = torch.zeros(len(take), T, dtype=torch.long)
        for j, i in enumerate(take):
            ids[j, : len(prompts[i])] = torch.as_tensor(prompts[i])
            valid[j, : len(prompts[i])] = 1
        ids, valid = ids.to(self.device), valid.to(self.device)
        index = torch.tensor(rows, device=self.device)
        cache.empty(index)
        cache.use_rows(index)
        try:
            h, aux = self._forward(ids, cache.positions(T), valid, cache)
        finally:
            cache.use_rows(None)
        lengths = valid.sum(1)
        last = h[torch.arange(len(take), device=self.device), lengths - 1]
        for j, (b, i) in enumerate(zip(rows, take, strict=True)):
            slots[b] = _Row(i, list(prompts[i]), None if seeds is None else seeds[i])
            if aux is not None:
                slots[b].feats.append(aux[j, : len(prompts[i])])
        self.stats["prefill_forwards"] += 1
        self.stats["prefill_tokens"] += int(lengths.sum())
        self.stats["prefill_padded"] += len(take) * T
        self._emit(cache, slots, pending, rows, self.model.logits(last), finish)

    def _step(self, cache, slots, pending, finish) -> None:
        """One decode step over every slot: live rows feed their last token, idle slots a dummy."""
        B = len(slots)
        h, aux = self._forward(pending[:, None], cache.positions(1), None, cache)
        live = [b for b, r in enumerate(slots) if r is not None]
        idle = [b for b, r in enumerate(slots) if r is None]
        if idle:  # a dummy token wrote a slot: those rows stay empty
            cache.empty(torch.tensor(idle, device=self.device))
        self.stats["decode_forwards"] += 1
        self.stats["row_steps"] += B
        self.stats["idle_row_steps"] += len(idle)
        if aux is not None:
            for b in live:
                slots[b].feats.append(aux[b])
        tails = [b for b in live if slots[b].tail]
        for b in tails:  # its last token's layer states are in: the row is done
            finish(b)
            cache.empty(torch.tensor([b], device=self.device))
        rows = [b for b in live if slots[b] is not None and not slots[b].tail]
        if rows:
            self._emit(cache, slots, pending, rows, self.model.logits(h[rows, -1]), finish)

    def _forward(self, ids, positions, valid, cache):
        if self.layers:
            h, aux = self.model.hidden(
                ids, position_ids=positions, attention_mask=valid, cache=cache, aux_layers=self.layers
            )
            return h, aux.to(torch.float16).cpu().numpy()
        return self.model.hidden(ids, position_ids=positions, attention_mask=valid, cache=cache), None

    # ------------------------------------------------------------------------------------------ tokens
    def _emit(self, cache, slots, pending, rows, logits, finish) -> None:
        """Sample one token for each of ``rows`` from ``logits`` ``[len(rows), V]``, record it, stop rows."""
        s = self.settings
        logits = logits.float()
        tokens = self._draw(logits, [slots[b].generator for b in rows])
        top = None
        if s.topk_logprobs:  # the top-k logits less the log-partition: log_softmax's top k, without a pass over V
            best = logits.topk(s.topk_logprobs, dim=-1)
            lps = best.values - torch.logsumexp(logits, dim=-1, keepdim=True)
            top = (best.indices.tolist(), lps.tolist())
        pending[torch.tensor(rows, device=self.device)] = tokens
        for j, (b, t) in enumerate(zip(rows, tokens.tolist(), strict=True)):
            row = slots[b]
            row.tokens.append(t)
            if top is not None:
                row.topk_ids.append(top[0][j])
                row.topk_lps.append(top[1][j])
            cut = self.stop.cut(row.tokens, 1)
            if cut is None:
                continue
            row.reason = cut[1]
            del row.tokens[cut[0] :]
            if self.layers:
                row.tail = True  # one more step feeds the last token for its layer states
            else:
                finish(b)
                cache.empty(torch.tensor([b], device=self.device))

    def _draw(self, logits: torch.Tensor, generators: list) -> torch.Tensor:
        """One token per row of ``logits``: the argmax at temperature 0, else an inverse-CDF draw with one uniform
        from the row's own generator over the tempered distribution cut to its top_p nucleus."""
        s = self.settings
        if s.temperature <= 0:
            return logits.argmax(-1)
        u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators]).to(logits.device)
        scaled = logits / s.temperature
        lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
        if s.top_p >= 1.0:
            return _invert(torch.exp(scaled - lse).double().cumsum(-1), u)
        return _nucleus_draw(scaled, lse, s.top_p, u)


def _invert(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Indices where ``u`` (in [0, 1)) scaled to each row's total falls in its unnormalised CDF ``cdf``."""
    target = (u * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp(max=cdf.shape[1] - 1)


def _nucleus_draw(scaled: torch.Tensor, lse: torch.Tensor, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """A draw from each row's tempered distribution (logits ``scaled``, log-partition ``lse`` ``[n, 1]``) restricted
    to its nucleus: the smallest set of highest-probability tokens whose mass reaches ``top_p``
    (``speculative.top_p_filter``'s set), without sorting the vocabulary or exponentiating all of it. The top
    NUCLEUS_SHORTCUT tokens hold the nucleus in most rows. For the others: when the tokens of probability >= eps
    hold a mass >= top_p, the nucleus is among them (every token before the one that crosses top_p is at least as
    likely as it), so a ``topk`` of that many is exact; smaller eps are tried in turn (0 at the end: the whole
    vocabulary)."""
    out = torch.empty(len(scaled), dtype=torch.long, device=scaled.device)
    top = scaled.topk(min(NUCLEUS_SHORTCUT, scaled.shape[1]), dim=-1)  # sorted, descending
    vals = torch.exp(top.values - lse)
    done = vals.sum(-1) >= top_p
    if done.any():
        out[done] = _draw_sorted(vals[done], top.indices[done], top_p, u[done])
    todo = (~done).nonzero().flatten()
    if len(todo):
        probs = torch.exp(scaled[todo] - lse[todo])
        for eps in NUCLEUS_EPS:
            kept = probs >= eps
            done = (probs * kept).sum(-1) >= top_p if eps > 0 else torch.ones(len(todo), dtype=torch.bool)
            if done.any():
                k = int(kept[done].sum(-1).max())
                top = probs[done].topk(k, dim=-1)
                out[todo[done]] = _draw_sorted(top.values, top.indices, top_p, u[todo[done]])
            todo, probs = todo[~done], probs[~done]
            if not len(todo):
                break
    return out


NUCLEUS_EPS = (1e-3, 1e-4, 1e-5, 0.0)  # the thresholds _nucleus_draw tries for a row the shortcut does not cover


def _draw_sorted(vals: torch.Tensor, ids: torch.Tensor, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """Draw from descending probabilities ``vals`` (token ids ``ids``) kept while the mass before them is < top_p."""
    before = vals.cumsum(-1) - vals
    kept = torch.where(before < top_p, vals, torch.zeros_like(vals))
    return ids.gather(1, _invert(kept.double().cumsum(-1), u)[:, None])[:, 0]
