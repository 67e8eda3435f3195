"""The speculative decoder: one loop and one KV-cache discipline for vanilla, AR-draft and diffusion-draft decoding.

Every number this project reports goes through ``generate``. A cycle of the loop is

    draft    the drafter proposes K chains of G tokens after the pending token (vanilla: nothing, G = 0; the
             model-free ngram drafter may propose fewer, down to none, when its lookup finds less)
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
from .vanilla import check_positions, left_pad


@dataclass(kw_only=True)
class SpecConfig:
    """One decode's settings (keyword-only). ``gamma``/``K`` are ignored without a drafter."""

    max_new_tokens: int
    gamma: int = 8
    K: int = 1
    temperature: float = 0.0  # verifier temperature
    top_p: float = 1.0  # nucleus truncation of the verifier distribution (T > 0); the output follows the truncated p
    acceptance: str = "greedy_acceptance"
    selection: str = "streak_score"  # or "longest"
    argmax_chain: bool = True  # chain 0 is the drafter's argmax; False (or a rule needing it): K i.i.d. draws from q
    eos_token_id: int | list[int] | None = None
    stop_strings: tuple[str, ...] = ()
    seed: int = 0
    topk_logprobs: int = 0  # > 0: also return the verifier's top-k log-softmax (temperature 1) at every emitted token
    # KV caches and forwards (models/kv_cache.py): eager | static | graphs | auto (static on one GPU, else eager)
    engine: str = "auto"
    # split wall time into phases (metrics.time_s): always on a CPU (it costs nothing there); on a GPU only when
    # asked for, because each phase then ends with a device sync that stalls the launch queue
    timing: bool = False


@dataclass
class DecodeResult:
    tokens: list[list[int]]  # generated ids per prompt, cut after a stop
    metrics: DecodeMetrics
    finish_reasons: list[str]  # per prompt: "eos", "stop" or "length"
    topk_ids: list[list[list[int]]] | None = None  # per prompt, per emitted token: the k most likely ids
    topk_logprobs: list[list[list[float]]] | None = None  # their log-probabilities under the verifier


class _Clock:
    """Adds wall time to ``metrics.time_s[phase]``; on a GPU only when ``timing`` asks, and then it synchronises so
    the split is honest (a sync per phase stalls the launch queue, so it is off by default there)."""

    def __init__(self, metrics: DecodeMetrics, device: torch.device, timing: bool) -> None:
        self.metrics, self.cuda = metrics, device.type == "cuda"
        self.enabled = timing or not self.cuda
        self.t = time.perf_counter()

    def lap(self, phase: str) -> float | None:
        """The seconds since the last lap, added to ``phase`` (None when not timing)."""
        if not self.enabled:
            return None
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        elapsed, self.t = now - self.t, now
        self.metrics.time_s[phase] += elapsed
        return elapsed


def top_p_filter(logits: torch.Tensor, top_p: float, temperature: float) -> torch.Tensor:
    """Logits with every token outside the smallest set of probability mass >= top_p (at ``temperature``) at -inf."""
    if top_p >= 1.0 or temperature <= 0:
        return logits
    sorted_logits, order = torch.sort(logits.float() / temperature, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    outside = (probs.cumsum(-1) - probs) >= top_p  # the mass before a token already reaches top_p; the top one stays
    drop = torch.zeros_like(outside).scatter_(-1, order, outside)
    return logits.masked_fill(drop, float("-inf"))


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
    iid = rule.iid or not cfg.argmax_chain  # i.i.d. drafts: the rule needs them, or the setting asks for them
    if not 0.0 < cfg.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {cfg.top_p}")
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list | tuple) else [cfg.eos_token_id]
    stop = StopCriteria(cfg.max_new_tokens, eos, cfg.stop_strings, tokenizer)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    metrics = DecodeMetrics(gamma=G, K=K, batch_size=len(prompts))
    wall = time.perf_counter()
    clock = _Clock(metrics, device, cfg.timing)

    ids, mask = left_pad(prompts)
    ids, mask = ids.to(device), mask.to(device)
    B, P = ids.shape
    # the last cycle starts with at most N - 1 new tokens committed and scores its pending token and a draft window
    # of gamma past it, so the verifier sees at most P + N - 1 + gamma positions (checked before any allocation: a
    # gamma of 100000 is refused here, not by the allocator)
    check_positions(verifier, P, cfg.max_new_tokens - 1 + G, "verifier", "max_new_tokens - 1 + gamma")
    # Rows share one cache length, each cycle growing it by the longest accepted path among them, so a batch can in
    # the worst case use B x (new tokens + a tree) slots past the prompt; the cache starts at two rows' worth (what
    # a batch needs in practice; the worst case would cost B times the memory) and grows if a batch needs more.
    capacity = P + 2 * (cfg.max_new_tokens + K * G + 1)
    cache = KVCache.for_model(verifier, B, capacity, engine=cfg.engine)
    try:
        return _decode(verifier, drafter, cfg, cache, capacity, ids, mask, rule, iid, stop, generator, metrics, clock,
                       wall)  # fmt: skip
    finally:  # a pooled static cache (and its CUDA graphs) serves the next decode
        cache.release()
        if drafter is not None:
            drafter.release()


def _path_states(aux, tree: ChainTree, res, width: int, keep_rows: list[int] | None) -> torch.Tensor:
    """``[b, width, F]`` verifier layer states of each row's accepted path (pending token, then the accepted drafts),
    right-aligned like the next ``new_ids``; ``aux`` ``[B, 1 + K*G, F]`` are the tree forward's states and
    ``keep_rows`` the rows still decoding (None: all)."""
    accepted, chosen = res.accepted, res.chosen
    if keep_rows is not None:
        index = torch.tensor(keep_rows, device=aux.device)
        aux, accepted, chosen = aux[index], accepted[index], chosen[index]
    path = tree.path_index(chosen, 0, width)  # [b, width]: tree slot of path node i, left-aligned
    src = torch.arange(width, device=aux.device)[None] - (width - 1 - accepted)[:, None]  # right-aligned
    slots = path.gather(1, src.clamp(min=0))
    return aux.gather(1, slots[..., None].expand(-1, -1, aux.shape[-1]))


def _decode(verifier, drafter, cfg, cache, capacity, ids, mask, rule, iid, stop, generator, metrics, clock, wall):
    """The loop of ``generate`` (module docstring) on a cache sized for ``capacity`` slots."""
    device = ids.device
    B, P = ids.shape
    G = cfg.gamma if drafter is not None else 0
    K = cfg.K if drafter is not None else 1
    ragged = bool((mask == 0).any())
    # a drafter conditioned on the verifier's layer states (DFlash) names the layers; every verifier forward then
    # also returns them, and the drafter gets those of the tokens each forward put in the cache
    layers = getattr(drafter, "feature_layers", None)
    feats = None
    if layers:
        width = len(layers) * verifier.config.hidden_size
        feats = {"features": verifier.embed.weight.new_zeros(B, 0, width), "feature_valid": None}
    if P > 1:
        pre = mask[:, :-1]
        fwd = verifier.hidden(ids[:, :-1], attention_mask=pre if ragged else None, cache=cache, aux_layers=layers)
        if layers:
            feats = {"features": fwd[1], "feature_valid": pre.bool() if ragged else None}
        metrics.nfe += 1
    pending = ids[:, -1]
    pos = mask.sum(1) - 1  # position id of the pending token
    if drafter is not None:
        drafter.reset(B, capacity, engine=cfg.engine)
    new_ids, new_valid = ids, (mask.bool() if ragged else None)
    clock.lap("prefill")

    observe = getattr(drafter, "observe", None)
    trees = {G: ChainTree(K, G, device)}  # by draft width: a model-free drafter may draft fewer than G (ngram.py)
    rows = list(range(B))  # original index of each active row
    out: list[list[int]] = [[] for _ in range(B)]
    reasons = [""] * B
    k_top = cfg.topk_logprobs
    top_ids: list[list[list[int]]] = [[] for _ in range(B)]
    top_lps: list[list[list[float]]] = [[] for _ in range(B)]
    while rows:
        b = len(rows)
        q = None
        if drafter is not None:
            proposal = drafter.propose(new_ids, new_valid, gamma=G, K=K, generator=generator, iid=iid, **(feats or {}))
            drafts = proposal.tokens
            q = proposal.distribution() if rule.needs_q else None
            metrics.drafter_forwards += proposal.forwards
        else:
            drafts = torch.zeros(b, 1, 0, dtype=torch.long, device=device)
        g = drafts.shape[-1]  # this cycle's width: G, or fewer when the drafter found fewer worth proposing
        if g not in trees:
            trees[g] = ChainTree(K, g, device)
        tree = trees[g]
        draft_s = clock.lap("draft")

        fwd = verifier.hidden(
            tree.tokens(pending, drafts),
            position_ids=tree.positions(pos),
            cache=cache,
            attn_mask=tree.mask(b),
            aux_layers=layers,
        )
        aux = fwd[1] if layers else None
        logits = verifier.logits(fwd[0] if layers else fwd).to(device)
        metrics.nfe += 1
        verify_s = clock.lap("verify")
        if observe is not None:  # a drafter that weighs its options by their cost (mixed.py) learns this cycle's timing
            observe(g, draft_s, verify_s)

        if q is not None and q.shape[-1] < logits.shape[-1]:  # a drafter vocabulary mapped onto a padded verifier one
            q = torch.nn.functional.pad(q, (0, logits.shape[-1] - q.shape[-1]))
        per_chain = tree.per_chain(logits)
        res = rule.verify(
            top_p_filter(per_chain, cfg.top_p, cfg.temperature),
            drafts,
            q,
            temperature=cfg.temperature,
            selection=cfg.selection,
            generator=generator,
        )
        # the one read of the cycle's results by the host (one transfer; a GPU syncs once here)
        chosen_chain = drafts[torch.arange(b, device=device), res.chosen]  # [b, G]
        head = torch.stack([res.accepted, res.next_token, res.chosen], 1).to(chosen_chain.dtype)
        host = torch.cat([head, chosen_chain], 1).tolist()
        accepted, next_tokens, chosen = ([r[i] for r in host] for i in range(3))
        chains = [r[3:] for r in host]
        if k_top:
            path_logits = per_chain[torch.arange(b, device=device), res.chosen]  # [b, G+1, V]
            lp = torch.log_softmax(path_logits.float(), dim=-1).topk(k_top, dim=-1)
            cycle_ids, cycle_lps = lp.indices.tolist(), lp.values.tolist()
        clock.lap("accept")

        if g:
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
            metrics.record_cycle(accepted[i], chosen[i], drafted=g)
            out[row].extend(new)
            if k_top:  # the token at path depth j was drawn from row j of the chosen chain
                top_ids[row].extend(cycle_ids[i][: len(new)])
                top_lps[row].extend(cycle_lps[i][: len(new)])
            cut = stop.cut(out[row], len(new))
            if cut is not None:
                length, reasons[row] = cut
                del out[row][length:]
                del top_ids[row][length:], top_lps[row][length:]
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
            if layers:  # the states of [pending, accepted drafts]: one per new token, aligned with new_ids
                kept = keep_rows if finished else None
                feats = {"features": _path_states(aux, tree, res, new_ids.shape[1], kept), "feature_valid": new_valid}
        clock.lap("commit")

    metrics.new_tokens = sum(len(o) for o in out)
    metrics.wall_s = time.perf_counter() - wall
    return DecodeResult(
        tokens=out,
        metrics=metrics,
        finish_reasons=reasons,
        topk_ids=top_ids if k_top else None,
        topk_logprobs=top_lps if k_top else None,
    )
