"""Tree attention for K draft chains: one verifier forward scores every chain (docs/algorithms.md section 3, step 2).

The forward's new tokens are the pending token (the last committed token, not yet in the cache) followed by the K
chains of depth G, flattened: ``[t, x^1_1..x^1_G, x^2_1..x^2_G, ...]``. Each node sees the cached prefix, the
pending token and its own chain's earlier tokens; its position id is the pending token's plus its depth. So chain
k's logits read ``p_1`` at the pending token and ``p_{j+1}`` at its j-th token, exactly what K separate forwards
would give (a test checks this).

After acceptance the accepted path (pending token + the chosen chain's accepted tokens) is moved to the front of
the tree's slots in the KV cache by ``path_index``; every other slot is dropped.

    tree = ChainTree(K=4, G=8, device="cpu")
    logits = verifier(tree.tokens(pending, drafts), position_ids=tree.positions(pos), cache=cache,
                      attn_mask=tree.mask(batch))
    per_chain = tree.per_chain(logits)         # [B, K, G+1, V]
"""

from __future__ import annotations

import torch


class ChainTree:
    def __init__(self, K: int, G: int, device) -> None:
        self.K, self.G = K, G
        n = 1 + K * G
        depth = torch.zeros(n, dtype=torch.long)
        chain = torch.full((n,), -1, dtype=torch.long)
        if G:
            depth[1:] = torch.arange(1, G + 1).repeat(K)
            chain[1:] = torch.arange(K).repeat_interleave(G)
        same_chain = chain[:, None] == chain[None, :]
        earlier = depth[None, :] <= depth[:, None]
        # a node sees the pending token (chain -1, depth 0) and the nodes of its chain up to its own depth
        self._mask = ((same_chain & earlier) | (chain[None, :] == -1)).to(device)
        self.depth = depth.to(device)
        self.size = n

    def tokens(self, pending: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """``[B, 1 + K*G]`` from pending ``[B]`` and drafts ``[B, K, G]``."""
        return torch.cat([pending[:, None], drafts.reshape(drafts.shape[0], -1)], dim=1)

    def positions(self, pos: torch.Tensor) -> torch.Tensor:
        """``[B, 1 + K*G]`` position ids; ``pos`` ``[B]`` is the pending token's."""
        return pos[:, None] + self.depth[None]

    def mask(self, batch_size: int) -> torch.Tensor | None:
        """``[B, n, n]`` tree mask, or None for a single chain (plain causal order over positions is the same)."""
        if self.K == 1:
            return None
        return self._mask[None].expand(batch_size, -1, -1)

    def per_chain(self, logits: torch.Tensor) -> torch.Tensor:
        """``[B, K, G+1, V]`` from the forward's logits ``[B, 1 + K*G, V]``: row 0 of every chain is ``p_1``."""
        B, _, V = logits.shape
        root = logits[:, :1, None].expand(B, self.K, 1, V)
        return torch.cat([root, logits[:, 1:].reshape(B, self.K, self.G, V)], dim=2)

    def path_index(self, chosen: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """``[B, n]`` cache slots of the first n path nodes of chain ``chosen`` ``[B]``; the tree begins at ``start``.

        Slot 0 is the pending token; slot i >= 1 the chosen chain's i-th token. For chain 0 every source is its own
        destination, for any other chain every source lies past the path, which is what lets the KV move run in
        place (``kernels.compact_kv``).
        """
        i = torch.arange(n, device=chosen.device)
        chain_slot = start + 1 + chosen[:, None] * self.G + (i[None] - 1)
        return torch.where(i[None] == 0, torch.full_like(chain_slot, start), chain_slot)
