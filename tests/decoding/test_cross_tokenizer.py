"""Cross-tokenizer drafting: token-string maps, lossless output, and a perfect drafter behind a permuted vocabulary."""

import pytest
import torch

from streakline.data.corpora.math import math_texts
from streakline.data.tokenizer import train_tokenizer
from streakline.decoding.cross_tokenizer import CrossTokenizerDrafter, VocabBridge
from streakline.decoding.drafters import ARDrafter, DiffusionDrafter
from streakline.decoding.speculative import SpecConfig, generate
from streakline.decoding.vanilla import greedy_generate
from streakline.models import Transformer
from streakline.models.tokenizer import load_tokenizer
from tests.models.helpers import permuted_tokenizer, tiny_config

TEXTS = [r["text"] for r in math_texts("train", 300, seed=0)]
TEXT = "Sam has 3 apples and"


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    a = train_tokenizer(TEXTS, root / "a", vocab_size=420)
    new_id = permuted_tokenizer(a, root / "b")
    c = train_tokenizer(TEXTS[:150], root / "c", vocab_size=380)
    return load_tokenizer(a), load_tokenizer(root / "b"), load_tokenizer(c), new_id


def test_bridge_maps_tokens_with_equal_text(tokenizers):
    a, b, c, new_id = tokenizers
    bridge = VocabBridge(b, a)
    for old, new in new_id.items():
        assert bridge.to_verifier[new] == old  # the permuted tokenizer maps back exactly
    other = VocabBridge(c, a)
    assert 0.5 < other.coverage <= 1.0
    for i in torch.nonzero(other.mappable).flatten().tolist():
        assert c.decode([i]) == a.decode([int(other.to_verifier[i])])
    for s in c.all_special_ids:
        assert not other.mappable[s]
    q = torch.softmax(torch.randn(2, len(c)), -1)
    pushed = other.distribution(q, len(a))
    torch.testing.assert_close(pushed.sum(-1), (q * other.mappable).sum(-1))


def test_permuted_vocabulary_drafter_is_perfect_and_output_lossless(tokenizers):
    a, b, _, new_id = tokenizers
    verifier = Transformer(tiny_config("qwen2", vocab_size=len(a), tie_embeddings=True)).init_weights(seed=1, std=0.1)
    drafter = Transformer(tiny_config("qwen2", vocab_size=len(b), tie_embeddings=True)).init_weights(seed=2)
    state = verifier.state_dict()
    index = torch.arange(len(a))
    for old, new in new_id.items():
        index[new] = old  # drafter row `new` is verifier row `old`
    state["embed.weight"] = state["embed.weight"][index]
    drafter.load_state_dict(state)
    prompt = a(TEXT, add_special_tokens=False)["input_ids"]
    want = greedy_generate(verifier.eval(), [prompt], 16)
    bridge = VocabBridge(b, a)
    res = generate(
        verifier,
        [prompt],
        SpecConfig(max_new_tokens=16, gamma=4),
        drafter=CrossTokenizerDrafter(ARDrafter(drafter.eval()), bridge, a, b),
    )
    assert res.tokens == want
    reached = [r for r in res.metrics.reached_at if r]
    assert reached and res.metrics.alpha[0] == 1.0  # the translated verifier drafts its own greedy tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_unrelated_tokenizer_drafter_runs_and_is_lossless_at_t0(tokenizers, temperature):
    a, _, c, _ = tokenizers
    verifier = Transformer(tiny_config("qwen2", vocab_size=len(a))).init_weights(seed=3, std=0.1).eval()
    cfg = tiny_config("qwen2", vocab_size=len(c), attention="prefix_causal", mask_token_id=2)
    drafter = Transformer(cfg).init_weights(seed=4, std=0.1).eval()
    prompts = [a(TEXT, add_special_tokens=False)["input_ids"], a("def f(x):", add_special_tokens=False)["input_ids"]]
    res = generate(
        verifier,
        prompts,
        SpecConfig(max_new_tokens=12, gamma=3, K=3, temperature=temperature),
        drafter=CrossTokenizerDrafter(DiffusionDrafter(drafter), VocabBridge(c, a), a, c),
    )
    assert all(len(t) == 12 for t in res.tokens)
    if temperature == 0:
        assert res.tokens == greedy_generate(verifier, prompts, 12)
