"""Prompts as the stages encode them: every prompt set is read by ``data.sources.load_source`` and rendered by
``data.sources.prompt_for`` with ``data.chat_template``, as ``stage=trajectories`` renders the prompts it samples, so
``stage=evaluate``, ``stage=sweep`` and the trace collectors see prompts the way the training data did. (The tiny
world sets ``data.chat_template=false``: raw text. ``stage=decode`` renders its one prompt as a user turn when the
template applies, else as typed.)

    records = source_records(["tiny-math-train", "tiny-code-train"], 64, "spot")
    ids = encode_records(tokenizer, records, chat_template=False)
"""

from __future__ import annotations

from streakline.config import ConfigError


def unescape(text: str) -> str:
    """``\\n`` and ``\\t`` typed on a command line become a newline and a tab (Hydra keeps them literal)."""
    return text.replace("\\n", "\n").replace("\\t", "\t")


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens; ConfigError when it encodes to nothing."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ConfigError(f"prompt {text!r} encodes to no tokens")
    return ids


def source_records(sources, n: int, who: str) -> list[dict[str, str]]:
    """``n`` records split evenly over ``sources`` (any ``data.sources`` source; the first sources take the
    remainder), for the stages that decode prompt sets (spot, spiffy)."""
    from streakline.data.sources import load_source, source_label

    sources = list(sources)
    records = []
    for i, source in enumerate(sources):
        limit = n // len(sources) + (1 if i < n % len(sources) else 0)
        if limit == 0:
            continue
        got = load_source(source, limit=limit)
        if len(got) < limit:
            print(f"{who}: {source_label(source)} has only {len(got)} prompts of the {limit} asked for")
        records.extend(got)
    if len(records) < 2:
        raise ConfigError(f"stage.prompt_sources of stage={who} gave {len(records)} prompts; at least 2 are needed")
    return records


def encode_records(tokenizer, records: list[dict[str, str]], chat_template: bool) -> list[list[int]]:
    """Token ids of each record as ``data.sources.prompt_for`` renders it."""
    from streakline.data.sources import prompt_for

    return [encode(tokenizer, prompt_for(r, tokenizer, chat_template)) for r in records]


def template_applied(tokenizer, chat_template: bool) -> bool:
    """Whether ``prompt_for`` renders through the chat template for this tokenizer (a run key records it)."""
    return bool(chat_template and getattr(tokenizer, "chat_template", None))


def benchmark_prompts(tokenizer, benchmarks, limit: int, chat_template: bool) -> dict[str, list[list[int]]]:
    """``{benchmark: token ids of its first ``limit`` prompts}``, as ``stage=evaluate`` and ``stage=sweep`` decode
    them. A benchmark is any source ``data.prompt_sources`` takes (``name``, ``name@/local/file.jsonl``,
    ``conversations@...``; rows are labelled by ``source_label``); one that cannot be loaded is a ConfigError naming
    it and the fix."""
    from streakline.data.benchmarks import BenchmarkError
    from streakline.data.sources import load_source, source_label

    out = {}
    for source in benchmarks:
        try:
            out[source_label(source)] = encode_records(tokenizer, load_source(source, limit=limit), chat_template)
        except BenchmarkError as e:
            raise ConfigError(f"benchmark {source!r}: {e}") from e
    return out


def evaluation_inputs(cfg, methods) -> tuple[dict[str, dict[str, list[list[int]]]], dict[str, int | None]]:
    """``(prompts, eos)`` for ``evaluation.suite.evaluate_methods``: ``cfg.stage.benchmarks`` encoded with the
    verifier's tokenizer for speculative methods and the target's for block methods (only the families present)."""
    from streakline.evaluation.suite import family, with_references

    from .roles import required_tokenizer, role_eos

    prompts, eos = {}, {}
    families = {family(m.decoder) for m in with_references(list(methods))}
    for fam, role in (("speculative", "verifier"), ("block", "target")):
        if fam in families:
            tok = required_tokenizer(cfg, role, "evaluate")
            prompts[fam] = benchmark_prompts(tok, cfg.stage.benchmarks, cfg.stage.prompts, cfg.data.chat_template)
            eos[role] = role_eos(cfg, role, tok, single=role == "target")
    return prompts, eos


def evaluation_sources(cfg) -> dict[str, int]:
    """``{source: prompts read}`` of every evaluation set the drafter trained on these trajectories is measured
    on: ``stage=evaluate``'s benchmarks (its settings as this config gives them) and distill's held-out sources."""
    from streakline.config.validate import stage_settings_node

    evaluate = stage_settings_node("evaluate", cfg.get("settings", {}).get("evaluate", {}))
    out = dict.fromkeys(evaluate.benchmarks, evaluate.prompts)
    for source in cfg.trainer.eval_sources:
        out[source] = max(out.get(source, 0), cfg.trainer.eval_prompts)
    return out
