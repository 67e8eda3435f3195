"""Models made from other models' weights: the first layers of a transformer, as a layer-skip drafter starts.

    drafter = first_layers(verifier, 4)   # layers 0-3, the embedding, the final norm and the head, copied

A drafter cut from its verifier shares the verifier's tokenizer and embedding by construction, and its first slot
is already the prediction of the verifier's early layers (the layer-skip / self-speculative idea), so it starts
far closer to the verifier than random weights; training (``stage=distill``) closes the rest (docs/smol.md).
"""

from __future__ import annotations

import dataclasses

import torch

from .meta import on_meta
from .transformer import Transformer


@torch.no_grad()
def first_layers(model: Transformer, n: int) -> Transformer:
    """A new ``Transformer`` with copies of ``model``'s first ``n`` layers, its embedding, final norm and head
    (``n`` in ``1..num_layers``); the config is ``model``'s with ``num_layers=n``. The source is left as it is."""
    total = model.config.num_layers
    if not 1 <= n <= total:
        raise ValueError(f"cannot keep the first {n} of {total} layers; choose 1..{total}")
    cfg = dataclasses.replace(model.config, num_layers=n)
    keep = {
        k: v.detach().clone()
        for k, v in model.state_dict().items()
        if not k.startswith("layers.") or int(k.split(".")[1]) < n
    }
    with on_meta():
        out = Transformer(cfg)
    out.load_state_dict(keep, assign=True, strict=True)
    return out.to(model.embed.weight.device)
