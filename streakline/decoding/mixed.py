"""Prompt lookup and a DFlash drafter, chosen per row and cycle by measured gain and cost (``decoder=dflash_lookup``).

On a small verifier neither drafter wins everywhere: prompt lookup (``ngram.py``) drafts for free and is right most
of the time on code that repeats its context, but finds a match in only part of the cycles (27% on chat in the
SmolLM2 study); a trained DFlash drafter drafts every cycle but costs a forward, and a window of 9 costs more to
verify than one token. So each cycle, for each row, this drafter weighs three options by the tokens each is expected
to emit per second it costs:

    none     a plain verifier step: 1 token for v(0)
    lookup   the first m tokens of lookup's match (when it has one), m up to its length: 1 + E_lookup(m) for v(m)
    model    the first m tokens of the DFlash drafter's block, m up to gamma: 1 + E_model(m) tokens for v(m) + d

Each option's width m is chosen with it (on the eager engine, whose cycles may be narrower than gamma): where the
verify forward grows steeply with its width (nine rows cost 1.7 vanilla steps on two AVX2 cores, where one costs
one) and the later drafts are rarely accepted, verifying only the first few is worth more per second than all.

``v(w)`` is the verify forward of the pending token and w drafts, fitted as a line in w from the cycles the decoder
has timed (``observe``); ``d`` is what a DFlash cycle's drafting costs over a lookup cycle's (the drafter's forward,
and the context rows it absorbs first). Before any timing (a GPU decode without ``timing``) the costs are priors in
vanilla steps (``DRAFT_COST``, ``VERIFY_SLOPE``), or the fixed values a user gives (``decoder.draft_cost``,
``decoder.verify_cost``). ``E(m) = sum_{j<=m} prod_{i<=j} a_i`` from each drafter's per-position acceptance
``a_i`` (the share of cycles that offered position i with the ones before it accepted, in which it was accepted):
counted over every row this drafter has decoded, with a slow decay, and for each row over its own recent cycles,
which lean it towards what works on its text. An option that has not been tried by a row for ``PROBE_EVERY`` cycles
is tried once, so a drafter that got better is seen; each probe after which the option still loses doubles that
row's wait for the next (up to ``PROBE_MAX``), and a cycle it wins on its merits brings the wait back, so a drafter
that never pays costs a probe in ``PROBE_MAX`` cycles, not one in ``PROBE_EVERY``.

Lossless as every drafter: the choice reads only what earlier cycles emitted (and clock readings), never the
current cycle's draws, so the verified tokens are drawn from the q handed to the rule, row by row. A lookup row's
draft is padded to the cycle's width by repeating its last token (q one-hot); a row that chose nothing while others
draft gets its pending token repeated, one-hot too. ``tests/decoding/test_mixed.py`` checks greedy equality,
a chi-square test at T=1, and the choice on inputs where each option must win.

The DFlash drafter's context must hold every committed token whichever option proposed it, but a cycle that does
not draft with the model does not need it yet: the verifier's states of those tokens wait in ``pending`` and enter
the context in one forward when the model next drafts (fewer, larger matmuls than one per cycle).

    drafter = MixedDrafter(DFlashDrafter(model, temperature=0.0), NgramDrafter(vocab_size=V))
    generate(verifier, prompts, SpecConfig(max_new_tokens=128, gamma=8), drafter=drafter)

One chain a cycle (K = 1). On the eager engine a cycle without a model row is as wide as its longest lookup draft
(``ngram.py``'s ragged widths: 0 is a plain verifier step); a cycle with one is ``gamma`` wide.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .drafters import DFlashDrafter
from .ngram import NgramDrafter
from .proposal import Proposal

OPTIONS = ("none", "lookup", "model")
PROBE_EVERY = 8  # an option a row has not tried for this many cycles is tried once (it may have got better)
PROBE_MAX = 64  # the longest wait: probes that find the option still losing double the wait up to it
# Priors, in vanilla steps, until the decoder has timed a cycle: SmolLM2-135M on 2 CPU cores verifies a window of 9
# at 1.10-1.15 steps and drafts with smol-dflash at 0.27-0.28 (docs/smol.md); on a GPU both are far smaller
VERIFY_SLOPE = 0.02  # a verify forward's cost per drafted token
DRAFT_COST = 0.3  # the DFlash drafter's forward (and its context rows) per cycle
PRIOR_ACCEPT = {"lookup": 0.6, "model": 0.5}  # a_i before anything was counted
PRIOR_COUNT = 2.0  # the weight of that prior, in cycles
ROW_PRIOR = 4.0  # the weight, in cycles, of the pooled rate in a row's own estimate
POOL_DECAY = 0.995  # per observed cycle: the pooled counts follow a drift (another benchmark) within a few hundred
ROW_DECAY = 0.9  # a row's own counts: its last ten cycles or so
COST_DECAY = 0.98  # the timings' weights


class Acceptance:
    """Per-position acceptance counts of one drafter, decayed: ``offered[i]`` cycles drafted position i + 1 with every
    position before it accepted, ``accepted[i]`` of them accepted it too."""

    def __init__(self, gamma: int, decay: float, prior: float, weight: float) -> None:
        self.decay, self.prior, self.weight = decay, prior, weight
        self.offered = [0.0] * gamma
        self.accepted = [0.0] * gamma

    def grow(self, gamma: int) -> None:
        extra = gamma - len(self.offered)
        if extra > 0:
            self.offered += [0.0] * extra
            self.accepted += [0.0] * extra

    def count(self, drafted: int, accepted: int) -> None:
        """One cycle that drafted ``drafted`` tokens of which the first ``accepted`` were accepted."""
        self.grow(drafted)
        self.offered = [x * self.decay for x in self.offered]
        self.accepted = [x * self.decay for x in self.accepted]
        for i in range(min(accepted + 1, drafted)):
            self.offered[i] += 1.0
            self.accepted[i] += float(i < accepted)

    def rates(self, base: list[float] | None = None) -> list[float]:
        """``a_i`` per position: the counts over a prior of ``weight`` cycles at ``base`` (a pooled estimate) or at
        ``prior``."""
        return [
            (a + self.weight * (self.prior if base is None else base[i])) / (o + self.weight)
            for i, (o, a) in enumerate(zip(self.offered, self.accepted, strict=True))
        ]


def expected_accepted(rates: list[float], m: int) -> float:
    """``sum_{j<=m} prod_{i<=j} a_i``: the accepted drafts a draft of ``m`` tokens expects."""
    total, streak = 0.0, 1.0
    for a in rates[:m]:
        streak *= a
        total += streak
    return total


@dataclass
class Costs:
    """What a cycle costs, in seconds once the decoder has timed cycles, else in vanilla steps (the priors); only
    ratios between options are used, so the unit does not matter as long as one is used throughout."""

    verify_slope: float | None = None  # fixed: the verify cost per drafted token in vanilla steps (decoder.verify_cost)
    draft_cost: float | None = None  # fixed: the DFlash cycle's drafting in vanilla steps (decoder.draft_cost)

    def __post_init__(self) -> None:
        for name in ("verify_slope", "draft_cost"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"decoder.{name.replace('_slope', '_cost')} must be >= 0 vanilla steps, got {value}")
        # decayed sums of (w, seconds) over timed verify forwards, for the line v(w) = a + b w
        self.n = self.sw = self.sww = self.sv = self.swv = 0.0
        # decayed means of the draft phase's seconds in cycles with and without a model draft
        self.draft_with = self.draft_without = None
        self.timed = 0  # cycles observed

    def observe(self, width: int, draft_s: float, verify_s: float, model: bool) -> None:
        d = COST_DECAY
        self.timed += 1
        self.n, self.sw, self.sww = d * self.n + 1, d * self.sw + width, d * self.sww + width * width
        self.sv, self.swv = d * self.sv + verify_s, d * self.swv + width * verify_s
        key = "draft_with" if model else "draft_without"
        old = getattr(self, key)
        setattr(self, key, draft_s if old is None else d * old + (1 - d) * draft_s)

    def _line(self) -> tuple[float, float]:
        """``(a, b)`` of v(w) = a + b w: fitted where the timed widths spread, else through their mean at the slope
        the prior (or the fixed setting) gives relative to a."""
        slope = VERIFY_SLOPE if self.verify_slope is None else self.verify_slope
        if self.n == 0:
            return 1.0, slope
        mw, mv = self.sw / self.n, self.sv / self.n
        var = self.sww / self.n - mw * mw
        if self.verify_slope is None and var > 0.5:  # widths spread: the data give the slope
            b = (self.swv / self.n - mw * mv) / var
            a = mv - b * mw
            if a > 0 and b >= 0:
                return a, b
        a = mv / (1 + slope * mw)
        return a, a * slope

    def verify(self, width: int) -> float:
        a, b = self._line()
        return a + b * width

    def draft(self) -> float:
        """What drafting with the model adds to a cycle."""
        a, _ = self._line()
        if self.draft_cost is not None:
            return self.draft_cost * a
        if self.n == 0 or self.draft_with is None:
            return DRAFT_COST * a
        return max(0.0, self.draft_with - (self.draft_without or 0.0))


class MixedDrafter:
    """Prompt lookup, a DFlash drafter or nothing, per row and cycle, whichever is expected to emit the most tokens
    per second (module docstring)."""

    kind = "dflash_lookup"

    def __init__(
        self,
        model_drafter: DFlashDrafter,
        lookup: NgramDrafter,
        *,
        draft_cost: float | None = None,
        verify_cost: float | None = None,
    ) -> None:
        if not isinstance(model_drafter, DFlashDrafter):
            raise ValueError(f"decoder=dflash_lookup drafts with a DFlash drafter, got {type(model_drafter).__name__}")
        self.model_drafter, self.lookup = model_drafter, lookup
        self.feature_layers = model_drafter.feature_layers
        self.allowed: torch.Tensor | None = None  # the protocol's field; both draft in the verifier's vocabulary
        self.costs = Costs(verify_slope=verify_cost, draft_cost=draft_cost)
        # pooled over every row and decode (a drafter serves a whole benchmark): the prior of each row's estimate
        self.pooled = {o: Acceptance(0, POOL_DECAY, PRIOR_ACCEPT[o], PRIOR_COUNT) for o in ("lookup", "model")}
        self.cycles = self.lookup_cycles = 0  # cycles, and those with no DFlash forward
        self.chosen = dict.fromkeys(OPTIONS, 0)  # row-cycles per option
        self._state(0)

    def _state(self, batch_size: int) -> None:
        self.choice: list[str] = ["none"] * batch_size  # what each row drafted with last cycle
        self.offered = [0] * batch_size  # how many drafts it offered
        self.width = [0] * batch_size  # the width its option was chosen at (drafts verified)
        self.wait = [dict.fromkeys(OPTIONS, PROBE_EVERY) for _ in range(batch_size)]  # cycles before a probe
        self.probing = [False] * batch_size  # whether the last choice was a probe
        self.rows = [self._row() for _ in range(batch_size)]
        self.idle = [dict.fromkeys(OPTIONS, 0) for _ in range(batch_size)]  # cycles since each option was tried
        self.pending: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # states not yet in the DFlash context
        self.last_model = False

    @staticmethod
    def _row() -> dict[str, Acceptance]:
        """A row's own counts (their prior is the pooled rate, passed in ``rates``)."""
        return {o: Acceptance(0, ROW_DECAY, 0.0, ROW_PRIOR) for o in ("lookup", "model")}

    def reset(self, batch_size: int, capacity: int, engine: str | None = None) -> None:
        self.model_drafter.reset(batch_size, capacity, engine=engine)
        self.lookup.reset(batch_size, capacity, engine=engine)
        self._state(batch_size)

    def keep_rows(self, index: torch.Tensor) -> None:
        self.model_drafter.keep_rows(index)
        self.lookup.keep_rows(index)
        keep = index.tolist()
        self.choice = [self.choice[i] for i in keep]
        self.offered = [self.offered[i] for i in keep]
        self.width = [self.width[i] for i in keep]
        self.wait = [self.wait[i] for i in keep]
        self.probing = [self.probing[i] for i in keep]
        self.rows = [self.rows[i] for i in keep]
        self.idle = [self.idle[i] for i in keep]
        self.pending = [(f[index], None if v is None else v[index]) for f, v in self.pending]

    def release(self) -> None:
        self.model_drafter.release()
        self.lookup.release()
        self.pending = []

    def observe(self, width: int, draft_s: float | None, verify_s: float | None) -> None:
        """The decoder's timing of the cycle just verified (``speculative.generate``; None where it does not time)."""
        if draft_s is not None and verify_s is not None:
            self.costs.observe(width, draft_s, verify_s, self.last_model)

    def _learn(self, new_ids: torch.Tensor, new_valid: torch.Tensor | None) -> None:
        """The tokens cached since the last call are the last cycle's accepted drafts and the token after them."""
        counts = [new_ids.shape[1]] * new_ids.shape[0] if new_valid is None else new_valid.sum(1).tolist()
        for b, n in enumerate(counts):
            option, m = self.choice[b], self.offered[b]
            if option == "none" or m == 0:
                continue
            accepted = min(int(n) - 1, m)  # a lookup row's padding may be accepted too; it is not its draft
            self.pooled[option].count(m, accepted)
            self.rows[b][option].count(m, accepted)

    def _accept(self, b: int, option: str, m: int) -> list[float]:
        """Row ``b``'s per-position acceptance of ``option`` over ``m`` drafts: its own counts over the pooled rate."""
        pooled = self.pooled[option]
        pooled.grow(m)
        row = self.rows[b][option]
        row.grow(m)
        return row.rates(pooled.rates())

    def rates(self, b: int, option: str, m: int) -> tuple[float, float]:
        """``(tokens, cost)`` row ``b`` expects of ``option`` with ``m`` drafts."""
        if option == "none":
            return 1.0, self.costs.verify(0)
        tokens = 1.0 + expected_accepted(self._accept(b, option, m), m)
        cost = self.costs.verify(m) + (self.costs.draft() if option == "model" else 0.0)
        return tokens, cost

    def best_width(self, b: int, option: str, longest: int) -> tuple[int, float]:
        """``(m, tokens per cost)`` of row ``b``'s best width for ``option``, m from 1 to ``longest``."""
        rates = self._accept(b, option, longest)
        extra = self.costs.draft() if option == "model" else 0.0
        best, best_rate, tokens, streak = longest, -1.0, 1.0, 1.0
        for m in range(1, longest + 1):
            streak *= rates[m - 1]
            tokens += streak
            cost = self.costs.verify(m) + extra
            rate = tokens / cost if cost > 0 else float("inf")
            if rate > best_rate + 1e-12:  # ties: the narrower window
                best, best_rate = m, rate
        return best, best_rate

    def choose(self, b: int, match: int, gamma: int, trim: bool = True) -> tuple[str, int]:
        """Row ``b``'s option and width this cycle, lookup having matched ``match`` tokens (0: none). ``trim``:
        whether the cycle may be narrower than the option's longest (the eager engine); else the widths are the
        longest. An option a row has not tried for its wait is probed at its best width."""
        longest = {"model": gamma} | ({"lookup": match} if match else {})
        picks = {"none": (0, 1.0 / max(self.costs.verify(0), 1e-12))}
        for option, m in longest.items():
            if trim:
                picks[option] = self.best_width(b, option, m)
            else:
                tokens, cost = self.rates(b, option, m)
                picks[option] = (m, tokens / cost if cost > 0 else float("inf"))
        merit = max(picks, key=lambda o: (picks[o][1], o == "none"))  # ties: the plain step
        stale = [o for o in longest if self.idle[b][o] + 1 >= self.wait[b][o]]
        previous = self.choice[b] if self.probing[b] else None
        if previous in longest and previous != merit:  # the last probe found it still losing: wait longer
            self.wait[b][previous] = min(PROBE_MAX, 2 * self.wait[b][previous])
        if merit != "none":
            self.wait[b][merit] = PROBE_EVERY  # it wins on its merits: probes of it back to the shortest wait
        self.probing[b] = bool(stale) and merit not in stale
        option = max(stale, key=lambda o: self.idle[b][o]) if self.probing[b] else merit  # the longest-untried
        return option, picks[option][0]

    def decide(self, b: int, match: int, gamma: int) -> str:
        """Row ``b``'s option this cycle (``choose`` without the width)."""
        return self.choose(b, match, gamma)[0]

    @torch.no_grad()
    def propose(
        self, new_ids, new_valid, *, gamma: int, K: int, generator, iid: bool, features=None, feature_valid=None
    ) -> Proposal:
        if K != 1:
            raise ValueError(f"dflash_lookup proposes one chain per cycle (K=1), got K={K}")
        if self.lookup.vocab_size is None:
            raise ValueError("dflash_lookup needs the verifier's vocab_size for lookup's one-hot q")
        if features is None:
            raise ValueError("a DFlash drafter drafts from the verifier's layer states: pass features (generate does)")
        self.model_drafter.check_gamma(gamma)
        self.pending.append((features, feature_valid))
        self._learn(new_ids, new_valid)
        drafts = self.lookup.lookups(new_ids, new_valid, gamma)
        self.cycles += 1
        picks = [self.choose(b, len(d), gamma, trim=self.lookup.trim) for b, d in enumerate(drafts)]
        self.choice = [option for option, _ in picks]
        self.width = [m for _, m in picks]
        for b, option in enumerate(self.choice):
            self.chosen[option] += 1
            for o in OPTIONS:
                self.idle[b][o] = 0 if o == option else self.idle[b][o] + 1
        use_model = [c == "model" for c in self.choice]
        drafts = [d[:m] if c == "lookup" else d[:0] for d, c, m in zip(drafts, self.choice, self.width, strict=True)]
        self.last_model = any(use_model)
        if not self.last_model:  # lookup or nothing: no drafter forward, on the eager engine as wide as the longest
            self.lookup_cycles += 1  # lookup draft (0: a plain verifier step)
            width = max(len(d) for d in drafts) if self.lookup.trim else gamma
            self.offered = [len(d) for d in drafts]
            tokens = self.lookup.chains(drafts, width).to(new_ids.device)
            return Proposal(tokens=tokens, q=None, forwards=0, point_mass_vocab=self.lookup.vocab_size)
        self._absorb()
        # the cycle's width: the widest model row's (the block is drafted whole and its first W verified), at least
        # every lookup row's; the whole block where the engine's cycles are gamma wide
        width = max([m for m, u in zip(self.width, use_model, strict=True) if u] + [len(d) for d in drafts])
        width = width if self.lookup.trim else gamma
        self.offered = [width if m else len(d) for m, d in zip(use_model, drafts, strict=True)]
        model = self.model_drafter.draft(new_ids[:, -1], gamma=gamma, K=1, generator=generator, iid=iid)
        if width < gamma:
            model = Proposal(tokens=model.tokens[..., :width], q=model.q[:, :width], forwards=model.forwards)
        if all(use_model):
            return model
        rows = torch.tensor(use_model, device=model.tokens.device)
        looked = self.lookup.chains(drafts, width).to(model.tokens.device)  # no lookup draft: the pending token
        tokens = torch.where(rows[:, None, None], model.tokens, looked)
        point = torch.zeros_like(model.q).scatter_(-1, looked[:, 0, :, None], 1.0)
        q = torch.where(rows[:, None, None], model.q, point)
        return Proposal(tokens=tokens, q=q, forwards=1)

    def _absorb(self) -> None:
        """The waiting states into the DFlash context, in one forward: each chunk is right-aligned with its own
        validity, so their concatenation is a ragged segment whose holes the context's positions skip."""
        if len(self.pending) == 1:
            features, valid = self.pending[0]
        else:
            features = torch.cat([f for f, _ in self.pending], dim=1)
            valid = None
            if any(v is not None for _, v in self.pending):
                valid = torch.cat(
                    [torch.ones(f.shape[:2], dtype=torch.bool, device=f.device) if v is None else v
                     for f, v in self.pending], dim=1)  # fmt: skip
        self.pending = []
        self.model_drafter.absorb(features, valid)
