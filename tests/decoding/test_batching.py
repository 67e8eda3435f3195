"""Continuous batching (``decoding/batching.py``): each row is the prompt decoded alone, whatever its batch mates,
slots refill and pack, features equal a second pass, and a sampled token follows the verifier's distribution.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/decoding/test_batching.py
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from streakline.alignment.dflash import verifier_features
from streakline.decoding.backends import SampleSettings
from streakline.decoding.batching import ContinuousSampler, _nucleus_draw
from streakline.decoding.speculative import top_p_filter
from streakline.decoding.vanilla import greedy_generate
from streakline.models import Transformer
from tests.models.helpers import VOCAB, tiny_config


def _model(family="qwen2", seed=3, dtype=torch.float32):
    return Transformer(tiny_config(family)).init_weights(seed=seed).eval().to(dtype)


def _prompts(n, seed=0, lo=1, hi=12):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in lengths]


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_greedy_rows_equal_each_prompt_decoded_alone(family):
    """Fewer slots than prompts and an eos that ends rows early: slots are refilled mid-run and packed at the end,
    and in fp32 every row is still exactly its prompt's greedy continuation."""
    model = _model(family)
    prompts = _prompts(11)
    alone = [greedy_generate(model, [p], 9)[0] for p in prompts]
    eos = alone[0][3]  # a token some rows produce: they end early, and the next prompt takes their slot
    alone = [greedy_generate(model, [p], 9, eos_token_id=eos)[0] for p in prompts]
    sampler = ContinuousSampler(model, SampleSettings(max_new_tokens=9, temperature=0.0, eos_token_id=eos), rows=4)
    got = sampler.sample(prompts)
    assert [s.completion_ids for s in got] == alone
    assert [s.finish_reason for s in got] == ["eos" if a[-1] == eos and len(a) <= 9 else "length" for a in alone]
    assert sampler.stats["prefill_forwards"] > 1  # prompts were admitted into freed slots, not all at once


def test_sampled_rows_do_not_depend_on_their_batch_mates():
    model = _model(seed=5)
    prompts = _prompts(9, seed=1)
    seeds = [1000 + i for i in range(len(prompts))]
    settings = SampleSettings(max_new_tokens=7, temperature=0.9, top_p=0.8, topk_logprobs=3)
    together = ContinuousSampler(model, settings, rows=3).sample(prompts, seeds)
    for i in (0, 4, 8):  # the same prompt and seed alone, in a batch of one
        alone = ContinuousSampler(model, settings, rows=1).sample([prompts[i]], [seeds[i]])[0]
        assert alone.completion_ids == together[i].completion_ids
        assert alone.topk_ids == together[i].topk_ids
        np.testing.assert_allclose(alone.topk_logprobs, together[i].topk_logprobs, atol=1e-5)
    other = ContinuousSampler(model, settings, rows=3).sample(prompts, [s + 1 for s in seeds])
    assert [s.completion_ids for s in other] != [s.completion_ids for s in together]  # the seed is what draws


def test_topk_logprobs_are_the_verifier_log_softmax_at_each_emitted_token():
    model = _model(seed=6)
    prompt = _prompts(1, seed=2)[0]
    got = ContinuousSampler(model, SampleSettings(max_new_tokens=5, temperature=0.0, topk_logprobs=4)).sample([prompt])[
        0
    ]
    seq = prompt + got.completion_ids
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([seq]))[0].float(), -1)
    for j in range(5):
        want = lp[len(prompt) - 1 + j].topk(4)
        assert got.topk_ids[j] == want.indices.tolist()
        np.testing.assert_allclose(got.topk_logprobs[j], want.values.tolist(), atol=1e-5)
        assert got.completion_ids[j] == got.topk_ids[j][0]  # greedy: the emitted token is the top one


def test_features_from_the_generating_forwards_equal_a_second_pass():
    model = _model("llama", seed=7)
    prompts = _prompts(7, seed=3)
    layers = (0, 1, 2)
    free = greedy_generate(model, prompts[:1], 6)[0]
    settings = SampleSettings(max_new_tokens=6, temperature=0.0, eos_token_id=free[2])
    got = ContinuousSampler(model, settings, rows=3, feature_layers=layers).sample(prompts)
    seqs = [p + s.completion_ids for p, s in zip(prompts, got, strict=True)]
    second = verifier_features(model, seqs, layers, batch_size=4)
    assert any(s.finish_reason == "eos" for s in got) and any(s.finish_reason == "length" for s in got)
    for s, want, seq in zip(got, second, seqs, strict=True):
        assert s.extra["features"].shape == (len(seq), len(layers) * model.config.hidden_size)
        assert s.extra["features"].dtype == np.float16
        np.testing.assert_allclose(s.extra["features"].astype(np.float32), want.astype(np.float32), atol=2e-3)


@pytest.mark.parametrize("top_p", [0.9, 1.0])
def test_first_token_follows_the_tempered_nucleus_distribution(top_p):
    """A statistical test of the sampler: 4000 rows, each one token from its own seed, against the exact
    probabilities of the tempered, top_p-filtered distribution (chi-square, p > 1e-4)."""
    model = _model(seed=8)
    prompt = [5, 17, 2]
    T = 1.3
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0, -1]
    probs = torch.softmax(top_p_filter(logits[None], top_p, T)[0] / T, -1).double()
    n = 4000
    settings = SampleSettings(max_new_tokens=1, temperature=T, top_p=top_p)
    got = ContinuousSampler(model, settings, rows=256).sample([prompt] * n, list(range(n)))
    counts = np.bincount([s.completion_ids[0] for s in got], minlength=VOCAB)
    assert counts[probs.numpy() == 0].sum() == 0  # nothing outside the nucleus is ever drawn
    keep = probs.numpy() > 0
    expected = probs.numpy()[keep] * n
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty: the chi-square tail probability through a normal approximation
    z = ((chi2 / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    assert 0.5 * math.erfc(z / math.sqrt(2)) > 1e-4, (chi2, dof)


def test_the_nucleus_draw_looks_past_the_top_tokens_when_they_are_not_enough():
    """A flat row (its nucleus wider than the shortcut and past every eps but 0) and a peaked row in one call: each
    draw lands in its own row's nucleus, the one ``top_p_filter`` keeps."""
    V = 300
    flat = torch.linspace(1.0, 0.9, V)
    flat = flat / flat.sum()  # nearly flat, no ties (among tied tokens, which ones a nucleus keeps is arbitrary)
    peaked = torch.softmax(torch.linspace(8, 0, V), -1)
    probs = torch.stack([flat, peaked])
    for u in (0.0, 0.3, 0.999):
        ids = _nucleus_draw(probs.log(), torch.zeros(2, 1), 0.9, torch.tensor([u, u], dtype=torch.float64))
        for row, i in zip(probs, ids.tolist(), strict=True):
            assert top_p_filter(row.log()[None], 0.9, 1.0)[0, i].isfinite()
    top = _nucleus_draw(probs.log(), torch.zeros(2, 1), 0.9, torch.tensor([0.999, 0.0], dtype=torch.float64))
    assert top[1] == 0 and top[0] >= 64  # the flat row's last nucleus token lies past the top 64


def test_bad_requests_are_refused():
    model = _model()
    with pytest.raises(ValueError, match="one seed per prompt"):
        ContinuousSampler(model, SampleSettings(max_new_tokens=3, temperature=1.0)).sample([[1, 2]])
    with pytest.raises(ValueError, match="at least one token"):
        ContinuousSampler(model, SampleSettings(max_new_tokens=3, temperature=0.0)).sample([[1], []])
    with pytest.raises(ValueError, match="top_p"):
        ContinuousSampler(model, SampleSettings(max_new_tokens=3, top_p=0.0))
