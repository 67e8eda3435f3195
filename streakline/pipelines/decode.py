"""Stage ``decode``: continue one prompt with any decoder and print the text, then one JSON line of metrics.

    python launch.py stage=decode model=tiny decoder=diffusion_draft prompt="Sam has 3 apples."
    python launch.py stage=decode model=tiny decoder=ar_draft prompt_ids=[12,7,99] decoder.temperature=1.0
    python launch.py stage=decode model=tiny decoder=vanilla prompt_file=question.txt   # any text, as written
    python launch.py stage=decode model=tiny decoder=ngram check=true prompt="Sam has 3 apples."   # vs vanilla
    echo "What is 2+2?" | python launch.py stage=decode model=tiny decoder=vanilla prompt=-   # standard input
    python launch.py stage=decode model=tiny decoder=vanilla model.verifier.path=/ckpt/hf-folder prompt="def f("
    python launch.py stage=decode model=tiny decoder=threshold prompt="Sam has 3 apples."   # block-diffusion target
    python launch.py stage=decode model=tiny model.drafter=tiny-dflash decoder=dflash_draft \
        model.drafter.path=runs/default/distill/<hash>/drafter prompt="Sam has 3 apples."   # a DFlash drafter

``prompt_file`` and ``prompt=-`` take text as it is written (quotes, ``=``, commas, newlines: what Hydra's grammar
would need escaped on a command line), UTF-8. ``prompt_file`` keeps the file's text exactly, its final newline too: a
code prompt (HumanEval's end in one) is continued differently without it. ``prompt=-`` drops one trailing newline,
the one ``echo`` adds, as a shell's ``$(cat file)`` does; ``prompt=- < file`` is how to drop an editor's final newline.
A verifier whose tokenizer has a chat template (``model=smol``, instruct checkpoints) gets ``prompt=`` as one user
turn through it, as ``stage=evaluate`` renders prompts; ``data.chat_template=false`` sends the text as typed.
``prompt_ids`` are always sent as given. The tiny world is built first if it is not cached (the runner attaches it).
Decoders that read a stage artifact (``spot``, ``spiffy``) find it with ``common.lookup`` unless ``decoder.artifact``
names one. The last line printed is a JSON object with ``precision`` (what the verifier ran in: ``precision=auto``
picks bf16 where the hardware multiplies it natively, ``precision=fp32`` forces fp32), ``token_ids`` (the generated
ids), ``text`` and the metrics (``tokens_per_verifier_call``, ``nfe``, ``tokens_per_s``, ``alpha``, ...;
docs/decoding.md defines them), so scripts can read it with ``tail -n 1``. ``check=true`` also decodes the prompt
with vanilla and says whether the two agree, and where they part how near a tie the parting is (the fp32 gap against
the bf16 bound, as stage=evaluate weighs it); its verdict is a line before the JSON line and ``check`` in it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from streakline.config import ConfigError
from streakline.data.conversations import render_prompt
from streakline.decoding.acceptance import get_rule
from streakline.decoding.block_diffusion import decode_blocks
from streakline.decoding.registry import (
    BLOCK,
    BLOCK_DRAFTED,
    block_decode_config,
    block_drafter,
    needs_drafter_model,
    speculative_setup,
)
from streakline.decoding.speculative import generate
from streakline.decoding.vanilla import left_pad
from streakline.evaluation.lossless import TIE_FACTOR, tie_check
from streakline.evaluation.runner import tie_gap
from streakline.models import build
from streakline.models.precision import precision_name

from .common.lookup import frozen_dtype, locate_block_artifact, precheck_block_artifact
from .common.prompts import encode, template_applied, unescape
from .common.roles import bridge_tokenizers, device, role_eos, role_tokenizer
from .runner import Stage, StageResult


class Decode(Stage):
    name = "decode"
    settings = ("decoder", "prompt", "prompt_file", "prompt_ids", "check")

    def uses(self, cfg: DictConfig) -> tuple[str, ...]:
        if cfg.decoder.name in BLOCK + BLOCK_DRAFTED:
            return ("target",)
        return ("verifier", "drafter") if needs_drafter_model(cfg.decoder.name) else ("verifier",)

    def prepare(self, cfg: DictConfig) -> None:
        precheck_block_artifact(cfg, cfg.decoder.name)  # before a world is built that the lookup would refuse

    def check(self, cfg: DictConfig) -> None:
        given = [k for k in ("prompt", "prompt_file", "prompt_ids") if cfg.get(k) is not None]
        if len(given) != 1:
            raise ConfigError(
                'stage=decode needs exactly one of prompt="some text" (prompt=- reads standard input), '
                f"prompt_file=<a UTF-8 text file> or prompt_ids=[1,2,3] (raw verifier token ids); got {given or 'none'}"
            )
        if cfg.get("prompt_file") is not None:
            read_prompt_file(cfg.prompt_file)  # before any model is built: a wrong path costs nothing
        if cfg.get("check") and cfg.decoder.name in BLOCK + BLOCK_DRAFTED:
            raise ConfigError(
                f"check=true compares a speculative decoder with decoder=vanilla; decoder={cfg.decoder.name} runs the "
                "block-diffusion target, whose rule (decoder=static or decoder=threshold) is its reference: decode "
                "with it too, or drop check=true"
            )
        if cfg.get("check") and cfg.decoder.temperature > 0:
            raise ConfigError(
                f"check=true compares tokens with vanilla's, which only temperature 0 makes equal; got "
                f"decoder.temperature={cfg.decoder.temperature:g}: use decoder.temperature=0 or drop check=true "
                "(stage=evaluate tests sampled decoders statistically)"
            )

    def run(self, cfg: DictConfig, stage_run: None) -> StageResult:
        name, where = cfg.decoder.name, device()
        block = name in BLOCK + BLOCK_DRAFTED
        main_role = "target" if block else "verifier"
        tokenizer = role_tokenizer(cfg, main_role)
        text_prompt = typed_prompt(cfg)
        if text_prompt is not None and template_applied(tokenizer, cfg.data.chat_template):
            # an instruction-tuned verifier (model=smol) answers a user turn, as evaluate renders its prompts
            text_prompt = render_prompt([{"role": "user", "content": text_prompt}], tokenizer)
        prompt = list(cfg.prompt_ids) if cfg.prompt_ids is not None else encode(tokenizer, text_prompt)
        # the verifier in the precision the hardware runs natively (common.lookup.frozen_dtype); a block target as
        # its preset says, as stage=evaluate runs it
        dtype = None if block else frozen_dtype(cfg, main_role)
        main = build(cfg.model[main_role], main_role, device=where, inference=True, dtype=dtype)
        if max(prompt) >= main.config.vocab_size:
            raise ConfigError(
                f"prompt_ids has id {max(prompt)}, but the {main_role}'s vocabulary has {main.config.vocab_size}"
            )
        eos = role_eos(cfg, main_role, tokenizer, single=block)
        if block:
            tokens, metrics = _decode_block(cfg, main, prompt, eos, where)
        else:
            tokens, metrics, spec = _decode_speculative(cfg, main, prompt, eos, tokenizer, where)
            if cfg.get("check"):
                metrics["check"] = vanilla_check(cfg, main, prompt, tokens, spec, tokenizer, where)
        text = tokenizer.decode(tokens) if tokenizer is not None else ""
        line = {"decoder": name, "precision": precision_name(next(main.parameters()).dtype), "token_ids": tokens,
                "text": text, **metrics}  # fmt: skip
        details = {"line": line, "prompt": text_prompt or ""}
        if "check" in metrics:
            details["check"] = check_line(metrics["check"], line["precision"], tokenizer)
        return StageResult(self.name, metrics=metrics, details=details)

    def report(self, result: StageResult) -> None:
        line = result.details["line"]
        print(result.details["prompt"] + line["text"])
        if "check" in result.details:
            print(result.details["check"])
        print(json.dumps(line))  # last: scripts read it with tail -n 1


STAGE = Decode()


def typed_prompt(cfg: DictConfig) -> str | None:
    """The text to continue: ``prompt`` (escapes resolved; ``-`` reads standard input), ``prompt_file``'s text, or
    None for ``prompt_ids``."""
    if cfg.get("prompt_file") is not None:
        return read_prompt_file(cfg.prompt_file)
    if cfg.prompt is None:
        return None
    if cfg.prompt != "-":
        return unescape(cfg.prompt)
    if sys.stdin is None or sys.stdin.closed:
        raise ConfigError("prompt=- reads the prompt from standard input, which is closed; pipe the text in")
    if sys.stdin.isatty():
        print("decode: reading the prompt from standard input (end it with Ctrl-D)", file=sys.stderr)
    text = sys.stdin.read().removesuffix("\n").removesuffix("\r")  # echo's newline, as $(cat file) drops it
    return _one_prompt(text, "standard input", "pipe the text in: echo 'text' | python launch.py ...")


def read_prompt_file(path: str) -> str:
    """``prompt_file``'s text exactly as written (UTF-8; a BOM dropped, a final newline kept), ConfigError naming
    the file and the fix when it cannot be read, is not UTF-8 or holds only white space."""
    file = Path(path).expanduser()
    try:
        raw = file.read_bytes()
    except OSError as e:
        raise ConfigError(f"prompt_file={path}: cannot read it ({e.strerror or e}); give a readable text file") from e
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"prompt_file={path} is not UTF-8 text (byte {e.start}); save it as UTF-8 (e.g. iconv -t UTF-8)"
        ) from e
    return _one_prompt(text, f"prompt_file={path}", "write the prompt into it")


def _one_prompt(text: str, where: str, fix: str) -> str:
    """``text``, refused when blank."""
    if not text.strip():
        raise ConfigError(f"{where} holds no prompt text; {fix}")
    return text


def _decode_block(cfg: DictConfig, target, prompt: list[int], eos, where: str) -> tuple[list[int], dict[str, Any]]:
    """static / threshold on the block-diffusion target, or spot / spiffy with their stage artifact."""
    name = cfg.decoder.name
    drafter = None
    if name in BLOCK_DRAFTED:
        artifact = locate_block_artifact(cfg, name)
        drafter = block_drafter(name, artifact, cfg.decoder, device=where, target=cfg.model.target.name)
    ids, mask = left_pad([prompt])
    rule = name if name in BLOCK else cfg.decoder.rule
    res = decode_blocks(
        target, ids.to(where), mask.to(where), block_decode_config(cfg.decoder, eos_token_id=eos, rule=rule),
        drafter=drafter,
    )  # fmt: skip
    tokens = res.tokens[0]
    return tokens, {
        "nfe": res.nfe,
        "tokens_per_verifier_call": len(tokens) / max(1, res.nfe),
        "commits_per_forward": res.commits_per_forward,
        "drafts_per_forward": res.drafts_per_forward,
    }


def _decode_speculative(cfg: DictConfig, verifier, prompt, eos, tokenizer, where) -> tuple[list[int], dict]:
    """vanilla, or ar_draft / diffusion_draft / dflash_draft with the preset's drafter (bridged when its tokenizer
    differs; a DFlash drafter is shared with the verifier instead)."""
    name = cfg.decoder.name
    drafter_model = None
    if needs_drafter_model(name):
        dtype = frozen_dtype(cfg, "drafter")
        drafter_model = build(cfg.model.drafter, "drafter", device=where, inference=True, dtype=dtype)
    try:
        spec, drafter = speculative_setup(
            cfg.decoder, drafter_model, gamma_default=cfg.model.drafter.gamma, eos_token_id=eos, seed=cfg.seed,
            verifier=verifier,
        )  # fmt: skip
        get_rule(spec.acceptance, spec.temperature, spec.K if drafter is not None else 1)
    except (ValueError, NotImplementedError) as e:
        raise ConfigError(str(e)) from e
    if drafter is not None:
        drafter = bridge_tokenizers(cfg, drafter, tokenizer)
    res = generate(verifier, [prompt], spec, drafter=drafter, tokenizer=tokenizer)
    return res.tokens[0], res.metrics.to_dict(), spec


def vanilla_check(cfg: DictConfig, verifier, prompt: list[int], tokens: list[int], spec, tokenizer, where) -> dict:
    """``check=true``: decode ``prompt`` with vanilla (the same verifier and ``spec``, no drafter) and compare it with
    ``tokens`` (:func:`compare_with_vanilla`). The fp32 verifier that weighs a parting is built only when there is one
    and the verifier runs in another precision."""
    if cfg.decoder.name == "vanilla":
        vanilla = tokens  # the reference itself
    else:
        vanilla = generate(verifier, [prompt], spec, drafter=None, tokenizer=tokenizer).tokens[0]
    built = []

    def fp32_verifier():
        if not built:
            exact = next(verifier.parameters()).dtype == torch.float32
            built.append(
                verifier
                if exact
                else build(cfg.model.verifier, "verifier", device=where, inference=True, dtype=torch.float32)
            )
        return built[0]

    return compare_with_vanilla(verifier, fp32_verifier, prompt, tokens, vanilla)


def compare_with_vanilla(verifier, fp32_verifier, prompt: list[int], tokens: list[int], vanilla: list[int]) -> dict:
    """Whether ``tokens`` (a decode of ``prompt`` by ``verifier``) agree with ``vanilla`` (its vanilla decode), and if
    not, their first parting weighed as stage=evaluate weighs a row's (``lossless.tie_check``): ``token`` (its
    index), ``tokens`` (the decode's id and vanilla's), ``gap`` (fp32 logit of the first minus the second), ``eps``
    (the largest |logit error| of the verifier's precision there) and ``bound`` (``TIE_FACTOR`` x eps); a
    ``near_tie`` is a gap within the bound. ``fp32_verifier()`` returns the same verifier in fp32. ``lossless``:
    they agree, or (reduced precision only) part at a near-tie; in fp32 only agreement is (eps is 0 there)."""
    precision = precision_name(next(verifier.parameters()).dtype)

    def gap(_prompt: int, prefix: list[int], token: int, other: int) -> dict[str, float]:
        return tie_gap(verifier, fp32_verifier(), prompt, prefix, token, other)

    with torch.no_grad():
        checked = tie_check([tokens], [vanilla], gap)
    parting = None
    if checked["divergences"]:
        parting = {k: v for k, v in checked["divergences"][0].items() if k != "prompt"}
    exact = precision == "fp32"
    return {
        "agrees": parting is None,
        "lossless": parting is None if exact else checked["lossless"],
        "check": "identical tokens (fp32: no near-tie allowance)" if exact else checked["check"],
        "vanilla_token_ids": vanilla,
        "first_parting": parting,
    }


def check_line(check: dict, precision: str, tokenizer) -> str:
    """One line for people: ``check=true``'s verdict (the JSON line holds the numbers)."""
    parting = check["first_parting"]
    if parting is None:
        n = len(check["vanilla_token_ids"])
        return f"check: agrees with decoder=vanilla token for token ({n} tokens, {precision})"
    where = f"check: parts from decoder=vanilla at new token {parting['token']}"
    if "gap" not in parting:
        return f"{where}: {parting['why']} (NOT lossless)"
    ours, theirs = parting["tokens"]
    if tokenizer is not None:
        ours, theirs = repr(tokenizer.decode([ours])), repr(tokenizer.decode([theirs]))
    weighed = (
        f"{where} ({ours} against vanilla's {theirs}): the fp32 logit gap {parting['gap']:+.3g} against the bound "
        f"{parting['bound']:.3g} ({TIE_FACTOR:g} x the {precision} logit error {parting['eps']:.3g})"
    )
    if precision == "fp32":
        return f"{weighed}: fp32 has no near-tie allowance, so this is NOT lossless; please report it"
    if parting["near_tie"]:
        return f"{weighed}: a near-tie, which {precision} allows (precision=fp32 decodes as vanilla token for token)"
    return f"{weighed}: beyond the bound, so NOT a near-tie and NOT lossless; please report it"
