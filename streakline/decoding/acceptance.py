"""Acceptance rules: how the verifier's distributions decide which draft tokens survive.

docs/algorithms.md sections 2-3 state the rules and why each one is lossless.

Every rule is registered in ``ACCEPTANCE_RULES`` with one signature,

    out = rule.verify(logits, drafts, q, temperature=T, selection="streak_score", generator=g)   # -> VerifyOut

logits ``[B, K, G+1, V]`` (chain k's row j is ``p_{j+1}`` given the prefix and the chain's first j tokens; row G is
the bonus distribution), drafts ``[B, K, G]``, q ``[B, G, V]`` (the drafter's distribution, for rules that need it).
``VerifyOut`` says which chain was chosen, how many of its tokens were accepted and the token that ends the cycle
(the replacement at the first rejection, or the bonus). Every cycle emits ``accepted + 1`` tokens.

| rule | verifier T | drafts | lossless because |
|---|---|---|---|
| ``exact_greedy`` | 0 | any, K >= 1 (longest exact match wins) | the output is the verifier's argmax chain |
| ``leviathan`` | > 0 | K = 1 sampled from q | standard speculative sampling |
| ``greedy_acceptance`` | > 0 | any, K >= 1, chosen by streak score | accept w.p. p(x), else sample p with x zeroed |
| ``multidraft_leviathan`` | > 0 | K i.i.d. from q | recursive rejection over i.i.d. candidates |

At verifier temperature 0 every rule *is* ``exact_greedy`` (with a one-hot p each reduces to it), so that is what
runs. The first three rules run in the fused verification kernel (``kernels/verify.py``: Triton on a GPU, its torch
reference elsewhere); ``multidraft_leviathan`` is a short sequential loop in torch.

Picking the best of K drafts *after* verifying each one independently with leviathan is not lossless; the
statistical tests in ``tests/decoding/test_lossless.py`` build that rule on purpose and show the chi-square test
rejects it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .kernels import VerifyOut, verify_chains

SELECTIONS = {"streak_score": "streak", "longest": "longest"}


@dataclass(frozen=True)
class AcceptanceRule:
    name: str
    needs_q: bool  # needs the drafter's exact proposal distribution
    iid: bool  # the K drafts must be i.i.d. samples from q (no argmax chain)
    max_K: int | None  # None: any number of chains
    verify: Callable[..., VerifyOut]


def _uniforms(B: int, G: int, device, generator) -> tuple[torch.Tensor, torch.Tensor]:
    u = torch.rand(B, G + 1, device=device, generator=generator)
    return u[:, :G].contiguous(), u[:, G].contiguous()


def _kernel_rule(kernel_rule: str) -> Callable[..., VerifyOut]:
    def verify(logits, drafts, q, *, temperature, selection, generator) -> VerifyOut:
        B, _, G = drafts.shape
        u_accept, u_sample = _uniforms(B, G, logits.device, generator)
        return verify_chains(
            logits,
            drafts,
            rule=kernel_rule,
            temperature=temperature,
            u_accept=u_accept,
            u_sample=u_sample,
            q=q if kernel_rule == "leviathan" else None,
            selection=SELECTIONS[selection],
        )

    return verify


def _sample(r: torch.Tensor, generator) -> int:
    """One draw from the unnormalised non-negative ``r`` ``[V]``."""
    return int(torch.multinomial(r, 1, generator=generator))


@torch.no_grad()
def multidraft_leviathan(logits, drafts, q, *, temperature, selection, generator) -> VerifyOut:
    """SpecTr / SpecInfer recursive rejection sampling over K i.i.d. drafts drawn slot by slot from the same q.

    At depth j the surviving chains (those equal to everything accepted so far) share one verifier distribution
    ``p'``; each candidate in turn is accepted with ``min(1, p'(x)/q(x))``, else ``p' <- norm(max(0, p' - q))``.
    When every candidate is rejected the cycle ends with a draw from ``p'``. Survivors' tokens at depth j are still
    i.i.d. from ``q_j`` (slots are drawn independently), which is what keeps the rule lossless.
    """
    if q is None:
        raise ValueError("multidraft_leviathan needs the drafter distribution q")
    B, K, G = drafts.shape
    p = torch.softmax(logits.float() / temperature, dim=-1)
    chosen, accepted, next_token = [], [], []
    d = drafts.tolist()
    for b in range(B):
        alive = list(range(K))
        n = 0
        token = None
        for j in range(G):
            pj = p[b, alive[0], j].clone()
            took = None
            for k in alive:
                x = d[b][k][j]
                qx = float(q[b, j, x])
                ratio = 1.0 if qx <= 0 else min(1.0, float(pj[x]) / qx)
                if float(torch.rand((), device=p.device, generator=generator)) < ratio:
                    took = x
                    break
                residual = (pj - q[b, j]).clamp_min(0)
                total = float(residual.sum())
                if total > 0:  # zero only if p' == q exactly, where a rejection cannot happen
                    pj = residual / total
            if took is None:
                token = _sample(pj, generator)
                break
            n += 1
            alive = [k for k in alive if d[b][k][j] == took]
        if token is None:  # every slot accepted: the bonus comes from the surviving chain's last row
            token = _sample(p[b, alive[0], G], generator)
        chosen.append(alive[0])
        accepted.append(n)
        next_token.append(token)
    dev = drafts.device
    return VerifyOut(
        chosen=torch.tensor(chosen, device=dev),
        accepted=torch.tensor(accepted, device=dev),
        next_token=torch.tensor(next_token, device=dev),
        scores=torch.zeros(B, K, device=dev),
    )


ACCEPTANCE_RULES: dict[str, AcceptanceRule] = {
    "exact_greedy": AcceptanceRule("exact_greedy", False, False, None, _kernel_rule("exact")),
    "leviathan": AcceptanceRule("leviathan", True, True, 1, _kernel_rule("leviathan")),
    "greedy_acceptance": AcceptanceRule("greedy_acceptance", False, False, None, _kernel_rule("greedy")),
    "multidraft_leviathan": AcceptanceRule("multidraft_leviathan", True, True, None, multidraft_leviathan),
}


def get_rule(name: str, temperature: float, K: int) -> AcceptanceRule:
    """The rule that will run: ``exact_greedy`` at temperature 0, otherwise ``name`` (checked against K; ValueError
    for ``exact_greedy`` at temperature > 0, which is not lossless there)."""
    if name not in ACCEPTANCE_RULES:
        raise ValueError(f"unknown acceptance rule {name!r}; valid: {', '.join(ACCEPTANCE_RULES)}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if name == "exact_greedy" and temperature > 0:
        # exact_greedy keeps a draft token only where it is the verifier's argmax: at T > 0 that decodes greedily,
        # not from the verifier's distribution, so the output would not be the sampling decoder's
        raise ValueError(
            f"decoder.acceptance=exact_greedy is lossless only at temperature 0, got temperature={temperature:g}; "
            "use decoder.acceptance=greedy_acceptance (or leviathan) to sample, or decoder.temperature=0"
        )
    rule = ACCEPTANCE_RULES["exact_greedy" if temperature == 0 else name]
    if rule.max_K is not None and K > rule.max_K:
        raise ValueError(
            f"{name} verifies {rule.max_K} draft per cycle, got K={K}; "
            "use decoder.acceptance=greedy_acceptance (self-selection) or multidraft_leviathan for K > 1"
        )
    return rule
