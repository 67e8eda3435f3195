"""``self-chat`` (``streakline/data/self_chat.py``, ``streakline/pipelines/common/self_chat.py``): the user-turn prefix
a template gives, what is kept as a request, and on the micro world the source itself: reproducible from the seed,
cached, continued by a larger ask with the same first requests, evaluation prompts kept out, refused where it is
not a training source.

    python -m pytest tests/data/test_self_chat.py -q
"""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from streakline.config import ConfigError, compose_config
from streakline.data import self_chat
from streakline.data.benchmarks import BenchmarkError
from streakline.data.self_chat import accept, dedup_key, user_turn
from streakline.data.sources import load_source
from streakline.world.build import attach_world

CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nBe helpful.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(template: str | None) -> PreTrainedTokenizerFast:
    model = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]")
    tok.chat_template = template
    return tok


def test_the_user_turn_is_read_off_the_template():
    prefix, end = user_turn(_tokenizer(CHATML), chat_template=True)
    assert prefix == "<|im_start|>system\nBe helpful.<|im_end|>\n<|im_start|>user\n" and end == "<|im_end|>"
    assert user_turn(_tokenizer(CHATML), chat_template=False) == ("User: ", "\n")  # data.chat_template=false
    assert user_turn(_tokenizer(None), chat_template=True) == ("User: ", "\n")  # no template: the plain rendering
    with pytest.raises(self_chat.SelfChatError, match="no user message"):
        user_turn(_tokenizer("{{ 'fixed text' }}"), chat_template=True)


@pytest.mark.parametrize(
    ("text", "kept", "why"),
    [
        ("How do I sort a list in Python?<|im_end|>", "How do I sort a list in Python?", "ok"),
        ("  Write a haiku about rain.  <|im_end|>\n<|im_start|>", "Write a haiku about rain.", "ok"),
        ("How do I sort a list in", None, "unended"),  # cut off at the token limit
        ("Hello!<|im_end|>", None, "length"),
        (" ".join(["word"] * 121) + "<|im_end|>", None, "length"),
        ("Как отсортировать список в питоне?<|im_end|>", None, "script"),
        ("Summarise this <|im_start|> text for me<|im_end|>", None, "debris"),
        ("What is 2+2?\nAssistant: 4, and then<|im_end|>", None, "debris"),  # the model wrote a conversation
        # the micro verifier's noise, of a request's shape (issue 62, item 6): 4 of its 11 words known
        ('__ ny3c__ it ta son mores andSfh3 each o00 c many"erri8k.esinatMfp isalet<|im_end|>', None, "language"),
        (
            "Write a function `is_prime(n)` that returns True for primes.<|im_end|>",
            "Write a function `is_prime(n)` that returns True for primes.",
            "ok",
        ),  # code names are not words: 8 of 9
    ],
)
def test_what_is_kept_as_a_request(text, kept, why):
    assert accept(text, "<|im_end|>") == (kept, why)


def test_repeats_are_the_same_request_up_to_case_spacing_and_final_punctuation():
    assert dedup_key("How do  I sort a list?") == dedup_key("how do i sort a list") == "how do i sort a list"
    assert dedup_key("Sort a list.") != dedup_key("Sort a set.")


def test_self_chat_is_refused_where_it_is_not_a_training_source():
    with pytest.raises(BenchmarkError, match="written by the verifier while stage=trajectories samples"):
        load_source("self-chat", limit=4)


# ---------------------------------------------------------------------------------------------- the micro world
def _cfg(root, *extra):
    overrides = ["stage=trajectories", "model=micro", f"run_root={root}", "data.prompt_sources=[self-chat]",
                 "data.mix_weights=[]", "precision=fp32", *extra]  # fmt: skip
    return attach_world(compose_config(overrides), progress=False)


def _never():
    raise AssertionError("sampled again: the requests should have come from the cache")


@pytest.fixture(scope="module")
def root(micro_world):
    return micro_world[0]


def test_the_micro_verifiers_noise_is_dropped_for_its_language(root):
    """The micro verifier writes noise of a request's shape, which passes every rule of shape; the language rule
    drops most of it, and what it keeps is at least half English words (issue 62, item 6)."""
    from streakline.data.english import known_share
    from streakline.pipelines.common.self_chat import folder, self_chat_records
    from streakline.pipelines.trajectories import build_verifier

    cfg = _cfg(root, "data.seed=3")
    kept = self_chat_records(cfg, 6, build=lambda: build_verifier(cfg), evaluation={})
    state = json.loads((folder(cfg, "User: ", "\n", {}) / "state.json").read_text())
    shaped = state["judged"] - sum(n for why, n in state["dropped"].items() if why != "language")
    assert state["dropped"]["language"] >= 0.8 * shaped, state  # of the requests of the right shape
    assert all(known_share(r["prompt"]) >= self_chat.KNOWN_SHARE for r in kept)


def test_the_verifier_writes_requests_that_are_cached_and_continued(root, monkeypatch):
    from streakline.pipelines.common.self_chat import folder, self_chat_records
    from streakline.pipelines.trajectories import build_verifier

    # the micro verifier's requests are noise, which the language rule drops (the test above); the source's
    # machinery (seeds, the cache, continuing, exclusion) is what this test is about, so the rule is off here
    monkeypatch.setattr(self_chat, "KNOWN_SHARE", 0.0)
    cfg = _cfg(root)
    none: dict[str, int] = {}
    first = self_chat_records(cfg, 6, build=lambda: build_verifier(cfg), evaluation=none)
    assert 0 < len(first) <= 6 and len({dedup_key(r["prompt"]) for r in first}) == len(first)
    for r in first:
        assert r["id"].startswith("self-chat-") and r["domain"] == "chat"
        assert accept(r["prompt"] + "\n", "\n") == (r["prompt"], "ok")
    # cached: read back without a verifier; a smaller ask is the same list's start
    assert self_chat_records(cfg, 6, build=_never, evaluation=none) == first
    assert self_chat_records(cfg, 2, build=_never, evaluation=none) == first[:2]
    more = self_chat_records(cfg, 10, build=lambda: build_verifier(cfg), evaluation=none)
    assert more[: len(first)] == first and len(more) >= len(first)
    where = folder(cfg, "User: ", "\n", none)
    state = json.loads((where / "state.json").read_text())
    assert state["kept"] == len(more) and state["judged"] >= len(more)

    # reproducible: sampled afresh from the seed, the same requests; another seed, other ones
    shutil.rmtree(where)
    assert self_chat_records(cfg, 6, build=lambda: build_verifier(cfg), evaluation=none) == first
    other = _cfg(root, "data.seed=7")
    assert self_chat_records(other, 6, build=lambda: build_verifier(other), evaluation=none) != first

    # an evaluation set's prompt is never kept: make the first request one, and it is left out
    evaluation = {f"conversations@{_eval_file(root, first[0]['prompt'])}": 1}
    kept = self_chat_records(cfg, 6, build=lambda: build_verifier(cfg), evaluation=evaluation)
    assert first[0]["prompt"] not in [r["prompt"] for r in kept]
    assert [r["prompt"] for r in kept[: len(first) - 1]] == [r["prompt"] for r in first[1:]]


def _eval_file(root, prompt: str):
    path = root / "eval-set.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": prompt}]}) + "\n")
    return path


def test_the_stage_needs_a_count_and_keys_the_source(root):
    from streakline.pipelines.common.lookup import trajectories_key
    from streakline.pipelines.common.self_chat import RECIPE
    from streakline.pipelines.trajectories import prompt_mix

    with pytest.raises(ConfigError, match="set data.max_prompts"):
        prompt_mix(_cfg(root, "data.max_prompts=null"))
    key = trajectories_key(_cfg(root, "data.max_prompts=4"), "tok")
    assert key["self_chat"]["recipe"] == RECIPE and "excluded" in key["self_chat"]
    assert "self_chat" not in trajectories_key(_cfg(root, "data.prompt_sources=[tiny-math-train]"), "tok")
