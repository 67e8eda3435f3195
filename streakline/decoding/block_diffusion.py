"""Draft-free decoders for block-diffusion targets (SDAR-like): ``static`` and ``threshold`` (Fast-dLLM).

A block-diffusion target attends block-causally (bidirectional inside a block of L tokens, causal across blocks),
so a finished block's KV is exact and can be cached. A completion is decoded block by block: the current block
starts as mask tokens, each target forward over it yields per-position distributions, a *commit rule* replaces
some masked positions by tokens, and once nothing is masked the next block starts. These decoders are the
reference that SPOT and Spiffy (docs/algorithms.md sections 8-9) must reproduce token for token, and the source of
their training / calibration data (``on_step`` sees every forward's logits).

Prompt alignment: positions start at 0 at the first real prompt token and are never shifted. If the prompt ends
mid-block, the first decoded block is the *rest of that block*: its prompt tokens sit in it unmasked, and they
are recomputed with the block (they must see the generated tokens beside them, as a block-causal forward over
the final sequence would let them). Only the prompt's complete blocks are prefilled.

NFE convention: one target forward per commit step, nothing else. The prompt prefill is folded into the first
forward of the first block, and storing a finished block's KV is folded into the first forward of the next block
(that forward runs the finished block's L tokens plus the new block's L tokens). The last block's KV is never
stored since nothing reads it. So NFE is exactly the number of commit steps, the same count that
``decode_blocks_reference`` (no cache, one full forward per step) reports.

Whole blocks are always decoded; the returned tokens are cut to ``max_new_tokens`` and after the first eos.
Scoring, the commit rules and the drafter interface live in ``block_rules.py``.
Code map: ``decode_blocks`` loops over blocks: ``_open_block``, its first forward (``_plain_step``), ``_next_step``
until nothing is masked, ``_close_block``; a call's state lives in ``_Run``, the current block's in ``_Block``.

    from streakline.decoding.block_diffusion import BlockDecodeConfig, decode_blocks
    res = decode_blocks(model, prompt_ids, attention_mask, BlockDecodeConfig(rule="threshold", max_new_tokens=64))
    res.tokens, res.nfe

Tests: ``python -m pytest tests/decoding/test_block_diffusion.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from streakline.models import KVCache, Transformer

from .block_rules import (
    COMMIT_RULES,
    BlockDecodeConfig,
    BlockDrafter,
    BlockStep,
    CommitRule,
    DraftContext,
    Drafts,
    coupled_gumbel,
    score_logits,
    stale_probs,
    stale_topk,
    token_scores,
)
from .vanilla import check_positions

# Re-exported: the decoder's callers import its vocabulary from here (block_rules.py is where it lives).
__all__ = [
    "COMMIT_RULES",
    "BlockDecodeConfig",
    "BlockDecodeResult",
    "BlockDrafter",
    "BlockStep",
    "CommitRule",
    "DraftContext",
    "Drafts",
    "StepRecord",
    "coupled_gumbel",
    "decode_blocks",
    "decode_blocks_reference",
    "score_logits",
    "stale_probs",
    "stale_topk",
    "token_scores",
]


@dataclass
class StepRecord:
    block: int
    positions: list[list[int]]  # per row: output indices committed in this forward
    tokens: list[list[int]]
    confidences: list[list[float]]


@dataclass
class BlockDecodeResult:
    tokens: list[list[int]]  # per row, cut at max_new_tokens and after the first eos
    nfe: int  # target forwards of the batch
    nfe_per_row: list[int]  # forwards in which the row still had masked positions
    commits_per_forward: list[int]  # positions committed per forward, summed over the batch
    steps_log: list[StepRecord] = field(default_factory=list)
    drafts_per_forward: list[int] = field(default_factory=list)  # draft states verified per forward (batch sum)
    seconds_drafting: float = 0.0  # wall time inside the drafter (building trees / instantiating graphs)


def _resolve(model: Transformer, cfg: BlockDecodeConfig) -> tuple[int, int, int | None, CommitRule]:
    mc = model.config
    if mc.attention != "block_causal":
        raise ValueError(f"block decoding needs a block_causal target; this model attends {mc.attention!r}")
    L = cfg.block_size or mc.block_size
    if L != mc.block_size:
        raise ValueError(f"block_size {L} differs from the block size {mc.block_size} the model attends with")
    if mc.mask_token_id is None:
        raise ValueError("the target's config has no mask_token_id")
    if cfg.rule not in COMMIT_RULES:
        raise ValueError(f"unknown commit rule {cfg.rule!r}; valid: {', '.join(COMMIT_RULES)}")
    if cfg.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
    if cfg.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {cfg.temperature}")
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else mc.eos_token_id
    return L, mc.mask_token_id, eos, COMMIT_RULES[cfg.rule]


def _step(
    block: int,
    forward: int,
    tokens: torch.Tensor,
    masked: torch.Tensor,
    positions: torch.Tensor,
    out_positions: torch.Tensor,
    logits: torch.Tensor,
    cfg: BlockDecodeConfig,
    rule: CommitRule,
    gumbel: torch.Tensor | None,
) -> BlockStep:
    """Score one forward's logits ``[B, L, V]``, apply the rule, and return the step with its commits filled in."""
    conf, cand = score_logits(logits, gumbel, cfg)
    step = BlockStep(block, forward, tokens, masked, positions, out_positions, logits, conf, cand, gumbel)
    commit, new = rule(step, cfg)
    commit = commit & masked
    if bool((masked.any(dim=1) & ~commit.any(dim=1)).any()):
        raise RuntimeError(f"commit rule {cfg.rule!r} committed nothing for a row that still has masked positions")
    step.commit, step.committed = commit, torch.where(commit, new, tokens)
    return step


def _record(step: BlockStep) -> StepRecord:
    rows = range(step.commit.shape[0])
    idx = [step.commit[r].nonzero().flatten() for r in rows]
    return StepRecord(
        block=step.block,
        positions=[step.out_positions[r, i].tolist() for r, i in zip(rows, idx, strict=True)],
        tokens=[step.committed[r, i].tolist() for r, i in zip(rows, idx, strict=True)],
        confidences=[step.confidence[r, i].tolist() for r, i in zip(rows, idx, strict=True)],
    )


def _finish(out: list[int], eos: int | None, max_new: int) -> list[int]:
    out = out[:max_new]
    return out[: out.index(eos) + 1] if eos is not None and eos in out else out


def _verify_forward(model: Transformer, root: torch.Tensor, drafts: Drafts, pos: torch.Tensor, cache: KVCache):
    """One target forward over the root and its D draft states: ``[B, 1 + D, L, V]`` logits.

    Each copy of the block sees the cached prefix and itself (bidirectionally), never another copy, so each gets
    the logits a separate forward of that state would give (tests/decoding/test_block_verify.py checks it)."""
    B, D, L = drafts.tokens.shape
    n = 1 + D
    ids = torch.cat([root[:, None], drafts.tokens], dim=1).flatten(1)
    copy = torch.arange(n * L, device=root.device) // L
    explicit = (copy[:, None] == copy[None, :])[None].expand(B, -1, -1)
    logits = model(ids, position_ids=pos.repeat(1, n), cache=cache, attn_mask=explicit, logits_to_keep=n * L)
    cache.crop(cache.length - n * L)
    return logits.view(B, n, L, -1)


def _shift(block_logits: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Per-position logits of a *shifted* target (the logits at position i predict token i + 1, as in AR-initialised
    diffusion models such as Dream): ``[N, L, V]`` forward logits of a block -> ``[N, L, V]`` predictions for the
    block's own positions. ``before`` ``[N, V]``: the logits of the position just before the block, which belongs
    to a finished block (block-causal: it never sees the current one), so it is computed once per block."""
    return torch.cat([before[:, None], block_logits[:, :-1]], dim=1)


def _new_block_gumbel(cfg: BlockDecodeConfig, out_positions: torch.Tensor, vocab: int) -> torch.Tensor | None:
    return coupled_gumbel(out_positions, vocab, cfg.seed) if cfg.temperature > 0 else None


@dataclass
class _Stored:
    """Tokens whose KV a block's first forward stores ahead of the block (``[B, n]`` each): the prompt's complete
    blocks, left-padded (``valid``: real tokens; None if there are none), then each time the previous block."""

    ids: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor | None


@dataclass
class _Block:
    """The block all rows are decoding in lock-step. Tensors ``[B, L]`` unless noted."""

    index: int  # 0 = the block that holds the prompt's end
    tokens: torch.Tensor  # current contents (mask id where masked)
    masked: torch.Tensor  # bool, positions still to decode (all False for finished rows)
    positions: torch.Tensor  # absolute position ids
    out_positions: torch.Tensor  # index into the row's output (negative for prompt tokens in block 0)
    gumbel: torch.Tensor | None  # [B, L, V] coupled noise of these positions (None at temperature 0)


class _Run:
    """The state of one ``decode_blocks`` call, passed explicitly to the helpers below. Built from the prompts
    (layout: module docstring), it then changes only in ``cache``, ``pending``, ``before``, ``outputs``,
    ``finished`` and ``res`` (which doubles as the counters: nfe, nfe_per_row, commits / drafts per forward)."""

    def __init__(self, model: Transformer, prompt_ids, attention_mask, cfg: BlockDecodeConfig, on_step, drafter):
        self.L, self.mask_id, self.eos, self.rule = _resolve(model, cfg)
        self.model, self.cfg, self.on_step, self.drafter = model, cfg, on_step, drafter
        L, (B, P), dev = self.L, prompt_ids.shape, prompt_ids.device
        valid = torch.ones(B, P, dtype=torch.bool, device=dev) if attention_mask is None else attention_mask.bool()
        prompts = [prompt_ids[r][valid[r]] for r in range(B)]
        self.lens = torch.tensor([len(p) for p in prompts], device=dev)  # output position = position - length
        self.start = self.lens // L * L  # [B] block 0's position; the prompt's complete blocks before it are prefilled
        self.head = (self.lens - self.start).tolist()  # per row, prompt tokens in block 0 (unmasked, not output)
        Q = int(self.start.max())
        prefix = torch.full((B, Q), self.mask_id, dtype=torch.long, device=dev)
        prefix_valid = torch.zeros(B, Q, dtype=torch.bool, device=dev)
        self.head_tokens = torch.full((B, L), self.mask_id, dtype=torch.long, device=dev)  # block 0's initial state
        for r, p in enumerate(prompts):
            n = int(self.start[r])
            prefix[r, Q - n :], prefix_valid[r, Q - n :] = p[:n], True
            self.head_tokens[r, : self.head[r]] = p[n:]
        prefix_pos = (prefix_valid.long().cumsum(1) - 1).clamp(min=0)
        self.pending = _Stored(prefix, prefix_pos, prefix_valid if Q else None)  # the next first forward stores it
        self.before: torch.Tensor | None = None  # shifted targets: [B, V] logits of the position before the block
        n_blocks = max((h + cfg.max_new_tokens + L - 1) // L for h in self.head)
        # the last block is decoded whole: its positions count even past max_new_tokens
        check_positions(model, Q, L * n_blocks, "target", "max_new_tokens rounded up to whole blocks")
        self.cache = KVCache.for_model(model, B, capacity=Q + L * (n_blocks + 1), engine=cfg.engine)
        self.res = BlockDecodeResult(tokens=[], nfe=0, nfe_per_row=[0] * B, commits_per_forward=[])
        self.outputs: list[list[int]] = [[] for _ in range(B)]  # per row, every token of its completed blocks
        self.finished = torch.zeros(B, dtype=torch.bool, device=dev)  # eos in a completed block, or max_new reached


@torch.no_grad()
def decode_blocks(
    model: Transformer,
    prompt_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cfg: BlockDecodeConfig,
    *,
    on_step: Callable[[BlockStep], None] | None = None,
    drafter: BlockDrafter | None = None,
) -> BlockDecodeResult:
    """Decode a batch block by block with the KV cache; with a ``drafter``, speculatively (SPOT / Spiffy).

    prompt_ids: ``[B, P]`` left-padded; attention_mask: ``[B, P]`` (1 = real token; None = no padding).
    Rows run in lock-step over blocks; a row that finished (eos in a completed block, or max_new_tokens reached)
    stops committing while the others continue. ``on_step`` is called after every commit step with its
    BlockStep (with a drafter: once per walk step, so it sees the draft-free decoder's sequence of steps).

    With a drafter, the first forward of each block is plain; every later one verifies the root and the
    drafter's states together, then walks: apply the commit rule to the root's logits, move to the draft state
    equal to the result and apply the rule to its logits, and so on until no state matches. Every state walked
    through was computed exactly, so the output equals the draft-free decoder's at any temperature.
    """
    run = _Run(model, prompt_ids, attention_mask, cfg, on_step, drafter)
    index = 0
    try:
        while not bool(run.finished.all()):
            blk = _open_block(run, index)
            # Plain (drafters read the previous forward's logits; this block has none yet); it stores run.pending.
            stale = _plain_step(run, blk, first=True)
            while bool(blk.masked.any()):
                stale = _next_step(run, blk, stale)
            _close_block(run, blk)
            index += 1
    finally:  # a pooled static cache (and its CUDA graphs) serves the next decode
        run.cache.release()
    run.res.tokens = [_finish(o, run.eos, cfg.max_new_tokens) for o in run.outputs]
    return run.res


def _open_block(run: _Run, index: int) -> _Block:
    """Block ``index`` before its first forward: all masked (block 0: after the prompt tokens it holds), nothing
    masked for finished rows."""
    offs = torch.arange(run.L, device=run.start.device)
    tokens, head = run.head_tokens, torch.tensor(run.head, device=offs.device)
    if index > 0:  # only block 0 holds prompt tokens
        tokens, head = torch.full_like(tokens, run.mask_id), torch.zeros_like(head)
    masked = offs[None, :] >= head[:, None]
    positions = (run.start + index * run.L)[:, None] + offs
    out_positions = positions - run.lens[:, None]
    gumbel = _new_block_gumbel(run.cfg, out_positions, run.model.config.vocab_size)
    return _Block(index, tokens, masked & ~run.finished[:, None], positions, out_positions, gumbel)


def _close_block(run: _Run, blk: _Block) -> None:
    """Append the completed block to the outputs of unfinished rows, stop rows that are done, and hand the block to
    the next block's first forward to store (the last block's KV is never stored: nothing reads it)."""
    for r in (~run.finished).nonzero().flatten().tolist():
        out = run.outputs[r]
        out.extend(blk.tokens[r, run.head[r] if blk.index == 0 else 0 :].tolist())
        if len(out) >= run.cfg.max_new_tokens or (run.eos is not None and run.eos in out):
            run.finished[r] = True
    run.pending = _Stored(blk.tokens, blk.positions, None)


def _next_step(run: _Run, blk: _Block, stale: BlockStep) -> BlockStep:
    """One forward after the block's first: verify the drafter's states and walk them, or (no drafts) a plain step.
    Returns the new stale step."""
    drafts = _propose(run, blk, stale) if run.drafter is not None else None
    if drafts is None:
        return _plain_step(run, blk, first=False)
    _count_forward(run, blk, int(drafts.valid.sum()))
    all_logits = _verify_forward(run.model, blk.tokens, drafts, blk.positions, run.cache)
    if run.model.config.shift:
        B, n, L, V = all_logits.shape
        all_logits = _shift(all_logits.flatten(0, 1), run.before.repeat_interleave(n, 0)).view(B, n, L, V)
    stale, n_commits = _walk(run, blk, all_logits, drafts)
    run.res.commits_per_forward.append(n_commits)
    return stale


def _plain_step(run: _Run, blk: _Block, first: bool) -> BlockStep:
    """One forward over the block's current state and one commit step. The block's ``first`` forward runs
    ``run.pending`` (prompt prefill or previous block) ahead of the block, so storing it costs no extra forward."""
    _count_forward(run, blk, 0)
    ids, pos, attn = blk.tokens, blk.positions, None
    if first:
        pre = run.pending
        ids, pos = torch.cat([pre.ids, blk.tokens], dim=1), torch.cat([pre.positions, blk.positions], dim=1)
        attn = None if pre.valid is None else torch.cat([pre.valid, torch.ones_like(blk.masked)], dim=1)
    shifted, L = run.model.config.shift, run.L
    keep = L + 1 if shifted and ids.shape[1] > L else L
    logits = run.model(ids, position_ids=pos, attention_mask=attn, cache=run.cache, logits_to_keep=keep)
    # Keep the prefill / previous block just stored; the current block's KV is provisional.
    run.cache.crop(run.cache.length - L)
    if shifted:
        if first:  # the block's first forward also ran the position before the block
            # keep == L only when no prompt block was prefilled: then block position 0 holds a prompt token for
            # every row, nothing reads its prediction, and position 0's own logits fill the slot.
            run.before = logits[:, 0]
            logits = logits[:, keep - L :]
        logits = _shift(logits, run.before)
    step = _commit(run, blk, logits)
    run.res.commits_per_forward.append(int(step.commit.sum()))
    return step


def _count_forward(run: _Run, blk: _Block, n_drafts: int) -> None:
    """Count one target forward before it runs (``res.nfe - 1`` is then its index), with its draft states."""
    run.res.nfe += 1
    for r, had in enumerate(blk.masked.any(dim=1).tolist()):
        run.res.nfe_per_row[r] += int(had)
    run.res.drafts_per_forward.append(n_drafts)


def _commit(run: _Run, blk: _Block, logits: torch.Tensor, alive: torch.Tensor | None = None) -> BlockStep:
    """Apply the commit rule to ``logits`` ``[B, L, V]`` of the block's current state (only in ``alive`` rows),
    report the step, and advance the block. Returns the step."""
    masked = blk.masked if alive is None else blk.masked & alive[:, None]
    cfg, forward = run.cfg, run.res.nfe - 1
    step = _step(
        blk.index, forward, blk.tokens, masked, blk.positions, blk.out_positions, logits, cfg, run.rule, blk.gumbel
    )
    if cfg.log_steps:
        run.res.steps_log.append(_record(step))
    if run.on_step is not None:
        run.on_step(step)
    blk.tokens, blk.masked = step.committed, blk.masked & ~step.commit
    return step


def _propose(run: _Run, blk: _Block, stale: BlockStep) -> Drafts | None:
    """The drafter's states for the block's current state, given the last forward's (stale) logits; None if none."""
    t = time.perf_counter()
    ctx = DraftContext(
        root=blk.tokens,
        masked=blk.masked,
        active=blk.masked.any(dim=1),
        stale_logits=stale.logits,
        stale_masked=stale.masked,
        probs=stale_probs(stale.logits, run.cfg),
        scores=token_scores(stale.logits, stale.gumbel, run.cfg),
        out_positions=stale.out_positions,
        mask_id=run.mask_id,
        cfg=run.cfg,
    )
    drafts = run.drafter.propose(ctx)
    run.res.seconds_drafting += time.perf_counter() - t
    usable = drafts is not None and drafts.tokens.shape[1] > 0 and bool(drafts.valid.any())
    return drafts if usable else None


def _walk(run: _Run, blk: _Block, all_logits: torch.Tensor, drafts: Drafts) -> tuple[BlockStep, int]:
    """Follow the target's own commits through the verified states, advancing ``blk``. Returns (stale step, commits).

    ``all_logits`` ``[B, 1 + D, L, V]``: index 0 is the root. Rows advance in lock-step; a row stops at the first
    state that is not among its drafts (or when its block is complete)."""
    B = blk.tokens.shape[0]
    rows = torch.arange(B, device=blk.tokens.device)
    states = torch.cat([blk.tokens[:, None], drafts.tokens], dim=1)
    usable = torch.cat([torch.ones_like(drafts.valid[:, :1]), drafts.valid], dim=1)
    node = torch.zeros(B, dtype=torch.long, device=blk.tokens.device)
    alive = blk.masked.any(dim=1)
    n_commits, last = 0, None
    while bool(alive.any()):
        step = _commit(run, blk, all_logits[rows, node], alive)
        last = step if last is None else _merge_stale(last, step, alive)
        n_commits += int(step.commit.sum())
        same = (states == blk.tokens[:, None]).all(dim=-1) & usable
        alive = alive & same.any(dim=1) & blk.masked.any(dim=1)
        node = same.long().argmax(dim=1)
    return last, n_commits


def _merge_stale(last: BlockStep, step: BlockStep, alive: torch.Tensor) -> BlockStep:
    """Per row, the latest step the row took part in (its logits are that row's stale distribution)."""
    # Fields that differ per row within a walk; the rest (block, forward, positions, noise) are shared: from `step`.
    merged = {}
    for name in ("tokens", "masked", "logits", "confidence", "candidates", "commit", "committed"):
        new = getattr(step, name)
        rows = alive.view(-1, *[1] * (new.dim() - 1))
        merged[name] = torch.where(rows, new, getattr(last, name))
    return replace(step, **merged)


@torch.no_grad()
def decode_blocks_reference(
    model: Transformer,
    prompt_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cfg: BlockDecodeConfig,
    *,
    on_step: Callable[[BlockStep], None] | None = None,
) -> BlockDecodeResult:
    """Slow reference for one row (``prompt_ids`` ``[1, P]``, ``attention_mask`` ``[1, P]`` or None): no cache,
    every forward runs the whole sequence (prompt + finished blocks + current block) block-causally from scratch."""
    L, mask_id, eos, rule = _resolve(model, cfg)
    if prompt_ids.shape[0] != 1:
        raise ValueError("decode_blocks_reference decodes one row; loop over rows")
    dev = prompt_ids.device
    seq = prompt_ids[0][attention_mask[0].bool()] if attention_mask is not None else prompt_ids[0]
    seq, P = seq.tolist(), len(seq)
    res = BlockDecodeResult(tokens=[], nfe=0, nfe_per_row=[0], commits_per_forward=[])
    block = 0
    while True:
        begin = len(seq) // L * L
        known = len(seq) - begin
        tokens = torch.tensor([seq[begin:] + [mask_id] * (L - known)], device=dev)
        masked = torch.arange(L, device=dev)[None] >= known
        pos = begin + torch.arange(L, device=dev)[None]
        while bool(masked.any()):
            ids = torch.cat([torch.tensor([seq[:begin]], dtype=torch.long, device=dev), tokens], dim=1)
            logits = model(ids, mode="block_causal")
            if model.config.shift:  # position begin - 1 predicts the block's first token (absent: a prompt token)
                logits = _shift(logits[:, begin:], logits[:, max(begin - 1, 0)])
            else:
                logits = logits[:, begin:]
            gumbel = _new_block_gumbel(cfg, pos - P, model.config.vocab_size)
            step = _step(block, res.nfe, tokens, masked, pos, pos - P, logits, cfg, rule, gumbel)
            res.nfe += 1
            res.nfe_per_row[0] += 1
            res.commits_per_forward.append(int(step.commit.sum()))
            if cfg.log_steps:
                res.steps_log.append(_record(step))
            if on_step is not None:
                on_step(step)
            tokens, masked = step.committed, masked & ~step.commit
        seq = seq[:begin] + tokens[0].tolist()
        block += 1
        out = seq[P:]
        if len(out) >= cfg.max_new_tokens or (eos is not None and eos in out):
            break
    res.tokens = [_finish(out, eos, cfg.max_new_tokens)]
    return res
