"""Stage ``decode``: continue one prompt with any decoder and print the text, then one JSON line of metrics.

    python launch.py stage=decode model=tiny decoder=diffusion_draft prompt="Sam has 3 apples."
    python launch.py stage=decode model=tiny decoder=ar_draft prompt_ids=[12,7,99] decoder.temperature=1.0
    python launch.py stage=decode model=tiny decoder=vanilla model.verifier.path=/ckpt/hf-folder prompt="def f("
    python launch.py stage=decode model=tiny decoder=threshold prompt="Sam has 3 apples."   # block-diffusion target

The tiny world is built first if it is not cached (``stage=bootstrap``). The last line printed is a JSON object
with ``token_ids`` (the generated ids), ``text`` and the metrics (``tokens_per_verifier_call``, ``nfe``,
``tokens_per_s``, ``alpha``, ...; docs/decoding.md defines them), so scripts can read it with ``tail -n 1``.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

import torch
from omegaconf import DictConfig

from streakline.config import ConfigError
from streakline.decoding.acceptance import get_rule
from streakline.decoding.block_diffusion import BlockDecodeConfig, decode_blocks
from streakline.decoding.cross_tokenizer import CrossTokenizerDrafter, VocabBridge
from streakline.decoding.registry import BLOCK, BLOCK_DRAFTED, block_drafter, speculative_setup
from streakline.decoding.speculative import generate
from streakline.decoding.vanilla import left_pad
from streakline.models import build
from streakline.models.tokenizer import load_tokenizer, tokenizer_hash

from .bootstrap import attach_world, has_tokenizer


def run(cfg: DictConfig) -> dict[str, Any]:
    if (cfg.prompt is None) == (cfg.prompt_ids is None):
        raise ConfigError(
            'stage=decode needs exactly one of prompt="some text" or prompt_ids=[1,2,3] (raw verifier token ids)'
        )
    attach_world(cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = cfg.decoder.name
    block = name in BLOCK + BLOCK_DRAFTED
    main_role = "target" if block else "verifier"
    tokenizer = role_tokenizer(cfg, main_role)
    text_prompt = None if cfg.prompt is None else unescape(cfg.prompt)
    prompt = list(cfg.prompt_ids) if cfg.prompt_ids is not None else encode(tokenizer, text_prompt)
    main = build(cfg.model[main_role], main_role, device=device).eval()
    if max(prompt) >= main.config.vocab_size:
        raise ConfigError(
            f"prompt_ids has id {max(prompt)}, but the {main_role}'s vocabulary has {main.config.vocab_size}"
        )
    eos = tokenizer.eos_token_id if tokenizer is not None else main.config.eos_token_id

    if block:
        drafter = None
        if name in BLOCK_DRAFTED:
            artifact = importlib.import_module(f"{__package__}.{name}").locate(cfg)
            drafter = block_drafter(name, artifact, cfg.decoder, device=device, target=cfg.model.target.name)
        ids, mask = left_pad([prompt])
        res = decode_blocks(
            main,
            ids.to(device),
            mask.to(device),
            BlockDecodeConfig(
                rule=name if name in BLOCK else cfg.decoder.rule,
                threshold=cfg.decoder.threshold,
                max_new_tokens=cfg.decoder.max_new_tokens,
                eos_token_id=eos,
                temperature=cfg.decoder.temperature,
                seed=cfg.decoder.seed,
            ),
            drafter=drafter,
        )
        tokens = res.tokens[0]
        metrics = {
            "nfe": res.nfe,
            "tokens_per_verifier_call": len(tokens) / max(1, res.nfe),
            "commits_per_forward": res.commits_per_forward,
            "drafts_per_forward": res.drafts_per_forward,
        }
    else:
        drafter_model = None
        if name != "vanilla":
            drafter_model = build(cfg.model.drafter, "drafter", device=device).eval()
        try:
            spec, drafter = speculative_setup(
                cfg.decoder, drafter_model, gamma_default=cfg.model.drafter.gamma, eos_token_id=eos, seed=cfg.seed
            )
            get_rule(spec.acceptance, spec.temperature, spec.K if drafter is not None else 1)
        except (ValueError, NotImplementedError) as e:
            raise ConfigError(str(e)) from e
        if drafter is not None:
            drafter = bridge_tokenizers(cfg, drafter, tokenizer)
        res = generate(main, [prompt], spec, drafter=drafter, tokenizer=tokenizer)
        tokens = res.tokens[0]
        metrics = res.metrics.to_dict()

    text = tokenizer.decode(tokens) if tokenizer is not None else ""
    if text_prompt is not None:
        print(text_prompt + text)
    else:
        print(text)
    line = {"decoder": name, "token_ids": tokens, "text": text, **metrics}
    print(json.dumps(line))
    return line


def role_tokenizer(cfg: DictConfig, role: str):
    """The role's tokenizer (its ``tokenizer`` folder, else its checkpoint folder), or None if it has none."""
    node = cfg.model[role]
    folder = node.tokenizer or node.path
    if folder is not None and not has_tokenizer(folder):
        raise ConfigError(
            f"model.{role} reads its tokenizer from {folder}, which holds no tokenizer.json / tokenizer_config.json; "
            f"set model.{role}.tokenizer=<folder with the tokenizer>"
        )
    if folder is None:
        if cfg.prompt is not None:
            raise ConfigError(
                f"model.{role} has no tokenizer folder to encode prompt= with; set model.{role}.tokenizer=<folder> "
                "or pass raw ids with prompt_ids=[...]"
            )
        return None
    return load_tokenizer(folder)


def unescape(text: str) -> str:
    """``\\n`` and ``\\t`` typed on a command line become a newline and a tab (Hydra keeps them literal)."""
    return text.replace("\\n", "\n").replace("\\t", "\t")


def encode(tokenizer, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ConfigError(f"prompt {text!r} encodes to no tokens")
    return ids


def block_target(cfg: DictConfig, stage: str, device: str):
    """The target model for a stage that decodes it block by block (spot, spiffy); refuses one without block-causal
    attention."""
    target = build(cfg.model.target, "target", device=device).eval()
    if target.config.attention != "block_causal":
        raise ConfigError(
            f"stage={stage} needs a block-diffusion target (block_causal attention); model.target attends "
            f"{target.config.attention!r}"
        )
    return target


def target_tokenizer(cfg: DictConfig, stage: str):
    """The target's tokenizer; a stage that encodes prompts for the target cannot run without one."""
    tok = role_tokenizer(cfg, "target")
    if tok is None:
        raise ConfigError(f"stage={stage} needs the target's tokenizer; set model.target.tokenizer=<folder>")
    return tok


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
        raise ConfigError(f"{who}.prompt_sources gave {len(records)} prompts; at least 2 are needed")
    return records


def encode_records(tokenizer, records: list[dict[str, str]]) -> list[list[int]]:
    """Token ids of each record's raw prompt text (``prompt_text``, no chat template): how stage=decode and
    stage=evaluate encode what they decode, so traces see prompts the way the decodes they serve do."""
    from streakline.data.benchmarks import prompt_text

    return [encode(tokenizer, prompt_text(r)) for r in records]


def bridge_tokenizers(cfg: DictConfig, drafter, verifier_tokenizer):
    """The drafter as is when it shares the verifier's tokenizer, else wrapped to draft through token strings."""
    drafter_tokenizer = role_tokenizer(cfg, "drafter") if verifier_tokenizer is not None else None
    if drafter_tokenizer is None or tokenizer_hash(drafter_tokenizer) == tokenizer_hash(verifier_tokenizer):
        return drafter
    bridge = VocabBridge(drafter_tokenizer, verifier_tokenizer, drafter_vocab=drafter.model.config.vocab_size)
    print(f"decode: drafter and verifier tokenizers differ; {bridge.coverage:.0%} of drafter tokens map by string")
    return CrossTokenizerDrafter(drafter, bridge, verifier_tokenizer, drafter_tokenizer)
