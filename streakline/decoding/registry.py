"""The decoders by name, and how a ``decoder`` config turns into a ready decode call.

    spec, drafter = speculative_setup(cfg.decoder, drafter_model, gamma_default=cfg.model.drafter.gamma, seed=0)
    result = generate(verifier, prompts, spec, drafter=drafter)

| name | what runs | needs |
|---|---|---|
| ``vanilla`` | the verifier alone, one forward per token | verifier |
| ``ar_draft`` | a causal drafter proposes gamma tokens autoregressively | verifier + drafter |
| ``diffusion_draft`` | one drafter forward, K chains, tree verification, self-selection | verifier + drafter |
| ``static`` / ``threshold`` | block-diffusion draft-free decoding (``block_diffusion.py``) | target |
| ``spot`` / ``spiffy`` | a drafted tree / graph of block states, verified in one batched forward | target + artifact |
"""

from __future__ import annotations

from typing import Any

from .drafters import ARDrafter, DiffusionDrafter
from .speculative import SpecConfig

SPECULATIVE = {"vanilla": None, "ar_draft": ARDrafter, "diffusion_draft": DiffusionDrafter}
BLOCK = ("static", "threshold")
BLOCK_DRAFTED = ("spot", "spiffy")


def block_drafter(name: str, artifact: str | Any, settings: Any, *, device: str = "cpu", target: str | None = None):
    """The SPOT or Spiffy drafter for ``decode_blocks(..., drafter=...)``. ``artifact``: the order-model folder
    (spot) or graph JSON (spiffy) from their stages; ``settings``: a mapping with ``budget`` (SPOT's tree size; a
    Spiffy graph is cut to its first ``budget`` nodes, None = all), ``prune``, ``gamma_floor`` (``DecoderConfig``
    fields); ``target``: the target's name, checked against a graph's header."""
    if name == "spot":
        from streakline.models.order_model import OrderModel

        from .spot import SpotDrafter

        model = OrderModel.load(artifact, device=device).eval()
        return SpotDrafter(model, budget=settings["budget"], gamma_floor=settings["gamma_floor"])
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
) -> tuple[SpecConfig, ARDrafter | DiffusionDrafter | None]:
    """``SpecConfig`` and drafter for a ``decoder`` config (``DecoderConfig`` or its DictConfig)."""
    name = decoder.name
    if name not in SPECULATIVE:
        raise ValueError(f"decoder={name} is not a speculative decoder; valid: {', '.join(SPECULATIVE)}")
    kind = SPECULATIVE[name]
    if name == "ar_draft" and decoder.K > 1:
        raise ValueError(f"ar_draft proposes one chain per cycle; got decoder.K={decoder.K} (use diffusion_draft)")
    drafter = None
    if kind is not None:
        if drafter_model is None:
            raise ValueError(f"decoder={name} needs a drafter model")
        drafter = kind(drafter_model, temperature=decoder.drafter_temperature, top_k=decoder.top_k or None)
    gamma = decoder.gamma if decoder.gamma is not None else gamma_default
    spec = SpecConfig(
        max_new_tokens=decoder.max_new_tokens,
        gamma=gamma or 0,
        K=decoder.K,
        temperature=decoder.temperature,
        acceptance=decoder.acceptance,
        selection=decoder.selection,
        eos_token_id=eos_token_id,
        stop_strings=tuple(decoder.stop_strings),
        seed=seed,
    )
    return spec, drafter
