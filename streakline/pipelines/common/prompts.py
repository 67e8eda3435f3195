"""Prompts as the stages encode them: raw text (``prompt_text``, no chat template) for everything that is decoded
by ``stage=decode``, ``stage=evaluate`` and the trace collectors, so traces see prompts the way the decodes they
serve do. (``stage=trajectories`` may apply the chat template; see its module.)

    records = source_records(["tiny-math-train", "tiny-code-train"], 64, "spot")
    ids = encode_records(tokenizer, records)
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
    """``n`` benchmark records split evenly over ``sources`` (``name`` or ``name@/file``; the first sources take the
    remainder), for the stages that decode prompt sets (spot, spiffy)."""
    from streakline.data import load_benchmark
    from streakline.data.benchmarks import parse_source

    parsed = [parse_source(s) for s in sources]
    records = []
    for i, (name, path) in enumerate(parsed):
        limit = n // len(parsed) + (1 if i < n % len(parsed) else 0)
        if limit == 0:
            continue
        got = load_benchmark(name, path=path, limit=limit)
        if len(got) < limit:
            print(f"{who}: {name} has only {len(got)} prompts of the {limit} asked for")
        records.extend(got)
    if len(records) < 2:
        raise ConfigError(f"stage.prompt_sources of stage={who} gave {len(records)} prompts; at least 2 are needed")
    return records


def encode_records(tokenizer, records: list[dict[str, str]]) -> list[list[int]]:
    """Token ids of each record's raw prompt text (``prompt_text``)."""
    from streakline.data.benchmarks import prompt_text

    return [encode(tokenizer, prompt_text(r)) for r in records]


def benchmark_prompts(tokenizer, benchmarks, limit: int) -> dict[str, list[list[int]]]:
    """``{benchmark: token ids of its first ``limit`` prompts}`` (raw prompt text), as ``stage=evaluate`` and
    ``stage=sweep`` decode them. A benchmark is a name or ``name@/local/file.jsonl``, as in ``data.prompt_sources``
    (rows are labelled by the name); one that cannot be loaded is a ConfigError naming it and the fix."""
    from streakline.data.benchmarks import BenchmarkError, load_benchmark, parse_source

    out = {}
    for source in benchmarks:
        try:
            name, path = parse_source(source)
            out[name] = encode_records(tokenizer, load_benchmark(name, path=path, limit=limit))
        except BenchmarkError as e:
            raise ConfigError(f"benchmark {source!r}: {e}") from e
    return out


def evaluation_inputs(cfg, methods) -> tuple[dict[str, dict[str, list[list[int]]]], dict[str, int | None]]:
    """``(prompts, eos)`` for ``evaluation.suite.evaluate_methods``: ``cfg.stage.benchmarks`` encoded with the
    verifier's tokenizer for speculative methods and the target's for block methods (only the families present)."""
    from streakline.evaluation.suite import family, with_references

    from .roles import required_tokenizer

    prompts, eos = {}, {}
    families = {family(m.decoder) for m in with_references(list(methods))}
    for fam, role in (("speculative", "verifier"), ("block", "target")):
        if fam in families:
            tok = required_tokenizer(cfg, role, "evaluate")
            prompts[fam] = benchmark_prompts(tok, cfg.stage.benchmarks, cfg.stage.prompts)
            eos[role] = tok.eos_token_id
    return prompts, eos
