"""Tests for conversation prompt sets: layouts, field mapping, multi-turn splitting, dedupe, hashes, overlap, sources.

Run: .venv/bin/python -m pytest tests/data/test_conversations.py
"""

from __future__ import annotations

import json

import datasets
import huggingface_hub
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from streakline.data.benchmarks import BenchmarkError, load_benchmark
from streakline.data.conversations import (
    PRESETS,
    ConversationError,
    as_messages,
    dedupe,
    load_conversation_set,
    load_conversations,
    overlap,
    prompt_hash,
    render_prompt,
)

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _user(text):
    return {"role": "user", "content": text}


# --- layouts ---------------------------------------------------------------------------------------------------------


def test_messages_layout_keeps_every_turn_before_the_last_assistant_turn(tmp_path):
    path = _jsonl(tmp_path / "chats.jsonl", [{"id": "a", "messages": CHAT}])
    [rec] = load_conversations(path)
    assert rec["id"] == "chats/a" and rec["domain"] == "chat"
    assert rec["messages"] == CHAT[:4] and rec["reference"] == "4"
    assert rec["prompt"] == "System: Be brief.\nUser: Hi\nAssistant: Hello!\nUser: 2+2?\nAssistant:"
    assert set(rec) == {"id", "messages", "prompt", "reference", "domain"}


def test_conversation_ending_with_a_user_turn_is_all_prompt(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": CHAT[:4]}])
    [rec] = load_conversations(path)
    assert rec["messages"] == CHAT[:4] and rec["reference"] == "" and rec["id"] == "c/0"


def test_sharegpt_layout_maps_roles(tmp_path):
    turns = [
        {"from": "system", "value": "S"},
        {"from": "human", "value": "Q1"},
        {"from": "gpt", "value": "A1"},
        {"from": "User", "value": "Q2"},  # user/assistant and any case are accepted too
        {"from": "assistant", "value": "A2"},
    ]
    path = _jsonl(tmp_path / "sg.jsonl", [{"id": "x1", "conversations": turns}])
    result = load_conversation_set(path)
    assert result.layout == "sharegpt"
    [rec] = result.records
    assert [m["role"] for m in rec["messages"]] == ["system", "user", "assistant", "user"]
    assert rec["messages"][3]["content"] == "Q2" and rec["reference"] == "A2"


def test_prompt_layout_with_response_or_completion(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [{"prompt": "Q", "response": "R"}, {"prompt": "Q2"}])
    b = _jsonl(tmp_path / "b.jsonl", [{"prompt": "Q", "completion": "C"}])
    recs = load_conversations(a)
    assert recs[0]["messages"] == [_user("Q")] and recs[0]["reference"] == "R"
    assert recs[1]["reference"] == "" and recs[1]["prompt"] == "User: Q2\nAssistant:"
    assert load_conversations(b)[0]["reference"] == "C"


def test_json_array_and_parquet_files(tmp_path):
    rows = [{"messages": CHAT[1:3]}, {"messages": [_user("bye")]}]
    (tmp_path / "arr.json").write_text(json.dumps(rows), encoding="utf-8")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chats.parquet")
    for name in ("arr.json", "chats.parquet"):
        recs = load_conversations(tmp_path / name)
        assert [r["reference"] for r in recs] == ["Hello!", ""], name
        assert recs[0]["messages"] == [_user("Hi")]


def test_text_parts_content_is_joined(tmp_path):
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    path = _jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": parts}]}])
    assert load_conversations(path)[0]["messages"] == [_user("Hello")]


# --- field mapping ---------------------------------------------------------------------------------------------------


def test_field_mapping_renames_list_and_turn_keys(tmp_path):
    dialog = [{"speaker": "user", "text": "Q"}, {"speaker": "assistant", "text": "A"}]
    path = _jsonl(tmp_path / "d.jsonl", [{"uid": 7, "dialog": dialog}])
    [rec] = load_conversations(path, fields={"messages": "dialog", "role": "speaker", "content": "text", "id": "uid"})
    assert rec["messages"] == [_user("Q")] and rec["reference"] == "A" and rec["id"] == "d/7"


def test_field_mapping_of_prompt_columns(tmp_path):
    path = _jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "Do X", "output": "done"}])
    [rec] = load_conversations(path, fields={"prompt": "instruction", "response": "output"})
    assert rec["messages"] == [_user("Do X")] and rec["reference"] == "done"


def test_missing_mapped_field_lists_the_file_fields(tmp_path):
    path = _jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "Do X", "output": "done"}])
    with pytest.raises(ConversationError, match=r"'prompt' to 'question'.*\['instruction', 'output'\]"):
        load_conversations(path, fields={"prompt": "question"})
    with pytest.raises(ConversationError, match=r"'response' to 'answer'.*\['instruction', 'output'\]"):
        load_conversations(path, fields={"prompt": "instruction", "response": "answer"})
    dialog = _jsonl(tmp_path / "d.jsonl", [{"messages": [{"speaker": "user", "text": "Q"}]}])
    with pytest.raises(ConversationError, match=r"d.jsonl:1, turn 0 has no field 'role'.*\['speaker', 'text'\]"):
        load_conversations(dialog, fields={"content": "text"})


def test_unknown_or_misapplied_field_names_are_errors(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    with pytest.raises(ConversationError, match="unknown names"):
        load_conversations(path, fields={"question": "q"})
    with pytest.raises(ConversationError, match="does not use"):
        load_conversations(path, fields={"response": "r"})


def test_undetectable_layout_lists_fields(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", [{"question": "Q", "answer": "A"}])
    with pytest.raises(ConversationError, match=r"cannot tell the layout.*\['answer', 'question'\]"):
        load_conversations(path)


# --- errors ----------------------------------------------------------------------------------------------------------


def test_rows_must_share_the_layout(tmp_path):
    path = _jsonl(tmp_path / "mix.jsonl", [{"messages": CHAT}, {"prompt": "Q"}])
    with pytest.raises(ConversationError, match=r"mix.jsonl:2 has layout prompt.*'messages'"):
        load_conversations(path)


def test_unknown_role_and_empty_conversations_name_the_row(tmp_path):
    bad_role = _jsonl(tmp_path / "r.jsonl", [{"messages": CHAT}, {"messages": [{"role": "bot", "content": "x"}]}])
    with pytest.raises(ConversationError, match=r"r.jsonl:2, turn 0: unknown role 'bot'"):
        load_conversations(bad_role)
    empty = _jsonl(tmp_path / "e.jsonl", [{"conversations": []}])
    with pytest.raises(ConversationError, match=r"e.jsonl:1: .* has no turns"):
        load_conversations(empty)
    no_user = _jsonl(tmp_path / "n.jsonl", [{"messages": [{"role": "assistant", "content": "x"}]}])
    with pytest.raises(ConversationError, match="no user turn"):
        load_conversations(no_user)


def test_skip_invalid_drops_and_counts_bad_rows(tmp_path):
    rows = [{"messages": CHAT}, {"messages": []}, {"messages": [{"role": "bot", "content": "x"}]}]
    result = load_conversation_set(_jsonl(tmp_path / "s.jsonl", rows), skip_invalid=True)
    assert len(result.records) == 1 and result.n_skipped == 2 and result.n_rows == 3


def test_empty_file_is_an_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConversationError, match="empty.jsonl is empty"):
        load_conversations(tmp_path / "empty.jsonl")


def test_non_utf8_file_names_file_and_line(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ConversationError, match=r"latin.jsonl:2 is not UTF-8"):
        load_conversations(path)
    with pytest.raises(BenchmarkError, match=r"latin.jsonl:2 is not UTF-8"):  # the shared reader, for benchmarks too
        load_benchmark("gsm8k", path=path)


def test_conversation_error_is_a_benchmark_error():
    assert issubclass(ConversationError, BenchmarkError) and issubclass(ConversationError, ValueError)


def test_missing_local_file(tmp_path):
    with pytest.raises(ConversationError, match="no conversation file or folder"):
        load_conversations(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ConversationError, match="neither a preset"):
        load_conversations("not-a-source")


# --- dedupe, hashes, overlap ----------------------------------------------------------------------------------------


def test_duplicate_prompts_are_dropped_first_kept(tmp_path):
    rows = [
        {"prompt": "Q", "response": "first"},
        {"prompt": "  Q\n", "response": "second"},  # same prompt once normalised
        {"prompt": "other"},
    ]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    result = load_conversation_set(path)
    assert [r["reference"] for r in result.records] == ["first", ""] and result.n_duplicates == 1
    assert len(load_conversations(path, dedupe=False)) == 3
    kept, dropped = dedupe(load_conversations(path, dedupe=False))
    assert [r["id"] for r in kept] == ["d/0", "d/2"] and dropped == 1


def test_limit_counts_records_after_dedupe(tmp_path):
    rows = [{"prompt": "a"}, {"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}]
    assert [r["id"] for r in load_conversations(_jsonl(tmp_path / "l.jsonl", rows), limit=2)] == ["l/0", "l/2"]


def test_repeated_ids_are_made_unique(tmp_path):
    path = _jsonl(tmp_path / "i.jsonl", [{"id": "x", "prompt": "a"}, {"id": "x", "prompt": "b"}])
    assert [r["id"] for r in load_conversations(path)] == ["i/x", "i/x#1"]


def test_prompt_hash_matches_between_benchmark_and_one_turn_conversation(tmp_path):
    bench = {"id": "gsm8k/0", "prompt": "What is 2+2?", "reference": "4", "domain": "math"}
    [conv] = load_conversations(_jsonl(tmp_path / "c.jsonl", [{"messages": [_user("What is 2+2?")]}]))
    assert prompt_hash(bench) == prompt_hash(conv)
    assert as_messages(bench) == conv["messages"]
    assert prompt_hash(bench) != prompt_hash({"prompt": "What is 2+3?"})
    assert prompt_hash(bench) != prompt_hash({"messages": [{"role": "system", "content": "What is 2+2?"}]})


def test_overlap_finds_eval_prompts_inside_training_conversations():
    evaluation = [{"id": "mt/1", "prompt": "Write a poem."}, {"id": "mt/2", "prompt": "Unrelated"}]
    train = [
        {"id": "t/0", "messages": [_user("Hi")]},
        {"id": "t/1", "messages": [{"role": "system", "content": "S"}, _user("Write a poem. ")]},
        {  # opens with the eval question, then goes on
            "id": "t/2",
            "messages": [_user("Write a poem."), {"role": "assistant", "content": "Roses"}, _user("Another")],
        },
        {"id": "t/3", "messages": [_user("Please: Write a poem.")]},
    ]
    assert overlap(train, evaluation) == ["t/1", "t/2"]
    assert overlap(train, []) == []


# --- rendering -------------------------------------------------------------------------------------------------------


def _tiny_tokenizer(template: str | None) -> PreTrainedTokenizerFast:
    model = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]")
    tok.chat_template = template
    return tok


def test_render_prompt_uses_the_chat_template():
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    out = render_prompt(CHAT[:4], _tiny_tokenizer(template))
    assert out == "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>Hello!\n<|user|>2+2?\n<|assistant|>"


def test_render_prompt_without_a_template_is_plain():
    expected = "User: Hi\nAssistant:"
    assert render_prompt([_user("Hi")]) == expected
    assert render_prompt([_user("Hi")], _tiny_tokenizer(None)) == expected


# --- folders and the hub ---------------------------------------------------------------------------------------------


def test_save_to_disk_folder_and_dataset_dict(tmp_path):
    ds = datasets.Dataset.from_list([{"messages": CHAT[1:3]}, {"messages": CHAT[1:5]}])
    ds.save_to_disk(str(tmp_path / "saved"))
    assert [r["reference"] for r in load_conversations(tmp_path / "saved")] == ["Hello!", "4"]
    datasets.DatasetDict({"train_sft": ds}).save_to_disk(str(tmp_path / "dd"))
    assert len(load_conversations(str(tmp_path / "dd"), split="train_sft")) == 2
    with pytest.raises(ConversationError, match=r"splits \['train_sft'\], not 'train'"):
        load_conversations(tmp_path / "dd")


def test_preset_fields_apply_to_a_local_file(tmp_path):
    path = _jsonl(tmp_path / "magic.jsonl", [{"problem": "Sort a list", "solution": "sorted(xs)"}])
    [rec] = load_conversations(f"code-instruct@{path}")
    assert rec["id"] == "code-instruct/0" and rec["reference"] == "sorted(xs)" and rec["domain"] == "code"
    assert rec["messages"] == [_user("Sort a list")]


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    return tmp_path


def test_uncached_hub_id_says_how_to_download(empty_hub_cache):
    flags = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    with pytest.raises(ConversationError) as err:
        load_conversations("nobody-here/no-such-chats", split="train_sft")
    msg = str(err.value)
    assert "python -c \"import datasets; datasets.load_dataset('nobody-here/no-such-chats', split='train_sft')\"" in msg
    assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) == flags  # restored


def test_uncached_preset_says_how_to_download(empty_hub_cache):
    with pytest.raises(ConversationError) as err:
        load_conversations("ultrachat")
    msg = str(err.value)
    assert "datasets.load_dataset('HuggingFaceH4/ultrachat_200k', split='train_sft')" in msg
    assert "ultrachat@/path/to/ultrachat.jsonl" in msg


def test_presets_are_well_formed():
    assert {"sharegpt", "ultrachat", "code-instruct"} <= set(PRESETS)
    for preset in PRESETS.values():
        assert "/" in preset.hub_id and preset.layout in ("messages", "sharegpt", "prompt") and preset.split


# --- one policy for bad rows -------------------------------------------------------------------------------------


def test_a_file_with_bad_rows_is_refused_by_line_or_skipped_and_counted_whichever_loader_reads_it(tmp_path):
    """A row with no user turn in a file: refused naming its line, by the generic loader and by a preset's
    (sharegpt@file) alike; with data.skip_bad_lines=true (``bad_lines(True)``) left out by both and counted where
    the manifest reads it. A line that is not UTF-8 is one more bad line."""
    from streakline.data.files import bad_lines, read_records

    good = {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}
    no_user = {"conversations": [{"from": "gpt", "value": "only me"}]}
    path = _jsonl(tmp_path / "chats.jsonl", [good, no_user, good | {"id": "x"}])
    for source in (str(path), f"sharegpt@{path}"):
        with pytest.raises(ConversationError, match=r"chats.jsonl:2: no user turn"):
            load_conversations(source, dedupe=False)
        with bad_lines(True) as tally:
            kept = load_conversations(source, dedupe=False)
        assert len(kept) == 2 and tally.skipped == 1, source
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n{"prompt": "b"}\n')
    with bad_lines(True) as tally:
        rows = read_records(latin)
    assert [r["prompt"] for r in rows] == ["a", "b"] and tally.skipped == 1
