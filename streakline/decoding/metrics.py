"""What every decode run measures (issue 4, docs/algorithms.md section 3) and how the numbers are defined.

- ``nfe``: verifier forwards, the prompt prefill included (a batch forward counts once).
- ``cycles``: verify cycles summed over rows (a row takes part in a cycle until it stops); each emits
  ``accepted + 1`` tokens, so ``tokens_per_verifier_call = new_tokens / cycles`` (1.0 for vanilla).
- ``accepted_per_cycle``: accepted draft tokens per cycle, the *mean streak* (excludes the bonus token).
- ``alpha[j]``: per-position acceptance, (#accepted at slot j+1) / (#cycles that reached slot j+1), Figure 2.
- ``chosen``: how often each chain index was selected (self-selection at work when chains other than 0 win).
- ``time_s``: wall-clock split into prefill / draft / verify / accept / commit (on a GPU only with
  ``SpecConfig.timing``, which synchronises after each phase; zeros otherwise).

    m = DecodeMetrics(gamma=8, K=4); ...; m.to_dict()
"""

from __future__ import annotations

from dataclasses import dataclass, field

PHASES = ("prefill", "draft", "verify", "accept", "commit")


@dataclass
class DecodeMetrics:
    gamma: int = 0
    K: int = 1
    batch_size: int = 1
    new_tokens: int = 0
    nfe: int = 0
    drafter_forwards: int = 0
    cycles: int = 0
    accepted: int = 0
    reached_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    chosen: list[int] = field(default_factory=list)
    time_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    wall_s: float = 0.0

    def __post_init__(self) -> None:
        self.reached_at = self.reached_at or [0] * self.gamma
        self.accepted_at = self.accepted_at or [0] * self.gamma
        self.chosen = self.chosen or [0] * self.K

    def record_cycle(self, accepted: int, chosen: int = 0, drafted: int | None = None) -> None:
        """One row's verification: ``accepted`` of chain ``chosen``'s ``drafted`` draft tokens (None: gamma)
        survived. A slot past what was drafted is not reached (a short ngram draft)."""
        self.cycles += 1
        self.chosen[chosen] += 1
        self.accepted += accepted
        width = self.gamma if drafted is None else min(drafted, self.gamma)
        for j in range(min(accepted + 1, width)):
            self.reached_at[j] += 1
            if j < accepted:
                self.accepted_at[j] += 1

    @property
    def alpha(self) -> list[float | None]:
        return [a / r if r else None for a, r in zip(self.accepted_at, self.reached_at, strict=True)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_verifier_call(self) -> float:
        return self.new_tokens / self.cycles if self.cycles else 0.0

    @property
    def accepted_per_cycle(self) -> float:
        return self.accepted / self.cycles if self.cycles else 0.0

    def to_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "tokens_per_s": self.tokens_per_s,
            "nfe": self.nfe,
            "drafter_forwards": self.drafter_forwards,
            "cycles": self.cycles,
            "tokens_per_verifier_call": self.tokens_per_verifier_call,
            "accepted_per_cycle": self.accepted_per_cycle,
            "alpha": self.alpha,
            "chosen": list(self.chosen),
            "gamma": self.gamma,
            "K": self.K,
            "batch_size": self.batch_size,
            "wall_s": self.wall_s,
            "time_s": dict(self.time_s),
        }
