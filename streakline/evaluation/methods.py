"""An evaluation method: one row family of the results table, a decoder with its drafter and settings.

    EvalMethod("streak", "diffusion_draft", drafter="runs/.../drafter", steps=300, distill_loss="streak")
    EvalMethod("grid K=4 tau=1", "diffusion_draft", K=4, drafter_temperature=1.0, argmax_chain=False, grid=True)
    EvalMethod("streak@100", "diffusion_draft", drafter="runs/.../checkpoints/step-000100", steps=100,
               distill_loss="streak", temperature=0.0, curve=True)

Fields left None take the ``decoder`` config group's value when the method is decoded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# The settings a method may override; the rest of the decoder config is shared by every method.
DECODER_OVERRIDES = (
    "K",
    "gamma",
    "rule",
    "budget",
    "prune",
    "prefix_mass_floor",
    "drafter_temperature",
    "argmax_chain",
)


@dataclass(frozen=True)
class EvalMethod:
    name: str  # label in results and figures
    decoder: str  # a decoder of decoding.registry
    drafter: str | None = None  # checkpoint folder; None: the model preset's drafter
    # distillation steps of that checkpoint (Fig. 7's x axis); 0: the undistilled base drafter, where every Fig. 7
    # line starts; None: not on Fig. 7
    steps: int | None = None
    K: int | None = None  # drafts per cycle
    gamma: int | None = None  # draft length
    drafter_temperature: float | None = None
    argmax_chain: bool | None = None  # False: K i.i.d. drafts from q (the Fig. 5 grid); True: chain 0 the argmax
    rule: str | None = None  # spot / spiffy: the draft-free rule they reproduce
    budget: int | None = None  # spot / spiffy: draft states per forward
    prune: int | None = None  # spiffy: states kept after pruning
    prefix_mass_floor: float | None = None  # spot: prefix-mass floor (a probability, not a draft length)
    # spot / spiffy: the artifact, or {str(temperature): artifact} when each temperature has its own (Spiffy graphs)
    artifact: str | dict[str, str] | None = None
    grid: bool = False  # a point of the Fig. 5 K x drafter-temperature grid
    distill_loss: str | None = None  # the loss the drafter was distilled with (Fig. 7 draws one line per loss)
    temperature: float | None = None  # evaluate at this verifier temperature only; None: every stage.temperatures
    curve: bool = False  # an intermediate checkpoint: a Fig. 7 point only (left out of Table 2 and Fig. 2)

    @classmethod
    def from_config(cls, node: Any) -> EvalMethod:
        """From an ``evaluate.methods`` entry (``EvalMethodConfig`` or a mapping); unknown keys are errors."""
        items = dict(node.items())
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(items) - names)
        if unknown:
            raise ValueError(f"evaluate.methods entry {items.get('name')!r} has unknown keys {unknown}")
        return cls(**{k: v for k, v in items.items() if v is not None})

    def override(self, key: str, default: Any) -> Any:
        """This method's value of a decoder setting, or ``default`` (the decoder config's) when it sets none."""
        value = getattr(self, key)
        return default if value is None else value

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
