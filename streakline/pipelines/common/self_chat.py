"""The ``self-chat`` prompt source of stage=trajectories: requests the verifier writes, sampled with the continuous
batching engine and cached by content (what a request is: ``data/self_chat.py``; docs/data.md).

    records = self_chat_records(cfg, 20_000, build=lambda: build_verifier(cfg), evaluation={"humaneval": 164})

Candidate ``i`` is the verifier's completion of the user-turn prefix drawn with its own seed (``candidate_seed``: of
the data seed and i), at temperature 1 and top-p 0.95, at most ``MAX_NEW_TOKENS`` tokens. Candidates are judged
in index order, so the first n requests kept are the same whatever n: a larger ``data.max_prompts`` continues the
list a smaller one started, and a rerun reads it back. The folder ``<run_root>/<experiment>/self-chat/<hash>/`` keeps
``requests.jsonl`` (the requests kept, in order) and ``state.json`` (candidates judged, and why the others were
dropped), both rewritten atomically after every round, so a killed run loses at most a round. The hash is of what the
requests depend on: the verifier (path or hub id, and what it holds), its tokenizer, the precision it samples in,
the seed, the prefix and end texts, the sampling and filter settings (``RECIPE``) and the evaluation prompts kept out.
"""

from __future__ import annotations

import collections
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from streakline.artifacts import config_hash, run_path, write_json_atomic, write_text_atomic
from streakline.config import ConfigError

# Bump when what a config produces changes (prefix, sampling, filter): an old list must not be read as a new one.
RECIPE = 2  # 2: the language rule (data/self_chat.py, KNOWN_SHARE)
MAX_NEW_TOKENS = 64
TEMPERATURE, TOP_P = 1.0, 0.95
ROUND_MIN = 64  # candidates sampled per round at least (the batch the engine fills)
ROUND_MAX = 512  # and at most: the progress bar moves and the state is written after each round
TRIES_PER_REQUEST = 20  # candidates judged per request asked for, at most, before the source says it ran dry


def _key(cfg: DictConfig, prefix: str, end: str, evaluation: dict[str, int]) -> dict[str, Any]:
    from streakline.data import self_chat
    from streakline.models.tokenizer import tokenizer_hash

    from .fingerprints import role_parts
    from .lookup import data_seed, frozen_precision
    from .roles import required_tokenizer

    node = cfg.model.verifier
    return {
        "verifier": node.path or node.hub_id,
        **role_parts(cfg, "verifier"),
        "tokenizer": tokenizer_hash(required_tokenizer(cfg, "verifier", "trajectories")),
        "precision": frozen_precision(cfg),
        "seed": data_seed(cfg),
        "prefix": prefix,
        "end": end,
        "sampling": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": TEMPERATURE, "top_p": TOP_P},
        "filter": [
            self_chat.MIN_WORDS,
            self_chat.MAX_WORDS,
            self_chat.MAX_CHARS,
            self_chat.ASCII_SHARE,
            self_chat.KNOWN_SHARE,
        ],
        "excluded": dict(sorted(evaluation.items())),
        "recipe": RECIPE,
    }


def folder(cfg: DictConfig, prefix: str, end: str, evaluation: dict[str, int]) -> Path:
    """Where the requests for ``cfg`` are kept."""
    return run_path(cfg.run_root, cfg.experiment.name, "self-chat", config_hash(_key(cfg, prefix, end, evaluation)))


def candidate_seed(seed: int, index: int) -> int:
    """The seed candidate ``index`` is drawn with: of the run's data seed and the index only, so a candidate is the
    same in whichever round (and batch) it is sampled."""
    digest = hashlib.sha256(f"{seed}:self-chat:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _excluded_hashes(evaluation: dict[str, int]) -> set[str]:
    from streakline.data.benchmarks import BenchmarkError
    from streakline.data.conversations import prompt_hash
    from streakline.data.sources import load_source

    held = set()
    for source, n in evaluation.items():
        try:
            held |= {prompt_hash(r) for r in load_source(source, limit=n)}
        except BenchmarkError:  # an evaluation set that cannot be read here: the trajectories' guard says so
            continue
    return held


def self_chat_records(
    cfg: DictConfig, n: int | None, *, build: Callable[[], Any], evaluation: dict[str, int]
) -> list[dict[str, str]]:
    """The first ``n`` requests the verifier writes (fewer, with a line saying so, when ``TRIES_PER_REQUEST`` * n
    candidates gave fewer), sampled now past what the cache holds. ``build`` makes the verifier (only when sampling
    is needed); ``evaluation``: ``{source: prompts}`` of the evaluation sets whose prompts are never kept."""
    from tqdm.auto import tqdm

    from streakline.data import self_chat
    from streakline.data.conversations import prompt_hash
    from streakline.decoding.backends import SampleSettings
    from streakline.decoding.batching import ContinuousSampler

    from .lookup import data_seed
    from .roles import required_tokenizer

    if n is None:
        raise ConfigError(f"{self_chat.SELF_CHAT} writes as many prompts as asked: set data.max_prompts")
    tokenizer = required_tokenizer(cfg, "verifier", "trajectories")
    try:
        prefix, end = self_chat.user_turn(tokenizer, cfg.data.chat_template)
    except self_chat.SelfChatError as e:
        raise ConfigError(f"{self_chat.SELF_CHAT}: {e}") from e
    out = folder(cfg, prefix, end, evaluation)
    out.mkdir(parents=True, exist_ok=True)
    requests_path, state_path = out / "requests.jsonl", out / "state.json"
    kept = [json.loads(line) for line in requests_path.read_text().splitlines()] if requests_path.is_file() else []
    state = json.loads(state_path.read_text()) if state_path.is_file() else {"judged": 0, "dropped": {}}
    if len(kept) >= n:
        return kept[:n]
    excluded = _excluded_hashes(evaluation)
    seen = {self_chat.dedup_key(r["prompt"]) for r in kept}
    dropped = collections.Counter(state["dropped"])
    prompt = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    end_ids = tokenizer(end, add_special_tokens=False)["input_ids"]
    eos = end_ids if len(end_ids) == 1 else None  # a one-token end (<|im_end|>) stops as an eos; else as a string
    settings = SampleSettings(
        max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE, top_p=TOP_P, eos_token_id=eos,
        stop_strings=() if eos else (end,),
    )  # fmt: skip
    sampler = ContinuousSampler(build(), settings, tokenizer)
    limit, base = TRIES_PER_REQUEST * n, data_seed(cfg)
    bar = tqdm(total=n, initial=len(kept), desc=self_chat.SELF_CHAT, unit="request", leave=False)
    while len(kept) < n and state["judged"] < limit:
        first = state["judged"]
        count = min(ROUND_MAX, limit - first, max(ROUND_MIN, 2 * (n - len(kept))))
        seeds = [candidate_seed(base, i) for i in range(first, first + count)]
        samples = sampler.sample([prompt] * count, seeds)
        for i, sample in enumerate(samples, start=first):
            text = tokenizer.decode(sample.completion_ids, skip_special_tokens=False)
            if sample.finish_reason in ("eos", "stop") and end not in text:
                text += end  # the turn ended on a token that decodes to nothing
            request, why = self_chat.accept(text, end)
            if request is not None:
                key = self_chat.dedup_key(request)
                rec = self_chat.record(i, request)
                if key in seen:
                    why = "repeat"
                elif prompt_hash(rec) in excluded:
                    why = "evaluation"
                else:
                    seen.add(key)
                    kept.append(rec)
                    bar.update(1)
                    if len(kept) >= n:  # later candidates are judged by a run that asks for more
                        state["judged"] = i + 1
                        break
                    continue
            dropped[why] += 1
        else:
            state["judged"] = first + count
        state["dropped"] = dict(sorted(dropped.items()))
        write_text_atomic(requests_path, "".join(json.dumps(r) + "\n" for r in kept))
        write_json_atomic(state_path, {**state, "kept": len(kept)})
    bar.close()
    if len(kept) < n:
        print(
            f"trajectories: {self_chat.SELF_CHAT} kept {len(kept)} requests of {state['judged']} candidates "
            f"(dropped: {dict(dropped)}), short of the {n} asked for"
        )
    return kept[:n]
