"""The decoders by name, and how a ``decoder`` config turns into a ready decode call: the one builder of each
runtime config (``speculative_setup`` for ``SpecConfig`` + drafter, ``block_decode_config`` for
``BlockDecodeConfig``), used by every stage and evaluation.

    spec, drafter = speculative_setup(cfg.decoder, drafter_model, gamma_default=cfg.model.drafter.gamma, seed=0,
                                      verifier=verifier)   # a DFlash drafter shares the verifier's embedding and head
    result = generate(verifier, prompts, spec, drafter=drafter)
    decode = block_decode_config(cfg.stage, eos_token_id=tok.eos_token_id)    # rule, temperature, ... of stage=spot

| name | what runs | needs |
|---|---|---|
| ``vanilla`` | the verifier alone, one forward per token | verifier |
| ``ar_draft`` | a causal drafter proposes gamma tokens autoregressively | verifier + drafter |
| ``diffusion_draft`` | one drafter forward, K chains, tree verification, self-selection | verifier + drafter |
| ``dflash_draft`` | a DFlash block drafted from the verifier's layer states, K chains | verifier + DFlash drafter |
| ``ngram`` | prompt lookup: what followed the context's last n tokens earlier, no model (``ngram.py``) | verifier |
| ``dflash_lookup`` | lookup, dflash_draft or neither, by cost per cycle (``mixed.py``) | verifier + DFlash drafter |
| ``static`` / ``threshold`` | block-diffusion draft-free decoding (``block_diffusion.py``) | target |
| ``spot`` / ``spiffy`` | a drafted tree / graph of block states, verified in one batched forward | target + artifact |

``DECODER_SPECS`` is the one table of decoders; everything else here is derived from it:

- ``SPECULATIVE``: the ``speculative`` family (``speculative.generate``), name -> drafter class (``None``: vanilla),
  the class looked up by the spec's ``drafter`` kind in ``drafters.DRAFTERS`` (a model's) or ``MODEL_FREE_DRAFTERS``;
- ``BLOCK``: the draft-free block decoders, which are also ``block_rules.COMMIT_RULES``;
  ``BLOCK_DRAFTED``: the block decoders that take a drafter (``block_drafter``);
- ``REFERENCE``: family -> the decoder its speedups are measured against (the family's first reference decoder);
  ``REFERENCE_DECODERS``: every draft-free decoder, each its own reference;
- ``decoder_family(name)``: ``"speculative"`` or ``"block"``.

``config/schema.py:DECODERS`` repeats the names so that the schema imports without torch; ``tests/test_registries.py``
keeps the two equal (and this table's rows equal to ``DECODER_SPECS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from streakline.models.dflash import DFlashModel

from .block_diffusion import BlockDecodeConfig
from .drafters import DRAFTERS, ARDrafter, DFlashDrafter, DiffusionDrafter
from .mixed import MixedDrafter
from .ngram import NgramDrafter
from .speculative import SpecConfig

DECODER_FAMILIES = ("speculative", "block")
# drafters that run no model: built from the decoder settings alone (no drafter role, checkpoint or training)
MODEL_FREE_DRAFTERS = {"ngram": NgramDrafter}
# drafters made of others: prompt lookup beside a DFlash drafter model, chosen per cycle
COMPOSITE_DRAFTERS = {"dflash_lookup": MixedDrafter}
_DRAFTER_CLASSES = {**DRAFTERS, **MODEL_FREE_DRAFTERS, **COMPOSITE_DRAFTERS}
# the drafters that draft with a DFlash model: shared with the verifier, gamma = its block size - 1
_DFLASH = (DFlashDrafter, MixedDrafter)


@dataclass(frozen=True)
class DecoderSpec:
    """One decoder: which loop runs it and what it needs."""

    name: str
    family: str  # DECODER_FAMILIES: "speculative" (speculative.generate) or "block" (block_diffusion.decode_blocks)
    drafted: bool  # a drafter proposes what the model verifies (a drafter model, or a spot / spiffy artifact)
    reference: bool  # draft-free: the baseline its family's drafted decoders are measured against
    needs: str  # what it runs on, as in the module docstring's table
    drafter: str | None = None  # speculative drafted decoders: the drafter kind (DRAFTERS or MODEL_FREE_DRAFTERS)

    def __post_init__(self) -> None:
        if self.family not in DECODER_FAMILIES:
            raise ValueError(f"decoder {self.name}: family {self.family!r} is not one of {DECODER_FAMILIES}")
        if self.reference and self.drafted:
            raise ValueError(f"decoder {self.name}: a reference decoder is draft-free")
        # exactly the speculative drafted decoders name a drafter kind
        if (self.drafter is not None) != (self.drafted and self.family == "speculative"):
            raise ValueError(f"decoder {self.name}: drafter={self.drafter!r} does not fit family={self.family}")
        if self.drafter is not None and self.drafter not in _DRAFTER_CLASSES:
            raise ValueError(
                f"decoder {self.name}: unknown drafter kind {self.drafter!r}; valid: {list(_DRAFTER_CLASSES)}"
            )


DECODER_SPECS: dict[str, DecoderSpec] = {
    s.name: s
    for s in (
        DecoderSpec("vanilla", "speculative", drafted=False, reference=True, needs="verifier"),
        DecoderSpec("ar_draft", "speculative", drafted=True, reference=False, needs="verifier + drafter", drafter="ar"),
        DecoderSpec("diffusion_draft", "speculative", drafted=True, reference=False, needs="verifier + drafter", drafter="diffusion"),  # noqa: E501
        DecoderSpec("dflash_draft", "speculative", drafted=True, reference=False, needs="verifier + DFlash drafter", drafter="dflash"),  # noqa: E501
        DecoderSpec("ngram", "speculative", drafted=True, reference=False, needs="verifier", drafter="ngram"),
        DecoderSpec("dflash_lookup", "speculative", drafted=True, reference=False, needs="verifier + DFlash drafter", drafter="dflash_lookup"),  # noqa: E501
        DecoderSpec("static", "block", drafted=False, reference=True, needs="target"),
        DecoderSpec("threshold", "block", drafted=False, reference=True, needs="target"),
        DecoderSpec("spot", "block", drafted=True, reference=False, needs="target + artifact"),
        DecoderSpec("spiffy", "block", drafted=True, reference=False, needs="target + artifact"),
    )
}  # fmt: skip

SPECULATIVE: dict[str, type | None] = {
    s.name: _DRAFTER_CLASSES[s.drafter] if s.drafter is not None else None
    for s in DECODER_SPECS.values()
    if s.family == "speculative"
}
BLOCK = tuple(s.name for s in DECODER_SPECS.values() if s.family == "block" and not s.drafted)
BLOCK_DRAFTED = tuple(s.name for s in DECODER_SPECS.values() if s.family == "block" and s.drafted)
REFERENCE_DECODERS = tuple(s.name for s in DECODER_SPECS.values() if s.reference)
# family -> its reference decoder: the first reference decoder of the family (vanilla, static)
REFERENCE: dict[str, str] = {
    family: next(s.name for s in DECODER_SPECS.values() if s.family == family and s.reference)
    for family in DECODER_FAMILIES
}


def needs_drafter_model(name: str) -> bool:
    """Whether decoder ``name`` drafts with a drafter model (the drafter role): not vanilla, ngram, a block one."""
    kind = SPECULATIVE.get(name)
    return kind is not None and kind not in MODEL_FREE_DRAFTERS.values()


def decoder_family(name: str) -> str:
    """``"speculative"`` or ``"block"``: which decode loop runs decoder ``name``."""
    if name not in DECODER_SPECS:
        raise ValueError(f"unknown decoder {name!r}; valid: {', '.join(DECODER_SPECS)}")
    return DECODER_SPECS[name].family


def block_drafter(name: str, artifact: str | Any, settings: Any, *, device: str = "cpu", target: str | None = None):
    """The SPOT or Spiffy drafter for ``decode_blocks(..., drafter=...)``. ``artifact``: the order-model folder
    (spot) or graph JSON (spiffy) from their stages; ``settings``: a mapping with ``budget`` (SPOT's tree size; a
    Spiffy graph is cut to its first ``budget`` nodes, None = all), ``prune``, ``prefix_mass_floor`` (``DecoderConfig``
    fields); ``target``: the target's name, checked against a graph's header."""
    if name == "spot":
        from streakline.models.order_model import OrderModel

        from .spot import SpotDrafter

        model = OrderModel.load(artifact, device=device).eval()
        return SpotDrafter(model, budget=settings["budget"], prefix_mass_floor=settings["prefix_mass_floor"])
    if name == "spiffy":
        from .spiffy import SpiffyDrafter, SpiffyGraph

        graph = SpiffyGraph.load(artifact)
        budget = settings.get("budget")
        if budget is not None and budget < graph.size:  # a greedy graph's first D nodes are the budget-D graph
            graph = graph.prefix(budget)
        return SpiffyDrafter(graph, prune=settings["prune"], target=target)
    raise ValueError(f"decoder={name} has no block drafter; valid: {', '.join(BLOCK_DRAFTED)}")


def speculative_setup(
    decoder: Any,
    drafter_model=None,
    *,
    gamma_default: int | None = None,
    eos_token_id=None,
    seed: int = 0,
    verifier=None,
) -> tuple[SpecConfig, ARDrafter | DiffusionDrafter | DFlashDrafter | None]:
    """``SpecConfig`` and drafter for a ``decoder`` config (``DecoderConfig`` or its DictConfig).

    A DFlash drafter model (``models.dflash.DFlashModel``) only runs under ``dflash_draft``, and that decoder only
    runs one: it is shared with ``verifier`` here (its embedding and head; ValueError when the shapes do not fit),
    and an unset ``decoder.gamma`` is its block size - 1 (the drafts it was trained to make), not ``gamma_default``.
    """
    name = decoder.name
    if name not in SPECULATIVE:
        raise ValueError(f"decoder={name} is not a speculative decoder; valid: {', '.join(SPECULATIVE)}")
    kind = SPECULATIVE[name]
    if name == "ar_draft" and decoder.K > 1:
        raise ValueError(f"ar_draft proposes one chain per cycle; got decoder.K={decoder.K} (use diffusion_draft)")
    drafter = None
    if kind is NgramDrafter:
        drafter = _lookup_drafter(decoder, verifier)
    elif kind is not None:
        if drafter_model is None:
            raise ValueError(f"decoder={name} needs a drafter model")
        _check_pairing(name, kind, drafter_model)
        if kind in _DFLASH:
            if verifier is None:
                raise ValueError(f"decoder={name} drafts with the verifier's embedding and head: pass verifier=")
            drafter_model.share(verifier)
            gamma_default = drafter_model.dflash.block_size - 1
        if kind is MixedDrafter:
            model = DFlashDrafter(drafter_model, temperature=decoder.drafter_temperature, top_k=decoder.top_k)
            drafter = MixedDrafter(
                model,
                _lookup_drafter(decoder, verifier),
                # absent from configs written before they existed: measured, as by default
                draft_cost=getattr(decoder, "draft_cost", None),
                verify_cost=getattr(decoder, "verify_cost", None),
            )
        else:
            drafter = kind(drafter_model, temperature=decoder.drafter_temperature, top_k=decoder.top_k)
    gamma = decoder.gamma if decoder.gamma is not None else gamma_default
    spec = SpecConfig(
        max_new_tokens=decoder.max_new_tokens,
        gamma=gamma or 0,
        K=decoder.K,
        temperature=decoder.temperature,
        acceptance=decoder.acceptance,
        selection=decoder.selection,
        argmax_chain=decoder.argmax_chain,
        eos_token_id=eos_token_id,
        stop_strings=tuple(decoder.stop_strings),
        seed=seed,
        engine=getattr(decoder, "engine", "auto"),
    )
    return spec, drafter


def _lookup_drafter(decoder: Any, verifier) -> NgramDrafter:
    """The prompt-lookup drafter of ``decoder=ngram`` and of ``dflash_lookup``'s front: one chain a cycle, its
    one-hot q as wide as the verifier's vocabulary."""
    if decoder.K > 1:
        raise ValueError(f"{decoder.name} proposes one chain per cycle; got decoder.K={decoder.K}")
    if verifier is None:
        raise ValueError(
            f"decoder={decoder.name} needs the verifier (its vocabulary sizes the one-hot q): pass verifier="
        )
    vocab = verifier.output_weight.shape[0]
    return NgramDrafter(n_max=decoder.ngram_max, n_min=decoder.ngram_min, vocab_size=vocab)


def _check_pairing(name: str, kind: type, drafter_model) -> None:
    """A DFlash drafter drafts only under ``dflash_draft`` (it reads the verifier's layer states), and that decoder
    only runs a DFlash drafter."""
    is_dflash = isinstance(drafter_model, DFlashModel)
    if kind in _DFLASH and not is_dflash:
        raise ValueError(
            f"decoder={name} runs a DFlash drafter, but the drafter is a plain transformer; use a DFlash preset or "
            "export (model.drafter=micro-dflash, model.drafter.path=<a DFlash folder>) or another decoder "
            "(diffusion_draft, ar_draft)"
        )
    if kind not in _DFLASH and is_dflash:
        raise ValueError(
            f"decoder={name} cannot run a DFlash drafter (it drafts from the verifier's layer states, with the "
            "verifier's embedding and head): use decoder=dflash_draft or dflash_lookup"
        )


BLOCK_SETTINGS = ("rule", "threshold", "max_new_tokens", "temperature", "seed", "engine")


def block_decode_config(settings: Any, *, eos_token_id: int | None, **overrides: Any) -> BlockDecodeConfig:
    """``BlockDecodeConfig`` from a settings node (``decoder``, ``spot``, ``spiffy``: whichever of rule, threshold,
    max_new_tokens, temperature, seed it has), ``overrides`` winning; fields neither gives keep their defaults."""
    unknown = set(overrides) - set(BLOCK_SETTINGS)
    if unknown:
        raise TypeError(f"block_decode_config got unknown fields {sorted(unknown)}; valid: {', '.join(BLOCK_SETTINGS)}")
    values = {k: settings[k] for k in BLOCK_SETTINGS if k in settings}
    values |= {k: v for k, v in overrides.items() if v is not None}
    if "temperature" in values:
        values["temperature"] = float(values["temperature"])
    return BlockDecodeConfig(eos_token_id=eos_token_id, **values)
