"""Conversation prompt sets: chat files and cached hub datasets turned into prompts with their multi-turn history.

Verifier trajectories need prompts, and the benchmark loaders (``benchmarks.py``) only hold evaluation splits that
keep the first turn. This module reads generic instruction / chat data, keeps every turn, and checks training
prompts against evaluation prompts. Each record is

    {"id": "<source>/<row id>", "messages": [{"role", "content"}, ...], "prompt": <plain text>,
     "reference": <final assistant turn or "">, "domain": "chat"}

``messages`` is the prompt side of the conversation (``system`` / ``user`` / ``assistant`` turns): every turn before
the final assistant turn, whose content becomes ``reference``. A conversation that does not end with an assistant
turn is all prompt, with ``reference == ""``. ``prompt`` is ``render_prompt(messages)``, the plain rendering for a
tokenizer without a chat template; with one, render ``messages`` through ``render_prompt(messages, tokenizer)``.

    load_conversations("/data/chats.jsonl")                        # layout detected from the first row
    load_conversations("/data/alpaca.json", fields={"prompt": "instruction", "response": "output"})
    load_conversations("/data/dialogs.parquet", fields={"messages": "dialog", "role": "speaker", "content": "text"})
    load_conversations("ultrachat", limit=1000)                    # a preset, only if in the local datasets cache
    load_conversations("sharegpt@/data/sharegpt.json")             # a preset's layout and fields on a local file
    load_conversations("HuggingFaceH4/ultrachat_200k", split="train_sft")   # any cached hub id
    load_conversations("/data/saved")                              # a datasets.save_to_disk folder or data folder

A source is, in this order: an existing local file (.jsonl, .json or .parquet) or folder; ``<preset>@<path>``; a
``PRESETS`` name; a hub id ``owner/name``. Hub data is read with the hub forced offline; an uncached id raises a
``ConversationError`` that gives the command that downloads it. Layouts (``LAYOUTS``), detected from the first
row's fields, and every row must have the same one:

- ``messages``: ``[{"role": "user" | "assistant" | "system", "content": str}, ...]`` (OpenAI / Hugging Face chat);
- ``sharegpt``: ``conversations: [{"from": "human" | "gpt" | "system", "value": str}, ...]``;
- ``prompt``: a ``prompt`` text column, with an optional ``response`` (or ``completion``) column.

Roles are matched case-insensitively through ``ROLES`` (human -> user, gpt -> assistant). Deduplication
(``dedupe``, on by default) drops repeated prompts by ``prompt_hash``; ``overlap`` lists training records whose
prompts occur in an evaluation set. Tests: ``.venv/bin/python -m pytest tests/data/test_conversations.py``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .benchmarks import BenchmarkError
from .files import FILE_SUFFIXES, current_tally, hub_offline, read_numbered

log = logging.getLogger(__name__)

LAYOUTS = ("messages", "sharegpt", "prompt")
# The key a layout is recognised by, in the order detection tries them (ultrachat rows hold both messages and prompt).
LAYOUT_KEY = {"messages": "messages", "sharegpt": "conversations", "prompt": "prompt"}
# Canonical names ``fields`` may map, per layout; for the two list layouts role/content name the keys inside a turn.
LAYOUT_FIELDS = {
    "messages": ("messages", "role", "content", "id"),
    "sharegpt": ("conversations", "role", "content", "id"),
    "prompt": ("prompt", "response", "id"),
}
FIELD_NAMES = ("messages", "conversations", "prompt", "role", "content", "response", "id")
TURN_KEYS = {"messages": ("role", "content"), "sharegpt": ("from", "value")}  # defaults of role, content
RESPONSE_KEYS = ("response", "completion")
ID_KEYS = ("id", "conversation_id", "prompt_id", "question_id", "task_id")
ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system"}
PLAIN_LABELS = {"system": "System", "user": "User", "assistant": "Assistant"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ConversationError(BenchmarkError):
    """A conversation source cannot be read; the message names the file (or hub id) and row, counted from 0."""


class _RowError(ConversationError):
    """One row is unusable; ``skip_invalid=True`` drops such rows instead of failing."""


@dataclass(frozen=True)
class ConversationPreset:
    """A public instruction set: its hub id, split, layout and the ``fields`` mapping its columns need."""

    name: str
    hub_id: str
    split: str
    layout: str
    fields: Mapping[str, str] = field(default_factory=dict)
    config: str | None = None
    skip_invalid: bool = False  # raw scrapes hold rows with no turns or odd roles; drop those rather than fail
    domain: str = "chat"


# Hub ids are the commonly used copies loadable by ``datasets.load_dataset``; check them (and their licences) before
# relying on one: hub repos get renamed, gated or restructured. anon8231489123/ShareGPT_Vicuna_unfiltered is a bare
# JSON file, not a datasets repo: download it and use ``sharegpt@/path/ShareGPT_V3_unfiltered_cleaned_split.json``.
PRESETS: dict[str, ConversationPreset] = {
    p.name: p
    for p in (
        ConversationPreset("sharegpt", "Aeala/ShareGPT_Vicuna_unfiltered", "train", "sharegpt", skip_invalid=True),
        ConversationPreset("ultrachat", "HuggingFaceH4/ultrachat_200k", "train_sft", "messages"),
        ConversationPreset("slimorca", "Open-Orca/SlimOrca", "train", "sharegpt"),
        ConversationPreset(
            "code-instruct",
            "ise-uiuc/Magicoder-OSS-Instruct-75K",
            "train",
            "prompt",
            fields={"prompt": "problem", "response": "solution"},
            domain="code",
        ),
    )
}


@dataclass
class ConversationSet:
    """What ``load_conversation_set`` read: the records and how many rows were looked at, skipped and deduplicated."""

    source: str
    layout: str
    records: list[dict[str, Any]]
    n_rows: int  # rows examined (all of them unless ``limit`` stopped the reading early)
    n_skipped: int  # invalid rows dropped under skip_invalid=True
    n_duplicates: int  # rows whose prompt repeated an earlier one


def load_conversations(source: str | Path, **options: Any) -> list[dict[str, Any]]:
    """Records ``{"id", "messages", "prompt", "reference", "domain"}`` of ``source``; ``options`` are
    ``load_conversation_set``'s (fields, split, limit, layout, config, dedupe, skip_invalid). This drops the counts
    after logging them.
    """
    result = load_conversation_set(source, **options)
    log.info(
        "%s: %d conversations (%s layout) from %d rows; %d duplicate prompts dropped, %d invalid rows skipped",
        result.source,
        len(result.records),
        result.layout,
        result.n_rows,
        result.n_duplicates,
        result.n_skipped,
    )
    return result.records


def load_conversation_set(
    source: str | Path,
    *,
    fields: Mapping[str, str] | None = None,
    split: str | None = None,
    limit: int | None = None,
    layout: str | None = None,
    config: str | None = None,
    dedupe: bool = True,
    skip_invalid: bool | None = None,
) -> ConversationSet:
    """Read ``source`` (a file, folder, ``preset@path``, preset name or cached hub id) into a ``ConversationSet``.

    ``fields`` maps canonical names (``FIELD_NAMES``) to the source's own, e.g. ``{"prompt": "instruction"}``;
    mapping a layout's key (messages / conversations / prompt) also fixes the layout, as ``layout`` does. A preset
    supplies fields, split, config and skip_invalid; the arguments override them. ``split`` (default ``"train"``)
    and ``config`` apply to hub ids and folders. ``limit`` counts records kept after deduplication; rows after it
    are not read. ``skip_invalid`` drops rows with an unknown role, no turns or no user turn instead of raising.
    """
    if limit is not None and limit < 0:
        raise ConversationError(f"limit must be >= 0, got {limit}")
    if layout is not None and layout not in LAYOUTS:
        raise ConversationError(f"unknown layout {layout!r}; valid layouts: {', '.join(LAYOUTS)}")
    preset, path, hub_id = _resolve(source)
    forced = skip_invalid is not None  # the caller's own choice wins over every default
    fields = dict(fields or {})
    if preset is not None:
        if layout is None and not fields.keys() & set(LAYOUT_KEY.values()):
            layout = preset.layout  # unless the caller's fields name another layout's key
        fields = {**preset.fields, **fields}
        split = split or preset.split
        config = config or preset.config
        skip_invalid = preset.skip_invalid if skip_invalid is None else skip_invalid
    _check_field_names(fields)
    split = split or "train"
    if path is not None:
        label = str(path)
        lines = None
        if path.is_dir():
            rows = _read_path(path, split, config)
        else:
            rows, lines = read_numbered(path, kind="conversation", error=ConversationError)
        name = preset.name if preset is not None else (path.stem if path.is_file() else path.name)
        # one policy for a file, whichever loader reads it: its invalid rows are refused, naming the line, unless
        # data.skip_bad_lines=true, which leaves them out and counts them (a preset's own skip_invalid is for the
        # public set it names, whose rows nobody here can fix)
        if not forced:
            tally = current_tally()
            skip_invalid = tally is not None and tally.skip
    else:
        label, lines = hub_id, None
        rows = _read_hub(hub_id, config, split, preset)
        name = preset.name if preset is not None else hub_id
    out = _convert(
        rows,
        label=label,
        name=name,
        fields=fields,
        layout=layout,
        limit=limit,
        dedupe=dedupe,
        skip_invalid=bool(skip_invalid),
        domain=preset.domain if preset is not None else "chat",
        lines=lines,
    )
    if out.n_skipped:  # counted where the manifest reads it, and said, not only logged
        tally = current_tally()
        if tally is not None:
            tally.skipped += out.n_skipped
        print(f"conversation source {label}: left out {out.n_skipped} invalid row(s) (no turns, an unknown role or "
              "no user turn)")  # fmt: skip
    return out


# ---------------------------------------------------------------- prompts, hashes, overlap


def as_messages(record: Mapping[str, Any]) -> list[dict[str, str]]:
    """The prompt turns of a conversation record, or a benchmark record's ``prompt`` as one user turn."""
    if record.get("messages"):
        return [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    return [{"role": "user", "content": record["prompt"]}]


def render_prompt(messages: Sequence[Mapping[str, str]], tokenizer: Any = None) -> str:
    """The text a model continues to answer ``messages``.

    With a tokenizer whose ``chat_template`` is set: ``tokenizer.apply_chat_template(messages, tokenize=False,
    add_generation_prompt=True)``. Otherwise a plain rendering, one turn per line labelled by role, ending with the
    label the answer follows::

        System: Be brief.
        User: Hi
        Assistant: Hello!
        User: 2+2?
        Assistant:

    (multi-line contents are kept as they are; the model's text starts right after the final ``"Assistant:"``).
    """
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{PLAIN_LABELS[m['role']]}: {m['content']}\n" for m in messages) + "Assistant:"


def prompt_hash(record: Mapping[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON of a record's prompt turns (``as_messages``), contents normalised.

    Normalising: CRLF -> LF, surrounding whitespace stripped. A benchmark record ``{"prompt": q}`` and a conversation
    whose only prompt turn is ``{"role": "user", "content": q}`` hash the same.
    """
    return _hash_turns(as_messages(record))


def dedupe(records: Iterable[Mapping[str, Any]]) -> tuple[list[Any], int]:
    """(records without repeated prompts, each first one kept in order; the number dropped), by ``prompt_hash``."""
    seen: set[str] = set()
    kept, dropped = [], 0
    for record in records:
        h = prompt_hash(record)
        if h in seen:
            dropped += 1
        else:
            seen.add(h)
            kept.append(record)
    return kept, dropped


def overlap(train: Iterable[Mapping[str, Any]], evaluation: Iterable[Mapping[str, Any]]) -> list[str]:
    """Ids of the ``train`` records that contain an ``evaluation`` prompt, in ``train`` order.

    A training record contains an evaluation prompt when some prefix of its prompt turns that ends with a user turn
    equals that prompt, system turns left out on both sides: a training chat that opens with an MT-Bench question
    and goes on for more turns counts. Contents are compared as ``prompt_hash`` normalises them, and records of
    either kind may be benchmark records (``prompt`` only) or conversations.
    """
    held = {_hash_turns(_no_system(as_messages(r))) for r in evaluation}
    found = []
    for record in train:
        turns = _no_system(as_messages(record))
        if any(turns[k - 1]["role"] == "user" and _hash_turns(turns[:k]) in held for k in range(1, len(turns) + 1)):
            found.append(record["id"])
    return found


def _hash_turns(turns: Sequence[Mapping[str, str]]) -> str:
    canonical = [{"content": t["content"].replace("\r\n", "\n").strip(), "role": t["role"]} for t in turns]
    blob = json.dumps(canonical, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _no_system(turns: list[dict[str, str]]) -> list[dict[str, str]]:
    return [t for t in turns if t["role"] != "system"]


# ---------------------------------------------------------------- sources


def _resolve(source: str | Path) -> tuple[ConversationPreset | None, Path | None, str | None]:
    """(preset, local path, hub id) that ``source`` names; exactly one of path and hub id is set."""
    path = Path(source).expanduser()
    if path.exists():
        return None, path, None
    if isinstance(source, Path):
        raise ConversationError(f"no conversation file or folder at {source}")
    name, sep, rest = source.partition("@")
    if sep and name in PRESETS:
        if not rest:
            raise ConversationError(f"source {source!r} names no file after '@'; write {name}@/path/to/file.jsonl")
        local = Path(rest).expanduser()
        if not local.exists():
            raise ConversationError(f"no conversation file or folder at {local} (from source {source!r})")
        return PRESETS[name], local, None
    if source in PRESETS:
        return PRESETS[source], None, PRESETS[source].hub_id
    looks_like_path = source.startswith(("/", ".", "~")) or path.suffix.lower() in FILE_SUFFIXES
    if _HUB_ID.match(source) and not looks_like_path:
        return None, None, source
    raise ConversationError(
        f"no conversation file or folder at {source}, and it is neither a preset ({', '.join(PRESETS)}) "
        "nor a hub id of the form owner/name"
    )


def _read_path(folder: Path, split: str, config: str | None) -> Any:
    """Rows of a local folder: a ``save_to_disk`` dataset (or dataset dict, by split) or a folder of data files."""
    import datasets

    try:
        if (folder / "dataset_dict.json").is_file():
            saved = datasets.load_from_disk(str(folder))
            if split not in saved:
                raise ConversationError(f"{folder} has splits {sorted(saved)}, not {split!r}; pass split=")
            return saved[split]
        if (folder / "state.json").is_file():
            return datasets.load_from_disk(str(folder))
        with hub_offline():
            return datasets.load_dataset(str(folder), *([config] if config else []), split=split)
    except ConversationError:
        raise
    except Exception as e:  # the folder is there but datasets cannot make rows of it: say which and why
        raise ConversationError(f"cannot read {folder} as a dataset (split {split!r}): {type(e).__name__}: {e}") from e


def _read_hub(hub_id: str, config: str | None, split: str, preset: ConversationPreset | None) -> Any:
    import datasets

    try:
        with hub_offline():
            return datasets.load_dataset(hub_id, *([config] if config else []), split=split)
    except Exception as e:  # any failure here means "not usable from the cache"; the hint below is the fix
        raise ConversationError(_how_to_get(hub_id, config, split, preset, f"{type(e).__name__}: {e}")) from e


def _how_to_get(hub_id: str, config: str | None, split: str, preset: ConversationPreset | None, why: str) -> str:
    load_args = ", ".join(repr(a) for a in (hub_id, config) if a)
    what = f"preset {preset.name!r} ({hub_id})" if preset is not None else hub_id
    local = f"{preset.name}@/path/to/{preset.name}.jsonl" if preset is not None else "/path/to/file.jsonl"
    return (
        f"conversation set {what}, split {split!r}, is not in the local Hugging Face cache and nothing is downloaded "
        f"at run time ({why}). Either fetch it once on a machine with hub access: "
        f"python -c \"import datasets; datasets.load_dataset({load_args}, split='{split}')\" "
        f"(it lands in the datasets cache that is read here), or point at a local copy: {local} "
        "(.jsonl, .json or .parquet) or a datasets.save_to_disk folder"
    )


# ---------------------------------------------------------------- rows -> records


def _check_field_names(fields: Mapping[str, str]) -> None:
    unknown = sorted(set(fields) - set(FIELD_NAMES))
    if unknown:
        raise ConversationError(f"fields maps unknown names {unknown}; it maps these names: {', '.join(FIELD_NAMES)}")
    bad = {k: v for k, v in fields.items() if not isinstance(v, str) or not v}
    if bad:
        raise ConversationError(f"fields must map names to non-empty column names; got {bad}")
    named = [lay for lay in LAYOUTS if LAYOUT_KEY[lay] in fields]
    if len(named) > 1:
        raise ConversationError(f"fields maps the keys of several layouts ({', '.join(named)}); map one")


def _detect(row: Mapping[str, Any], fields: Mapping[str, str]) -> str | None:
    return next((lay for lay in LAYOUTS if fields.get(LAYOUT_KEY[lay], LAYOUT_KEY[lay]) in row), None)


def _choose_layout(
    first: Mapping[str, Any], fields: Mapping[str, str], layout: str | None, label: str
) -> tuple[str, bool]:
    """(the layout, whether it was detected rather than named by ``layout`` or a mapped layout key)."""
    named = next((lay for lay in LAYOUTS if LAYOUT_KEY[lay] in fields), None)
    if layout is not None and named is not None and named != layout:
        raise ConversationError(f"layout={layout!r} but fields maps {LAYOUT_KEY[named]!r} of layout {named!r}")
    chosen = layout or named or _detect(first, fields)
    if chosen is None:
        raise ConversationError(
            f"{label}: cannot tell the layout; row 0 has fields {sorted(first)}, none of "
            f"'messages' (list of role/content turns), 'conversations' (ShareGPT from/value turns) or 'prompt'. "
            "Name yours with fields=, e.g. {'messages': 'dialog'} or {'prompt': 'instruction', 'response': 'output'}"
        )
    unused = sorted(set(fields) - set(LAYOUT_FIELDS[chosen]))
    if unused:
        raise ConversationError(
            f"{label}: fields maps {unused}, which the {chosen!r} layout does not use "
            f"(it maps {', '.join(LAYOUT_FIELDS[chosen])})"
        )
    for canon in ("messages", "conversations", "prompt", "response", "id"):
        if canon in fields and canon in LAYOUT_FIELDS[chosen] and fields[canon] not in first:
            raise ConversationError(
                f"{label}: fields maps {canon!r} to {fields[canon]!r}, but row 0 has no such field; "
                f"its fields are {sorted(first)}"
            )
    key = fields.get(LAYOUT_KEY[chosen], LAYOUT_KEY[chosen])
    if key not in first:
        raise ConversationError(f"{label}: layout {chosen!r} reads field {key!r}, but row 0 has {sorted(first)}")
    return chosen, layout is None and named is None


def _convert(
    rows: Iterable[Mapping[str, Any]],
    *,
    label: str,
    name: str,
    fields: Mapping[str, str],
    layout: str | None,
    limit: int | None,
    dedupe: bool,
    skip_invalid: bool,
    domain: str,
    lines: list[int | None] | None = None,
) -> ConversationSet:
    it = iter(rows)
    first = next(it, None)
    if first is None:
        raise ConversationError(f"{label} is empty: it has no rows")
    chosen, detected = _choose_layout(first, fields, layout, label)
    key = fields.get(LAYOUT_KEY[chosen], LAYOUT_KEY[chosen])
    response_key = fields.get("response") or next((k for k in RESPONSE_KEYS if k in first), None)
    id_key = fields.get("id") or next((k for k in ID_KEYS if k in first), None)
    role_key, content_key = TURN_KEYS.get(chosen, ("", ""))  # the prompt layout has no turns
    role_key, content_key = fields.get("role", role_key), fields.get("content", content_key)

    out = ConversationSet(source=label, layout=chosen, records=[], n_rows=0, n_skipped=0, n_duplicates=0)
    seen_hashes: set[str] = set()
    seen_ids: set[str] = set()
    rows_iter = _chain(first, it)
    for i, row in enumerate(rows_iter):
        if limit is not None and len(out.records) >= limit:
            break
        out.n_rows += 1
        # a file's line (as JSON errors name it), else the row counted from 1
        line = lines[i] if lines is not None and i < len(lines) else None
        where = f"{label}:{line}" if line is not None else f"{label}, row {i + 1}"
        try:
            turns = _row_turns(row, chosen, detected, fields, key, role_key, content_key, response_key, where)
            prompt_turns, reference = _split(turns, where)
        except _RowError:
            if not skip_invalid:
                raise
            out.n_skipped += 1
            continue
        rid = str(row[id_key]) if id_key and row.get(id_key) is not None else str(i)
        if rid in seen_ids:
            rid = f"{rid}#{i}"  # ids key trajectories, so a repeated id gets the row number
        seen_ids.add(rid)
        record = {
            "id": f"{name}/{rid}",
            "messages": prompt_turns,
            "prompt": render_prompt(prompt_turns),
            "reference": reference,
            "domain": domain,
        }
        if dedupe:
            h = prompt_hash(record)
            if h in seen_hashes:
                out.n_duplicates += 1
                continue
            seen_hashes.add(h)
        out.records.append(record)
    return out


def _chain(first: Mapping[str, Any], rest: Iterable[Mapping[str, Any]]) -> Iterable[Mapping[str, Any]]:
    yield first
    yield from rest


def _row_turns(
    row: Mapping[str, Any],
    layout: str,
    detected_layout: bool,
    fields: Mapping[str, str],
    key: str,
    role_key: str,
    content_key: str,
    response_key: str | None,
    where: str,
) -> list[dict[str, str]]:
    if not isinstance(row, Mapping):
        raise _RowError(f"{where} is a {type(row).__name__}, not an object with named fields")
    detected = _detect(row, fields)
    # A detected layout must be every row's; a named one only needs its field (other columns may look like layouts).
    if key not in row or (detected_layout and detected != layout):
        raise _RowError(
            f"{where} has layout {detected or 'none'} (fields {sorted(row)}), but the file's layout is {layout!r} "
            f"(read from field {key!r} of row 0); all rows must share one layout"
        )
    if layout == "prompt":
        prompt = row[key]
        if not isinstance(prompt, str) or not prompt.strip():
            raise _RowError(f"{where}: field {key!r} must be non-empty text, got {_show(prompt)}")
        turns = [{"role": "user", "content": prompt}]
        response = _content(row.get(response_key), f"{where}, field {response_key!r}") if response_key else ""
        return turns + ([{"role": "assistant", "content": response}] if response else [])
    value = row[key]
    if not isinstance(value, (list, tuple)):
        raise _RowError(f"{where}: field {key!r} must be a list of turns, got {_show(value)}")
    if not value:
        raise _RowError(f"{where}: the conversation in field {key!r} has no turns")
    turns = []
    for j, turn in enumerate(value):
        at = f"{where}, turn {j}"
        if not isinstance(turn, Mapping):
            raise _RowError(f"{at} is {_show(turn)}, not an object with {role_key!r} and {content_key!r}")
        missing = [k for k in (role_key, content_key) if k not in turn]
        if missing:
            raise _RowError(
                f"{at} has no field {' or '.join(map(repr, missing))}; its fields are {sorted(turn)} "
                "(map yours with fields={'role': ..., 'content': ...})"
            )
        role = ROLES.get(str(turn[role_key]).strip().lower())
        if role is None:
            raise _RowError(f"{at}: unknown role {turn[role_key]!r}; known roles: {', '.join(ROLES)}")
        turns.append({"role": role, "content": _content(turn[content_key], at)})
    return turns


def _split(turns: list[dict[str, str]], where: str) -> tuple[list[dict[str, str]], str]:
    """(prompt turns, reference): the final turn is the reference when an assistant spoke it, else there is none."""
    if turns[-1]["role"] == "assistant":
        prompt, reference = turns[:-1], turns[-1]["content"]
    else:
        prompt, reference = turns, ""
    if not any(t["role"] == "user" for t in prompt):
        spoken = ", ".join(dict.fromkeys(t["role"] for t in turns))
        before = "before the final assistant turn" if turns[-1]["role"] == "assistant" else "in it"
        raise _RowError(f"{where}: no user turn {before} (its turns are {spoken} only), so there is no prompt")
    return prompt, reference


def _content(value: Any, where: str) -> str:
    """Turn content as text: a string, None (empty), or a list of parts whose ``text`` entries are joined."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(p, Mapping) for p in value):
        texts = [p["text"] for p in value if isinstance(p.get("text"), str)]
        if len(texts) == len(value):
            return "".join(texts)
    raise _RowError(f"{where}: content must be text (or a list of text parts), got {_show(value)}")


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
