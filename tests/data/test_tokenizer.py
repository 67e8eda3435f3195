"""Tests for the tiny-world tokenizer: exact round trips, special tokens, chat template, determinism, atomic writes."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from streakline.data.corpora.code import code_texts
from streakline.data.corpora.math import math_texts
from streakline.data.tokenizer import EOS, MASK, PAD, tiny_training_texts, train_tokenizer

VOCAB = 512


def _sample() -> list[str]:
    code = [r["text"] for r in itertools.islice(code_texts("train"), 12)]
    return code + [r["text"] for r in math_texts("train", 200)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return train_tokenizer(_sample(), tmp_path_factory.mktemp("tok") / "tiny", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return AutoTokenizer.from_pretrained(tok_dir)


TRICKY = [
    "",
    "def f(x):\n\tif x:\n        return  x ,  y . \n\n\n",
    "   leading and trailing spaces   ",
    "naïve café, 日本語, emoji 🙂👍🏽, math ∑ ≤ √2, zero\u200bwidth",
    "\r\n windows \r line endings \x0c form feed",
    "#### 12.5 . , ! ? 's n't",
]


def test_decode_of_encode_is_exact(tok):
    heldout_code = [r["text"][:4000] for r in itertools.islice(code_texts("heldout"), 3)]
    heldout_math = [r["text"] for r in math_texts("heldout", 20)]
    for text in TRICKY + heldout_code + heldout_math:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text


def test_special_tokens_and_vocab_size(tok):
    assert len(tok) == VOCAB
    assert tok.eos_token == tok.bos_token == EOS and tok.pad_token == PAD and tok.mask_token == MASK
    ids = {tok.eos_token_id, tok.pad_token_id, tok.mask_token_id}
    assert len(ids) == 3 and tok.bos_token_id == tok.eos_token_id
    # A special token written in text is one id, not pieces of its spelling.
    assert tok.encode(f"a{MASK}b", add_special_tokens=False).count(tok.mask_token_id) == 1
    assert tok.encode("hello", add_special_tokens=True) == tok.encode("hello", add_special_tokens=False)


def test_saved_class_name_loads_on_transformers_4_and_5(tok_dir):
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["clean_up_tokenization_spaces"] is False


def test_digits_are_single_tokens(tok):
    pieces = tok.convert_ids_to_tokens(tok.encode("12345", add_special_tokens=False))
    assert pieces == list("12345")


def test_chat_template(tok):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    assert tok.apply_chat_template(chat, tokenize=False) == f"system:\nBe brief.\nuser:\n2+2?\nassistant:\n4{EOS}\n"
    prompt = tok.apply_chat_template(chat[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "system:\nBe brief.\nuser:\n2+2?\nassistant:\n"
    out = tok.apply_chat_template(chat, return_dict=True, return_assistant_tokens_mask=True)
    marked = [i for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tok.decode(marked) == f"4{EOS}"  # the loss mask covers the answer and its eos, nothing else
    with pytest.raises(Exception, match="unknown chat role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_training_is_deterministic_and_replaces_atomically(tmp_path, tok_dir):
    again = train_tokenizer(_sample(), tmp_path / "tiny", vocab_size=VOCAB)
    files = sorted(p.name for p in tok_dir.iterdir())
    assert files == sorted(p.name for p in again.iterdir()) and "tokenizer.json" in files
    for name in files:
        assert (tok_dir / name).read_bytes() == (again / name).read_bytes(), name
    # Retraining over an existing folder replaces it and leaves no temp or old folders beside it.
    (again / "stale.txt").write_text("x")
    assert train_tokenizer(_sample(), again, vocab_size=VOCAB) == again
    assert not (again / "stale.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]


def test_too_little_text_fails_cleanly(tmp_path):
    with pytest.raises(ValueError, match="fewer than vocab_size"):
        train_tokenizer(["tiny text"] * 3, tmp_path / "tok", vocab_size=VOCAB)
    with pytest.raises(ValueError, match="must exceed"):
        train_tokenizer(_sample(), tmp_path / "tok", vocab_size=200)
    assert list(tmp_path.iterdir()) == []


def test_training_mix_is_code_train_then_math_train():
    texts = list(tiny_training_texts(n_math=7, seed=0))
    code = [r["text"] for r in code_texts("train")]
    assert texts[: len(code)] == code
    assert texts[len(code) :] == [r["text"] for r in math_texts("train", 7, seed=0)]
