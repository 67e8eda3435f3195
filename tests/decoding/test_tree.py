"""Tree attention: K chains verified in one forward give the same per-token logits as K separate forwards."""

import torch

from streakline.decoding.tree import ChainTree
from streakline.decoding.vanilla import left_pad
from streakline.models import KVCache
from tests.decoding.helpers import V, verifier


def _prefilled(model, prompts):
    ids, mask = left_pad(prompts)
    cache = KVCache.for_model(model, len(prompts), 64)
    model.hidden(ids[:, :-1], attention_mask=mask[:, :-1], cache=cache)
    return cache, ids[:, -1], mask.sum(1) - 1


def test_tree_logits_equal_separate_chain_forwards():
    model = verifier(seed=1)
    prompts = [[3, 1, 4, 1, 5, 9], [2, 6]]  # ragged: row 1 is left-padded
    K, G = 3, 5
    drafts = torch.randint(0, V, (2, K, G), generator=torch.Generator().manual_seed(0))
    tree = ChainTree(K, G, "cpu")
    cache, pending, pos = _prefilled(model, prompts)
    with torch.no_grad():
        logits = model(
            tree.tokens(pending, drafts), position_ids=tree.positions(pos), cache=cache, attn_mask=tree.mask(2)
        )
    per_chain = tree.per_chain(logits)
    for k in range(K):
        cache_k, pending_k, pos_k = _prefilled(model, prompts)
        chain = torch.cat([pending_k[:, None], drafts[:, k]], 1)
        with torch.no_grad():
            want = model(chain, position_ids=pos_k[:, None] + torch.arange(G + 1), cache=cache_k)
        torch.testing.assert_close(per_chain[:, k], want, rtol=1e-5, atol=1e-5)


def test_accepted_path_gather_leaves_the_cache_of_the_accepted_sequence():
    """After moving chain 2's first 3 tokens into place, the next forward sees exactly prompt + that path."""
    model = verifier(seed=2)
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1]]
    K, G = 4, 4
    drafts = torch.randint(0, V, (2, K, G), generator=torch.Generator().manual_seed(1))
    tree = ChainTree(K, G, "cpu")
    cache, pending, pos = _prefilled(model, prompts)
    with torch.no_grad():
        model(tree.tokens(pending, drafts), position_ids=tree.positions(pos), cache=cache, attn_mask=tree.mask(2))
    start = cache.length - tree.size
    chosen, accepted = torch.tensor([2, 0]), torch.tensor([3, 1])
    n = 4
    keep = torch.arange(n)[None] <= accepted[:, None]
    cache.gather(tree.path_index(chosen, start, n), start, keep=keep)
    nxt = torch.tensor([5, 6])
    with torch.no_grad():
        got = model(nxt[:, None], position_ids=(pos + accepted + 1)[:, None], cache=cache)[:, -1]
    for b in range(2):
        seq = prompts[b] + [int(t) for t in drafts[b, chosen[b], : accepted[b]]] + [int(nxt[b])]
        with torch.no_grad():
            want = model(torch.tensor([seq]))[0, -1]
        torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-5)


def test_tree_mask_shape_and_visibility():
    tree = ChainTree(2, 3, "cpu")
    m = tree._mask
    assert m.shape == (7, 7)
    assert m[:, 0].all()  # everyone sees the pending token
    assert m[3, 1] and m[3, 2] and m[3, 3] and not m[3, 4]  # chain 0 depth 3 sees its chain only
    assert not m[4, 1] and m[6, 4] and m[6, 5] and not m[5, 6]
    assert tree.mask(2) is not None and ChainTree(1, 3, "cpu").mask(2) is None
