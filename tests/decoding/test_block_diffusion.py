"""Block-diffusion decoders on a tiny random SDAR-layout target (block size 4), in float64 so that the cached
and uncached paths agree exactly. Run: ``python -m pytest tests/decoding/test_block_diffusion.py``."""

import pytest
import torch

from streakline.decoding.block_diffusion import (
    COMMIT_RULES,
    BlockDecodeConfig,
    BlockStep,
    coupled_gumbel,
    decode_blocks,
    decode_blocks_reference,
    score_logits,
)
from streakline.models import Transformer
from tests.models.helpers import VOCAB, tiny_config

L = 4
LENGTHS = (6, 3, 9)  # mid-block, shorter than a block, one past a boundary
MAX_NEW = 10  # not a multiple of L, so the last block is cut
# The random target is unsure (confidences around 0.05), so a low tau gives steps that commit 1 to 4 positions.


def _model(seed: int = 5, scale: float = 1.0, shift: bool = False) -> Transformer:
    model = Transformer(tiny_config("sdar", shift=shift)).init_weights(seed=seed, std=0.1).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


@pytest.fixture(scope="module")
def model() -> Transformer:
    return _model()


def _prompts(lengths=LENGTHS, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (n,), generator=g) for n in lengths]


def _left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), P, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, P - len(p) :], mask[r, P - len(p) :] = p, 1
    return ids, mask


def _blocks(n: int, max_new: int = MAX_NEW) -> list[int]:
    """Masked positions per decoded block for a prompt of length n."""
    head = n % L
    count = (head + max_new + L - 1) // L
    return [L - head] + [L] * (count - 1)


@pytest.mark.parametrize("cfg", [dict(rule="static"), dict(rule="threshold", threshold=0.05)], ids=["static", "thr"])
def test_cached_equals_reference_and_rows_alone(model, cfg):
    cfg = BlockDecodeConfig(max_new_tokens=MAX_NEW, **cfg)
    prompts = _prompts()
    ids, mask = _left_pad(prompts)
    batched = decode_blocks(model, ids, mask, cfg)
    for r, p in enumerate(prompts):
        alone = decode_blocks(model, p[None], None, cfg)
        ref = decode_blocks_reference(model, p[None], None, cfg)
        assert alone.tokens == ref.tokens == [batched.tokens[r]]
        assert len(ref.tokens[0]) == MAX_NEW
        assert alone.nfe == ref.nfe == batched.nfe_per_row[r]
    # Lock-step: every block costs as many forwards as its slowest row.
    assert batched.nfe >= max(batched.nfe_per_row)
    if cfg.rule == "threshold":
        assert max(batched.commits_per_forward) > len(prompts), "the test should exercise multi-commit steps"


def test_prompt_ending_on_a_block_boundary(model):
    cfg = BlockDecodeConfig(max_new_tokens=MAX_NEW)
    (p,) = _prompts((8,))
    res = decode_blocks(model, p[None], torch.ones(1, 8), cfg)
    assert res.tokens == decode_blocks_reference(model, p[None], None, cfg).tokens
    assert res.nfe == sum(_blocks(8)) == 12


def test_every_forward_sees_what_a_block_causal_forward_of_the_sequence_gives(model):
    """The exact property: each step's logits equal an uncached block-causal forward over prompt + finished blocks
    + the current block state, in particular for the prompt tokens that share the first decoded block."""
    prompts = _prompts()
    ids, mask = _left_pad(prompts)
    steps: list[BlockStep] = []
    res = decode_blocks(
        model,
        ids,
        mask,
        BlockDecodeConfig(rule="threshold", threshold=0.05, max_new_tokens=MAX_NEW),
        on_step=steps.append,
    )
    final: dict[tuple[int, int], torch.Tensor] = {}
    checked = 0
    for s in steps:
        for r, p in enumerate(prompts):
            if not s.masked[r].any():
                continue
            full = len(p) // L * L
            done = [final[(r, k)] for k in range(s.block)]
            seq = torch.cat([p[:full], *done, s.tokens[r]])[None]
            with torch.no_grad():
                want = model(seq)[0, -L:]
            torch.testing.assert_close(s.logits[r], want, rtol=0, atol=1e-10)
            assert s.positions[r].tolist() == list(range(seq.shape[1] - L, seq.shape[1]))
            final[(r, s.block)] = s.committed[r]
            checked += 1
    assert checked == sum(res.nfe_per_row) and len(steps) == res.nfe


def test_static_commits_one_token_per_forward(model):
    cfg = BlockDecodeConfig(rule="static", max_new_tokens=MAX_NEW)
    for n, p in zip(LENGTHS, _prompts(), strict=True):
        res = decode_blocks(model, p[None], None, cfg)
        assert res.commits_per_forward == [1] * res.nfe
        assert res.nfe == sum(_blocks(n))  # every decoded position, prefill and KV stores folded in
    ids, mask = _left_pad(_prompts())
    res = decode_blocks(model, ids, mask, cfg)
    per_block = [_blocks(n) for n in LENGTHS]
    assert res.nfe_per_row == [sum(b) for b in per_block]
    depth = max(len(b) for b in per_block)
    assert res.nfe == sum(max(b[k] for b in per_block if k < len(b)) for k in range(depth))


def test_threshold_extremes(model):
    prompts = _prompts()
    ids, mask = _left_pad(prompts)
    every = decode_blocks(model, ids, mask, BlockDecodeConfig(rule="threshold", threshold=0.0, max_new_tokens=MAX_NEW))
    assert every.nfe_per_row == [len(_blocks(n)) for n in LENGTHS]
    assert every.nfe == max(len(_blocks(n)) for n in LENGTHS)
    (p,) = _prompts((6,))
    one = decode_blocks(
        model, p[None], None, BlockDecodeConfig(rule="threshold", threshold=0.0, max_new_tokens=MAX_NEW)
    )
    assert one.commits_per_forward == _blocks(6)

    static = decode_blocks(model, ids, mask, BlockDecodeConfig(rule="static", max_new_tokens=MAX_NEW))
    never = decode_blocks(model, ids, mask, BlockDecodeConfig(rule="threshold", threshold=1.5, max_new_tokens=MAX_NEW))
    assert never.tokens == static.tokens
    assert (never.nfe, never.nfe_per_row, never.commits_per_forward) == (
        static.nfe,
        static.nfe_per_row,
        static.commits_per_forward,
    )


def test_threshold_needs_fewer_forwards_on_a_peaked_model():
    peaked = _model(scale=50.0)
    (p,) = _prompts((5,))
    static = decode_blocks(peaked, p[None], None, BlockDecodeConfig(rule="static", max_new_tokens=16))
    fast = decode_blocks(peaked, p[None], None, BlockDecodeConfig(rule="threshold", max_new_tokens=16))
    assert static.nfe == sum(_blocks(5, 16))
    assert 2 * fast.nfe <= static.nfe
    assert (
        fast.tokens
        == decode_blocks_reference(peaked, p[None], None, BlockDecodeConfig(rule="threshold", max_new_tokens=16)).tokens
    )


def test_eos_stops_the_row_after_its_block(model):
    prompts = _prompts()
    ids, mask = _left_pad(prompts)
    cfg = BlockDecodeConfig(max_new_tokens=MAX_NEW)
    free = decode_blocks(model, ids, mask, cfg).tokens
    eos = free[0][5]
    at = free[0].index(eos)
    cfg = BlockDecodeConfig(max_new_tokens=MAX_NEW, eos_token_id=eos)
    res = decode_blocks(model, ids, mask, cfg)
    assert res.tokens[0] == free[0][: at + 1]
    for r, p in enumerate(prompts):
        want = free[r][: free[r].index(eos) + 1] if eos in free[r] else free[r]
        assert res.tokens[r] == want == decode_blocks_reference(model, p[None], None, cfg).tokens[0]
    # Row 0 stopped committing after the block holding its eos.
    head = LENGTHS[0] % L
    assert res.nfe_per_row[0] == ((head + at) // L + 1) * L - head


def test_steps_log_records_every_commit_once(model):
    ids, mask = _left_pad(_prompts())
    res = decode_blocks(
        model, ids, mask, BlockDecodeConfig(rule="threshold", threshold=0.05, max_new_tokens=MAX_NEW, log_steps=True)
    )
    assert len(res.steps_log) == res.nfe
    for r, n in enumerate(LENGTHS):
        seen = [i for rec in res.steps_log for i in rec.positions[r]]
        assert sorted(seen) == list(range(sum(_blocks(n))))
        got = {i: t for rec in res.steps_log for i, t in zip(rec.positions[r], rec.tokens[r], strict=True)}
        assert [got[i] for i in range(MAX_NEW)] == res.tokens[r]
        assert all(0 < c <= 1 for rec in res.steps_log for c in rec.confidences[r])


def test_rules_on_hand_built_steps():
    conf = torch.tensor([[0.5, 0.7, 0.7, 0.95], [0.2, 0.2, 0.2, 0.2]], dtype=torch.float64)
    masked = torch.tensor([[True, True, True, False], [False, True, True, True]])
    cand = torch.arange(8).view(2, 4)
    step = BlockStep(0, 0, torch.full((2, 4), VOCAB - 1), masked, cand, cand, torch.zeros(2, 4, VOCAB), conf, cand)
    commit, toks = COMMIT_RULES["static"](step, BlockDecodeConfig(max_new_tokens=1))
    # Ties go to the lowest position; an unmasked position is never picked however confident.
    assert commit.tolist() == [[False, True, False, False], [False, True, False, False]]
    assert toks.equal(cand)
    commit, _ = COMMIT_RULES["threshold"](step, BlockDecodeConfig(rule="threshold", threshold=0.6, max_new_tokens=1))
    assert commit.tolist() == [[False, True, True, False], [False, True, False, False]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shifted_target_cached_equals_reference(temperature):
    """A shifted target (logits at i predict token i + 1): the cached decoder reads the position before each block
    from the block's first forward; the reference recomputes everything."""
    model = _model(seed=8, shift=True)
    cfg = BlockDecodeConfig(max_new_tokens=MAX_NEW, rule="threshold", threshold=0.05, temperature=temperature)
    prompts = _prompts((6, 3, 9, 8))  # 8: the prompt fills whole blocks, so block 0 starts after the prefill
    ids, mask = _left_pad(prompts)
    batched = decode_blocks(model, ids, mask, cfg)
    for r, p in enumerate(prompts):
        assert batched.tokens[r] == decode_blocks_reference(model, p[None], None, cfg).tokens[0]
    assert batched.tokens != decode_blocks(_model(seed=8), ids, mask, cfg).tokens  # the shift matters


@pytest.mark.parametrize("rule", ["static", "threshold"])
def test_coupled_noise_cached_equals_reference_and_is_keyed_by_seed(model, rule):
    cfg = BlockDecodeConfig(max_new_tokens=MAX_NEW, rule=rule, threshold=0.05, temperature=1.0, seed=3)
    prompts = _prompts()
    ids, mask = _left_pad(prompts)
    batched = decode_blocks(model, ids, mask, cfg)
    greedy = decode_blocks(model, ids, mask, BlockDecodeConfig(max_new_tokens=MAX_NEW, rule=rule, threshold=0.05))
    other = decode_blocks(model, ids, mask, BlockDecodeConfig(**{**cfg.__dict__, "seed": 4}))
    for r, p in enumerate(prompts):
        assert batched.tokens[r] == decode_blocks_reference(model, p[None], None, cfg).tokens[0]
    # A sampler, not argmax in disguise: another seed (and temperature 0) give other completions.
    assert batched.tokens != other.tokens and batched.tokens != greedy.tokens
    assert batched.tokens == decode_blocks(model, ids, mask, cfg).tokens


def test_coupled_gumbel_depends_on_seed_and_position_only():
    a = coupled_gumbel(torch.tensor([[0, 1, 2], [2, 1, 0]]), 50, seed=7)
    assert a[0, 0].equal(a[1, 2]) and a[0, 1].equal(a[1, 1]) and not a[0, 0].equal(a[0, 1])
    assert a.equal(coupled_gumbel(torch.tensor([[0, 1, 2], [2, 1, 0]]), 50, seed=7))
    assert not a[0, 0].equal(coupled_gumbel(torch.tensor([[0]]), 50, seed=8)[0, 0])


def test_coupled_noise_samples_the_tempered_distribution():
    """Over seeds, the token chosen at a position follows softmax(logits / T) (Gumbel-max), chi-square p > 1e-3."""
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0, 0.5, 1.5]]])
    T, n = 0.8, 3000
    cfg = BlockDecodeConfig(max_new_tokens=1, temperature=T)
    counts = torch.zeros(6)
    for seed in range(n):
        _, tok = score_logits(
            logits, coupled_gumbel(torch.tensor([[5]]), 6, seed), BlockDecodeConfig(**{**cfg.__dict__, "seed": seed})
        )
        counts[int(tok)] += 1
    expected = torch.softmax(logits[0, 0] / T, dim=-1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # chi-square, 5 degrees of freedom, p = 1e-3
    conf, tok = score_logits(logits, coupled_gumbel(torch.tensor([[5]]), 6, 0), cfg)
    assert conf.item() == pytest.approx(torch.softmax(logits[0, 0] / T, -1)[tok].item())


def test_rejects_models_and_configs_it_cannot_decode(model):
    (p,) = _prompts((3,))
    causal = Transformer(tiny_config("qwen3")).init_weights(seed=0)
    with pytest.raises(ValueError, match="block_causal"):
        decode_blocks(causal, p[None], None, BlockDecodeConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match="block size"):
        decode_blocks(model, p[None], None, BlockDecodeConfig(max_new_tokens=4, block_size=8))
    with pytest.raises(ValueError, match="unknown commit rule"):
        decode_blocks(model, p[None], None, BlockDecodeConfig(max_new_tokens=4, rule="spot"))


def test_a_decode_past_the_targets_position_limit_is_refused():
    """The last block is decoded whole, so its positions count: refused with the numbers instead of decoding
    positions the target was never trained on."""
    from streakline.decoding.vanilla import PositionLimitError

    model = _model()
    limit, L = model.config.max_position_embeddings, model.config.block_size
    prompt = torch.ones(1, limit - L, dtype=torch.long)
    with pytest.raises(PositionLimitError, match=rf"max_position_embeddings={limit}"):
        decode_blocks(model, prompt, None, BlockDecodeConfig(max_new_tokens=L + 1))
