"""data/sources.py: every source name resolves to its loader, and prompt_for renders a record one way for all stages."""

import json

import pytest

from streakline.data.benchmarks import BenchmarkError, load_benchmark, prompt_text
from streakline.data.sources import load_source, prompt_for, source_label
from tests.data.test_conversations import _tiny_tokenizer

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHAT = [
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                  {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
    {"messages": [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7"}]},
]  # fmt: skip


@pytest.fixture
def chats(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    return path


def test_each_kind_of_source_reaches_its_loader(chats, tmp_path):
    assert load_source("tiny-math", limit=3) == load_benchmark("tiny-math", limit=3)
    got = load_source(f"conversations@{chats}")
    assert [r["reference"] for r in got] == ["4", "7"] and len(got[0]["messages"]) == 3  # every turn kept
    assert load_source(f"ultrachat@{chats}", limit=1)[0]["reference"] == "4"  # a preset's layout on a local file
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": "Add 2 and 3.", "output": "5"}]))
    (row,) = load_source(f"conversations@{alpaca}", fields={"prompt": "instruction", "response": "output"})
    assert row["messages"] == [{"role": "user", "content": "Add 2 and 3."}] and row["reference"] == "5"
    assert source_label(f"conversations@{chats}") == "chats" and source_label("gsm8k@/x/y.jsonl") == "gsm8k"


def test_a_bad_source_name_lists_every_kind():
    with pytest.raises(BenchmarkError, match=r"unknown prompt source 'ultrachatt'.*ultrachat.*conversations@"):
        load_source("ultrachatt")
    with pytest.raises(BenchmarkError, match="conversations needs a file or hub id after '@'"):
        load_source("conversations")


def test_prompt_for_renders_through_the_template_only_when_asked_and_present(chats):
    math = load_benchmark("tiny-math", limit=1)[0]
    chat = load_source(f"conversations@{chats}")[0]
    templated, plain = _tiny_tokenizer(TEMPLATE), _tiny_tokenizer(None)
    # no template asked for, or none to apply: raw text (a conversation in its plain rendering)
    for tok, asked in ((templated, False), (plain, True)):
        assert prompt_for(math, tok, asked) == prompt_text(math)
        assert prompt_for(chat, tok, asked) == "User: Hi\nAssistant: Hello!\nUser: 2+2?\nAssistant:"
    # the template: a benchmark prompt as one user turn, a conversation with all its turns
    assert prompt_for(math, templated, True) == f"<|user|>{math['prompt']}\n<|assistant|>"
    assert prompt_for(chat, templated, True) == "<|user|>Hi\n<|assistant|>Hello!\n<|user|>2+2?\n<|assistant|>"
