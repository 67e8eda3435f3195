"""Greedy generation with the verifier alone: batched and cached, equal to recomputing everything each step."""

import torch

from streakline.decoding.vanilla import greedy_generate, left_pad
from streakline.models import Transformer
from tests.models.helpers import VOCAB, tiny_config


def _reference(model, prompt, n, eos=None):
    seq = list(prompt)
    out = []
    for _ in range(n):
        with torch.no_grad():
            nxt = int(model(torch.tensor([seq]))[0, -1].argmax())
        out.append(nxt)
        seq.append(nxt)
        if nxt == eos:
            break
    return out


def test_batched_cached_greedy_equals_full_recompute():
    model = Transformer(tiny_config("qwen2")).init_weights(seed=3).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 2, 11)]
    got = greedy_generate(model, prompts, 9)
    assert got == [_reference(model, p, 9) for p in prompts]


def test_rows_stop_at_their_eos_and_keep_it():
    model = Transformer(tiny_config("llama")).init_weights(seed=4).eval()
    prompts = [[1, 2, 3], [4, 5]]
    free = greedy_generate(model, prompts, 8)
    eos = free[0][2]  # the third token row 0 produces: row 0 must stop there
    got = greedy_generate(model, prompts, 8, eos_token_id=eos)
    assert got[0] == free[0][: free[0].index(eos) + 1]
    assert got[1] == _reference(model, prompts[1], 8, eos)


def test_left_pad_rejects_empty_prompts():
    ids, mask = left_pad([[1, 2], [3]])
    assert ids.tolist() == [[1, 2], [0, 3]] and mask.tolist() == [[1, 1], [0, 1]]
    try:
        left_pad([[1], []])
    except ValueError as e:
        assert "at least one token" in str(e)
    else:
        raise AssertionError("an empty prompt must be refused")
