"""The vocabulary of the block-diffusion decoders: what one target forward says about a block, how its logits
become per-position tokens and confidences, which positions a commit rule commits, and what a block drafter
(SPOT, Spiffy) sees and proposes.

``block_diffusion.py`` is the decode loop that uses these (and re-exports them, so existing imports keep working);
this module holds the parts that trace collection (``alignment/block_traces.py``) and the drafters
(``spot.py``, ``spiffy.py``) share with it:

- ``BlockDecodeConfig``: the settings of one decode; ``BlockStep``: one forward's view of the current block;
- ``score_logits`` / ``token_scores`` / ``stale_probs`` / ``stale_topk``: logits to tokens, confidences, ranks and
  the stale distribution a drafter reads, at temperature 0 and under coupled noise (``coupled_gumbel``,
  docs/algorithms.md section 7);
- ``COMMIT_RULES``: ``static`` (the most confident masked position) and ``threshold`` (Fast-dLLM: every masked
  position at confidence >= tau, and at least one);
- ``DraftContext`` / ``Drafts`` / ``BlockDrafter``: the drafter interface.

Tests: ``python -m pytest tests/decoding/test_block_diffusion.py tests/decoding/test_block_verify.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class BlockDecodeConfig:
    """Settings of one block-diffusion decode (keyword-only; ``max_new_tokens`` is required)."""

    rule: str = "static"  # a key of COMMIT_RULES
    threshold: float = 0.9  # tau of the threshold rule
    max_new_tokens: int
    block_size: int | None = None  # None: the model's block size (it must equal it)
    eos_token_id: int | None = None  # None: the model config's eos (if that is None too, never stop early)
    temperature: float = 0.0  # > 0: coupled-noise sampling keyed by (seed, output position)
    seed: int = 0  # the coupled-noise key (ignored at temperature 0)
    log_steps: bool = False  # fill BlockDecodeResult.steps_log (costs a host sync per forward)
    engine: str | None = None  # KV cache engine (models/kv_cache.py ENGINES); None: the model's, else auto


@dataclass
class BlockStep:
    """What one forward said about the current block of every row; given to commit rules and ``on_step``.

    All tensors are ``[B, L]`` except ``logits`` ``[B, L, V]``. ``commit`` / ``committed`` are filled after the rule.
    """

    block: int  # lock-step block index (0 = the block that holds the prompt's end)
    forward: int  # 0-based index of this forward in the decode
    tokens: torch.Tensor  # block contents before this step's commits (mask id where masked)
    masked: torch.Tensor  # bool, positions still to decode (all False for finished rows)
    positions: torch.Tensor  # absolute position ids
    out_positions: torch.Tensor  # index into the row's output (negative for prompt tokens in block 0)
    logits: torch.Tensor
    confidence: torch.Tensor
    candidates: torch.Tensor  # the token each position would take
    gumbel: torch.Tensor | None = None  # [B, L, V] coupled noise of these positions (None at temperature 0)
    commit: torch.Tensor | None = None  # bool, positions committed by this step
    committed: torch.Tensor | None = None  # block contents after this step

    @property
    def probs(self) -> torch.Tensor:
        """``[B, L, V]`` distributions of this forward (the stale distribution a SPOT drafter reads)."""
        return torch.softmax(_wide(self.logits), dim=-1)


def _wide(logits: torch.Tensor) -> torch.Tensor:
    # Confidences are compared across positions, so keep at least fp32 (and fp64 when the model runs in it).
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def coupled_gumbel(out_positions: torch.Tensor, vocab_size: int, seed: int) -> torch.Tensor:
    """The coupled-noise table's rows for ``out_positions`` ``[B, L]``: ``[B, L, V]`` standard Gumbel noise.

    Row ``a`` of the table depends on (seed, a) only: each output position seeds its own counter-based CPU
    generator, so no table is stored, every device and batch layout draws the same numbers, and two rows of a
    batch at the same output position share noise (the decode of a prompt never depends on its batch-mates).
    Prompt positions (negative ``a``) get noise too; nothing reads it, since they are never masked.
    """
    flat = out_positions.flatten().tolist()
    rows: dict[int, torch.Tensor] = {}
    for a in set(flat):
        gen = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + a * 0xBF58476D1CE4E5B9) % (1 << 63))
        u = torch.rand(vocab_size, generator=gen, dtype=torch.float64).clamp_(1e-300, 1.0 - 1e-16)
        rows[a] = -torch.log(-torch.log(u))
    table = torch.stack([rows[a] for a in flat]).view(*out_positions.shape, vocab_size)
    return table.to(out_positions.device)


def score_logits(
    logits: torch.Tensor, gumbel: torch.Tensor | None, cfg: BlockDecodeConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map a forward's logits ``[B, L, V]`` to (confidence ``[B, L]``, token ``[B, L]``) per position.

    Temperature 0: token = argmax (ties to the lowest id), confidence = its probability.
    Temperature T > 0 (coupled noise, docs/algorithms.md section 7): token = argmax_v (log p(v)/T + G[a, v]) with
    ``gumbel`` ``[B, L, V]`` the table rows of these positions, confidence = softmax(logits / T) at that token.
    Given the noise this is a deterministic function of the logits, which is what lets a speculative decoder
    reproduce the draft-free sampler token for token.
    """
    wide = _wide(logits)
    if cfg.temperature <= 0:
        conf, tok = torch.softmax(wide, dim=-1).max(dim=-1)
        return conf, tok
    logp = torch.log_softmax(wide / cfg.temperature, dim=-1)
    tok = (logp + gumbel.to(logp.dtype)).argmax(dim=-1)
    return logp.gather(-1, tok[..., None]).squeeze(-1).exp(), tok


def token_scores(logits: torch.Tensor, gumbel: torch.Tensor | None, cfg: BlockDecodeConfig) -> torch.Tensor:
    """``[B, L, V]`` scores whose argmax is the token ``score_logits`` picks: log-probs at temperature T, plus the
    coupled noise when T > 0. Drafters rank token hypotheses by them (rank 0 = the token the target would take)."""
    wide = _wide(logits)
    if cfg.temperature <= 0:
        return torch.log_softmax(wide, dim=-1)
    return torch.log_softmax(wide / cfg.temperature, dim=-1) + gumbel.to(wide.dtype)


def stale_probs(logits: torch.Tensor, cfg: BlockDecodeConfig) -> torch.Tensor:
    """``[B, L, V]`` softmax(logits / T) (T = 1 at temperature 0): the probabilities drafters read."""
    wide = _wide(logits)
    return torch.softmax(wide / cfg.temperature if cfg.temperature > 0 else wide, dim=-1)


def stale_topk(scores: torch.Tensor, probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k tokens per position ranked by ``scores`` (``token_scores``) and their ``probs``: both ``[..., k]``.
    The one definition of a drafter's stale view, shared by trace collection and the SPOT / Spiffy drafters."""
    ids = scores.topk(min(k, scores.shape[-1]), dim=-1).indices
    return ids, probs.gather(-1, ids)


CommitRule = Callable[[BlockStep, BlockDecodeConfig], tuple[torch.Tensor, torch.Tensor]]


def _most_confident(step: BlockStep) -> torch.Tensor:
    """``[B, L]`` bool: the single most confident masked position per row (ties to the lowest position)."""
    conf = step.confidence.masked_fill(~step.masked, float("-inf"))
    pick = torch.zeros_like(step.masked)
    pick.scatter_(1, conf.argmax(dim=1, keepdim=True), True)
    return pick & step.masked


def commit_static(step: BlockStep, cfg: BlockDecodeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One commit per forward: the most confident masked position. Returns (commit ``[B, L]``, tokens ``[B, L]``)."""
    return _most_confident(step), step.candidates


def commit_threshold(step: BlockStep, cfg: BlockDecodeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Every masked position with confidence >= tau, and at least the most confident one."""
    over = step.masked & (step.confidence >= cfg.threshold)
    return over | _most_confident(step), step.candidates


# A rule returns which positions to commit and with which tokens (a verifying rule may commit tokens that are
# not the root's candidates); the decoder only ever writes masked positions of unfinished rows.
COMMIT_RULES: dict[str, CommitRule] = {"static": commit_static, "threshold": commit_threshold}


@dataclass
class DraftContext:
    """What a block drafter (SPOT, Spiffy) sees before a verification forward. Tensors ``[B, L]`` unless noted.

    The root is the real current state; the stale distribution comes from the last forward, which ran on a state
    one commit step behind the root (``stale_masked`` marks that state's masked positions). A drafter must not
    look at the root's own logits: they do not exist yet, they come out of the verification forward.
    """

    root: torch.Tensor  # block contents of the current state (mask id where masked)
    masked: torch.Tensor  # bool, positions the root still has to decode
    active: torch.Tensor  # [B] bool, rows with masked positions left in this block
    stale_logits: torch.Tensor  # [B, L, V]
    stale_masked: torch.Tensor
    probs: torch.Tensor  # [B, L, V] softmax(stale_logits / T) (T = 1 at temperature 0)
    scores: torch.Tensor  # [B, L, V] token_scores of the stale logits (argmax = the token the target would take)
    out_positions: torch.Tensor
    mask_id: int
    cfg: BlockDecodeConfig


@dataclass
class Drafts:
    """Hypothetical states to verify in one forward: ``tokens`` ``[B, D, L]`` full block contents (the root's
    committed positions plus some drafted commits, mask id elsewhere), ``valid`` ``[B, D]`` (False = padding)."""

    tokens: torch.Tensor
    valid: torch.Tensor


class BlockDrafter:
    """Interface of SPOT's tree drafter and Spiffy's graph drafter: ``propose`` returns the states to verify (or
    None to run a plain forward). Any proposal is safe: the walk only follows states equal to the target's own."""

    def propose(self, ctx: DraftContext) -> Drafts | None:
        raise NotImplementedError
