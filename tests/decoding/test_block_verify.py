"""Speculative block decoding's machinery, independent of SPOT and Spiffy: the batched verification forward and
the state-equality walk, driven by an oracle drafter (it proposes the draft-free decoder's own future states) and
by a drafter that proposes wrong states. Run: ``python -m pytest tests/decoding/test_block_verify.py``."""

import pytest
import torch

from streakline.decoding.block_diffusion import (
    BlockDecodeConfig,
    BlockDrafter,
    DraftContext,
    Drafts,
    _verify_forward,
    decode_blocks,
)
from streakline.models import KVCache
from tests.decoding.test_block_diffusion import MAX_NEW, L, _left_pad, _model, _prompts
from tests.models.helpers import VOCAB


@pytest.fixture(scope="module")
def model():
    return _model()


class Oracle(BlockDrafter):
    """Proposes the next ``depth`` states the draft-free decoder went through from the root (recorded first)."""

    def __init__(self, trace: dict[tuple[int, int], list[list[torch.Tensor]]], depth: int, junk: int = 0):
        self.trace, self.depth, self.junk = trace, depth, junk
        self.gen = torch.Generator().manual_seed(0)

    def propose(self, ctx: DraftContext) -> Drafts:
        B, Lb = ctx.root.shape
        D = self.depth + self.junk
        tokens = torch.full((B, D, Lb), ctx.mask_id, dtype=torch.long)
        valid = torch.zeros(B, D, dtype=torch.bool)
        for r in range(B):
            states = self.trace.get((r, int(ctx.out_positions[r, 0])), [])
            at = next((i for i, s in enumerate(states) if s.equal(ctx.root[r])), None)
            future = [] if at is None else states[at + 1 : at + 1 + self.depth]
            for d, s in enumerate(future):
                tokens[r, d], valid[r, d] = s, True
            for j in range(self.junk):  # root plus a random token at a masked position: almost surely wrong
                junk = ctx.root[r].clone()
                free = ctx.masked[r].nonzero().flatten()
                if len(free):
                    junk[free[0]] = int(torch.randint(0, VOCAB - 1, (1,), generator=self.gen))
                    tokens[r, self.depth + j], valid[r, self.depth + j] = junk, True
        return Drafts(tokens, valid)


def _record(model, ids, mask, cfg, drafter=None):
    trace: dict[tuple[int, int], list[list[torch.Tensor]]] = {}

    def on_step(step):
        for r in range(step.tokens.shape[0]):
            if bool(step.masked[r].any()):
                states = trace.setdefault((r, int(step.out_positions[r, 0])), [step.tokens[r].clone()])
                states.append(step.committed[r].clone())

    return decode_blocks(model, ids, mask, cfg, on_step=on_step, drafter=drafter), trace


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["T0", "T1"])
@pytest.mark.parametrize("rule", ["static", "threshold"])
@pytest.mark.parametrize("depth,junk", [(1, 0), (3, 2), (8, 0), (0, 3)])
def test_walk_reproduces_the_draft_free_decoder(model, rule, temperature, depth, junk):
    _walk_case(model, rule, temperature, depth, junk)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["T0", "T1"])
def test_walk_on_a_shifted_target(temperature):
    _walk_case(_model(seed=8, shift=True), "static", temperature, depth=3, junk=1)


def _walk_case(model, rule, temperature, depth, junk):
    cfg = BlockDecodeConfig(max_new_tokens=MAX_NEW, rule=rule, threshold=0.05, temperature=temperature, seed=2)
    ids, mask = _left_pad(_prompts())
    plain, trace = _record(model, ids, mask, cfg)
    spec, spec_trace = _record(model, ids, mask, cfg, drafter=Oracle(trace, depth, junk))
    assert spec.tokens == plain.tokens
    assert sum(spec.commits_per_forward) == sum(plain.commits_per_forward)
    if depth == 0:
        assert spec.nfe == plain.nfe  # wrong drafts never save a forward
    else:
        assert spec.nfe < plain.nfe
    assert max(spec.drafts_per_forward) <= 3 * (depth + junk) and sum(spec.drafts_per_forward) > 0
    # on_step sees the draft-free decoder's sequence of states with and without drafting.
    assert spec_trace.keys() == trace.keys()
    for key, states in trace.items():
        assert all(a.equal(b) for a, b in zip(spec_trace[key], states, strict=True))


def test_oracle_commits_depth_plus_one_per_forward_under_static(model):
    cfg = BlockDecodeConfig(max_new_tokens=2 * L, rule="static")
    (p,) = _prompts((L,))  # block-aligned prompt: two full blocks of L positions
    plain, trace = _record(model, p[None], None, cfg)
    spec = decode_blocks(model, p[None], None, cfg, drafter=Oracle(trace, depth=L))
    # Per block: one plain forward commits 1, then one verification forward commits the remaining L - 1.
    assert spec.commits_per_forward == [1, L - 1, 1, L - 1]
    assert spec.nfe == 4 and plain.nfe == 2 * L


def test_each_draft_copy_gets_the_logits_of_its_own_forward(model):
    """The verification forward == one separate cached forward per state, with left padding and two rows."""
    prompts = _prompts((2 * L + 1, L))  # row 0 has a longer prefix; row 1 is left-padded by L + 1
    ids, mask = _left_pad(prompts)
    # Prefill only the complete prompt blocks (as decode_blocks does), then verify 3 states of the next block.
    prefix_len = [len(p) // L * L for p in prompts]
    Q = max(prefix_len)
    pre = torch.zeros(2, Q, dtype=torch.long)
    valid = torch.zeros(2, Q, dtype=torch.bool)
    for r, p in enumerate(prompts):
        pre[r, Q - prefix_len[r] :], valid[r, Q - prefix_len[r] :] = p[: prefix_len[r]], True
    pos = torch.tensor(prefix_len)[:, None] + torch.arange(L)
    g = torch.Generator().manual_seed(3)
    root = torch.randint(0, VOCAB - 1, (2, L), generator=g)
    drafts = Drafts(torch.randint(0, VOCAB - 1, (2, 3, L), generator=g), torch.ones(2, 3, dtype=torch.bool))

    def prefilled():
        cache = KVCache.for_model(model, 2, capacity=Q + 8 * L)
        prefix_pos = (valid.long().cumsum(1) - 1).clamp(min=0)
        model(pre, position_ids=prefix_pos, attention_mask=valid.long(), cache=cache)
        return cache

    cache = prefilled()
    together = _verify_forward(model, root, drafts, pos, cache)
    assert cache.length == Q  # the drafts' KV is dropped again
    states = torch.cat([root[:, None], drafts.tokens], dim=1)
    for d in range(4):
        alone = model(states[:, d], position_ids=pos, cache=prefilled(), logits_to_keep=L)
        torch.testing.assert_close(together[:, d], alone, rtol=0, atol=1e-10)
