"""SPOT's tree drafter for block-diffusion targets (docs/algorithms.md section 8): a learned commit order, best-first.

    from streakline.decoding.spot import SpotDrafter
    from streakline.models.order_model import OrderModel
    drafter = SpotDrafter(OrderModel.load(folder), budget=8)               # prefix_mass_floor=0.02 for SPOT-gamma
    res = decode_blocks(target, ids, mask, BlockDecodeConfig(rule="static", max_new_tokens=64), drafter=drafter)

Before each verification forward ``decode_blocks`` hands the drafter the root (the real current state) and the
stale distribution of the last real forward (one commit step behind the root). The drafter grows a tree of
hypothetical states: a child adds one (position, token) commit at a position that is masked in the root and not
yet committed on the way from the root. Token hypotheses per position are the stale rank-0 token (the one the
target would take), plus the rank-1 token when the rank-0 probability is below ``second_below``. Each node has a
prefix mass ``m(child) = m(parent) * q(pos | parent) * p~(token)`` with ``q`` the order model's softmax over the
parent's eligible positions and ``p~`` the stale probability; nodes are added best-first by mass (the root is not
counted) until ``budget`` nodes, so the tree is the ``budget`` heaviest states (a child never outweighs its parent).
SPOT-gamma: candidates with mass below ``prefix_mass_floor`` are never added, so easy blocks verify fewer states.

A state reachable by two commit orders is added once (the first, heavier, order; the other is skipped): the
verification walk matches states, not paths, so a duplicate would only waste budget.

All rows grow in lock-step: each round adds one node per row and runs one order-model forward over every row's
new node, so a proposal costs at most ``budget`` small forwards whatever the batch size. Exactness does not depend
on any of this: ``decode_blocks`` only walks through states equal to the target's own.
Tests: ``python -m pytest tests/decoding/test_spot.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streakline.errors import UserError
from streakline.models.order_model import OrderModel, order_features

from .block_rules import BlockDrafter, DraftContext, Drafts, stale_topk


@dataclass
class SpotTree:
    """One proposal's trees, ``B`` rows by ``1 + D`` nodes (index 0 = the root). Padding nodes have valid False."""

    tokens: torch.Tensor  # [B, 1 + D, L] block contents (mask id where masked)
    path: torch.Tensor  # [B, 1 + D, L] bool, positions committed on the way from the root
    valid: torch.Tensor  # [B, 1 + D] bool (the root is valid for active rows)
    parent: torch.Tensor  # [B, 1 + D] long, -1 for the root and padding
    mass: torch.Tensor  # [B, 1 + D] float64 prefix mass (1 at the root)
    depth: torch.Tensor  # [B, 1 + D] long

    def drafts(self) -> Drafts:
        """The non-root nodes, cut to the largest node count of any row: the verification forward runs every
        slot, padding included, so SPOT-gamma's smaller trees (and nearly finished blocks) cost less."""
        n = int(self.valid[:, 1:].sum(dim=1).max()) if self.valid.shape[0] else 0
        return Drafts(self.tokens[:, 1 : 1 + n], self.valid[:, 1 : 1 + n])


class OrderModelMismatchError(UserError, ValueError):
    """An order model that learnt another draft-free decoder's commit order than the one decoding now."""


def check_trained_for(model: OrderModel, rule: str, threshold: float) -> None:
    """Raise OrderModelMismatchError when ``model`` learnt the commit order of another rule (or, for the threshold
    rule, another threshold) than ``rule``/``threshold``. Decoding would stay exact but draft badly; the message
    says how to get a matching model. A model that recorded neither is not checked."""
    c = model.config
    wrong = None
    if c.rule is not None and c.rule != rule:
        wrong = f"rule {c.rule!r} (decoding {rule!r})"
    elif c.rule == "threshold" and c.threshold is not None and abs(c.threshold - threshold) > 1e-9:
        wrong = f"threshold {c.threshold} (decoding {threshold})"
    if wrong is not None:
        extra = f" stage.threshold={threshold}" if rule == "threshold" else ""
        raise OrderModelMismatchError(
            f"this order model learnt the commit order of {wrong}; train one for this decode with `python launch.py "
            f"stage=spot model=... stage.rule={rule}{extra}` or point decoder.artifact at a matching order_model"
        )


class SpotDrafter(BlockDrafter):
    """Proposes ``budget`` hypothetical states per row, grown best-first by prefix mass under the order model."""

    def __init__(
        self,
        order_model: OrderModel,
        budget: int,
        prefix_mass_floor: float | None = None,
        second_below: float = 0.6,
        top_k: int | None = None,
    ) -> None:
        if budget < 1:
            raise ValueError(f"budget (decoder.budget, D) must be >= 1, got {budget}")
        if prefix_mass_floor is not None and not 0.0 <= prefix_mass_floor < 1.0:
            raise ValueError(f"prefix_mass_floor must be in [0, 1), got {prefix_mass_floor}")
        k = order_model.config.top_k
        if top_k is not None and top_k != k:
            # The features are the stale top-k; another k than the model was trained on would shift their meaning.
            raise ValueError(f"top_k={top_k} differs from the order model's top_k={k}; omit it to use the model's")
        self.model = order_model.eval()
        self.budget, self.prefix_mass_floor, self.second_below, self.top_k = budget, prefix_mass_floor, second_below, k
        self.forwards = 0  # order-model forwards so far (for reports)
        self._checked: tuple[str, float] | None = None

    def propose(self, ctx: DraftContext) -> Drafts | None:
        setting = (ctx.cfg.rule, ctx.cfg.threshold)
        if setting != self._checked:
            check_trained_for(self.model, *setting)
            self._checked = setting
        if ctx.root.shape[1] > self.model.config.max_block:  # before the first draft, not as an index error in it
            raise OrderModelMismatchError(
                f"this order model serves blocks of up to {self.model.config.max_block} tokens (stage.max_block) and "
                f"the target's blocks have {ctx.root.shape[1]}; train one with python launch.py stage=spot model=... "
                f"stage.max_block={ctx.root.shape[1]}, or point decoder.artifact at one that fits"
            )
        return self.build_tree(ctx).drafts()

    @torch.no_grad()
    def build_tree(self, ctx: DraftContext) -> SpotTree:
        """The trees of every row (``SpotTree``); ``propose`` returns their non-root nodes as drafts."""
        dev = ctx.root.device
        if next(self.model.parameters()).device != dev:
            self.model.to(dev)
        B, L = ctx.root.shape
        D = self.budget
        ids, probs = stale_topk(ctx.scores, ctx.probs, self.top_k)  # [B, L, k'], rank order
        stale = probs.float()
        hyp_tok = ids[..., :2]  # [B, L, 2]: rank 0, rank 1
        hyp_p = probs[..., :2].double()
        hyp_ok = torch.stack([torch.ones_like(ctx.masked), probs[..., 0] < self.second_below], dim=-1)
        real = ~ctx.masked
        rows = torch.arange(B, device=dev)

        tree = SpotTree(
            tokens=ctx.root[:, None].repeat(1, 1 + D, 1),
            path=torch.zeros(B, 1 + D, L, dtype=torch.bool, device=dev),
            valid=torch.zeros(B, 1 + D, dtype=torch.bool, device=dev),
            parent=torch.full((B, 1 + D), -1, dtype=torch.long, device=dev),
            mass=torch.zeros(B, 1 + D, dtype=torch.float64, device=dev),
            depth=torch.zeros(B, 1 + D, dtype=torch.long, device=dev),
        )
        tree.valid[:, 0] = ctx.active
        tree.mass[:, 0] = 1.0
        # cand[b, j, pos, h]: mass of the child of node j committing hypothesis h at pos (-inf: no such child).
        cand = torch.full((B, 1 + D, L, 2), float("-inf"), dtype=torch.float64, device=dev)
        count = torch.zeros(B, dtype=torch.long, device=dev)  # nodes added per row

        def expand(sel: torch.Tensor, node: torch.Tensor) -> None:
            """Score the children of node ``node[b]`` for the rows ``sel`` (bool [B]) with one forward."""
            r = sel.nonzero().flatten()
            if not len(r):
                return
            j = node[r]
            path = tree.path[r, j]
            eligible = ctx.masked[r] & ~path
            has = eligible.any(dim=1)
            r, j, path, eligible = r[has], j[has], path[has], eligible[has]
            if not len(r):
                return
            feats = order_features(stale[r], real[r], path, tree.depth[r, j], top_k=self.top_k)
            q = torch.softmax(self.model(feats, eligible).double(), dim=-1)  # [n, L], 0 where ineligible
            self.forwards += 1
            m = tree.mass[r, j][:, None, None] * q[..., None] * hyp_p[r]
            ok = eligible[..., None] & hyp_ok[r]
            if self.prefix_mass_floor is not None:
                ok &= m >= self.prefix_mass_floor
            cand[r, j] = m.masked_fill(~ok, float("-inf"))

        expand(ctx.active, torch.zeros(B, dtype=torch.long, device=dev))
        flat = cand.view(B, -1)
        for _ in range(D):
            added = torch.zeros(B, dtype=torch.bool, device=dev)
            while True:  # pop the heaviest candidate per row, skipping states the row already has
                best, arg = flat.max(dim=1)
                want = ctx.active & (count < D) & ~added & (best > float("-inf"))
                if not bool(want.any()):
                    break
                j, rest = arg // (L * 2), arg % (L * 2)
                pos, h = rest // 2, rest % 2
                child = tree.tokens[rows, j].clone()
                child[rows, pos] = hyp_tok[rows, pos, h]
                dup = ((tree.tokens == child[:, None]).all(dim=-1) & tree.valid).any(dim=1) & want
                new = want & ~dup
                slot = (count + 1).clamp(max=D)
                n = new.nonzero().flatten()
                if len(n):
                    s, jn = slot[n], j[n]
                    tree.tokens[n, s] = child[n]
                    tree.path[n, s] = tree.path[n, jn]
                    tree.path[n, s, pos[n]] = True
                    tree.valid[n, s] = True
                    tree.parent[n, s] = jn
                    tree.mass[n, s] = best[n]
                    tree.depth[n, s] = tree.depth[n, jn] + 1
                    count[n] += 1
                    added |= new
                taken = want.nonzero().flatten()
                flat[taken, arg[taken]] = float("-inf")
            if not bool(added.any()):
                break
            # The last node of a row needs no children: nothing after it is added.
            expand(added & (count < D), count)
        return tree
