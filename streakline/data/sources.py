"""Prompt sources as every stage names them, and the one way a prompt becomes text for a model.

A source (an entry of ``data.prompt_sources``, ``stage.benchmarks``, ``stage.prompt_sources``, ``trainer.eval_sources``)
is one of:

    tiny-math, tiny-chat, humaneval, gsm8k@/x.jsonl    a benchmark (benchmarks.py: built in, or a real one from the file
                                                       after '@', an installed package, or the local HF cache)
    ultrachat, sharegpt@/data/sharegpt.json            a conversation preset (conversations.PRESETS)
    conversations@/data/chats.jsonl                    any chat file or cached datasets repo, layout detected
    conversations@HuggingFaceH4/ultrachat_200k         (columns renamed through ``data.fields``)
    self-chat                                          requests the verifier writes (data.prompt_sources only:
                                                       stage=trajectories samples them, pipelines/common/self_chat.py)

    records = load_source("conversations@/data/chats.jsonl", limit=1000, fields={"prompt": "instruction"})
    text = prompt_for(records[0], tokenizer, chat_template=True)

``prompt_for`` is shared by trajectories, evaluate, sweep, the SPOT / Spiffy trace collectors and distill's held-out
check, so a drafter is trained and measured on prompts rendered the same way: through the tokenizer's chat template
when ``data.chat_template`` is true and the tokenizer has one (a benchmark prompt as one user turn, a conversation with
all its turns), else as raw text (a conversation in the plain ``User: ... Assistant:`` rendering).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .benchmarks import BenchmarkError, benchmark_names, load_benchmark, parse_source, prompt_text
from .conversations import PRESETS, as_messages, load_conversations, render_prompt
from .self_chat import SELF_CHAT

CONVERSATIONS = "conversations"  # conversations@<file or hub id>


def source_names() -> list[str]:
    """Every name a source may start with (``self-chat`` only in ``data.prompt_sources``)."""
    return [*benchmark_names(), *PRESETS, CONVERSATIONS, SELF_CHAT]


def load_source(
    source: str, *, limit: int | None = None, fields: Mapping[str, str] | None = None
) -> list[dict[str, Any]]:
    """Records of ``source`` (``{"id", "prompt", "reference", "domain"}``, and ``messages`` for conversations), at
    most ``limit``. ``fields`` maps a conversation file's column names (``conversations@...`` only: presets carry
    their own); BenchmarkError (a UserError) names the source and the fix when it cannot be read."""
    name, path = parse_source(source)
    if name == CONVERSATIONS:
        if path is None:
            raise BenchmarkError(
                f"{CONVERSATIONS} needs a file or hub id after '@', e.g. conversations@/data/chats.jsonl"
            )
        return load_conversations(path, fields=dict(fields or {}) or None, limit=limit)
    if name in PRESETS:
        return load_conversations(source, limit=limit)
    if name == SELF_CHAT:
        raise BenchmarkError(
            f"{SELF_CHAT} is written by the verifier while stage=trajectories samples (an entry of "
            "data.prompt_sources); it is no evaluation set: name a benchmark or a prompt file here"
        )
    if name not in benchmark_names():
        raise BenchmarkError(
            f"unknown prompt source {name!r}; benchmarks: {', '.join(benchmark_names())}; conversation sets: "
            f"{', '.join(PRESETS)}; or any chat file as {CONVERSATIONS}@/path/to/file.jsonl"
        )
    return load_benchmark(name, path=path, limit=limit)


def source_label(source: str) -> str:
    """The name results are filed under: ``gsm8k@/data/x.jsonl`` -> ``gsm8k``; ``conversations@/data/chats.jsonl``
    -> ``chats`` (the file's stem, or the hub id's last part)."""
    name, path = parse_source(source)
    if name == CONVERSATIONS and path:
        return path.rstrip("/").rsplit("/", 1)[-1].split(".", 1)[0]
    return name


def prompt_for(record: Mapping[str, Any], tokenizer: Any, chat_template: bool) -> str:
    """The text a model continues for ``record``: the chat template's rendering when ``chat_template`` is on and the
    tokenizer has one, else the raw prompt (a conversation's plain rendering, a benchmark's ``prompt_text``)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        return render_prompt(as_messages(record), tokenizer)
    if record.get("messages"):
        return render_prompt(record["messages"])
    return prompt_text(record)
