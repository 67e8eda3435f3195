"""Building a model on the ``meta`` device (shapes only, no memory) without the cost of its random fill.

    from streakline.models.meta import on_meta
    with on_meta():
        model = Transformer(cfg)        # then load_state_dict(..., assign=True), or read its shapes

Why not plain ``torch.device("meta")``: ``nn.Embedding``'s initialisation calls ``normal_``, and on the meta device
that goes through torch's Python reference implementation, whose first call imports ``torch._dynamo`` (about 2 s of
CPU in every process that loads a checkpoint, 5 s on a slow laptop). A meta tensor holds no values, so the fill is
skipped; every other call runs as is. Used by the checkpoint loader, layer surgery, the doctor and the planner.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode


class _NoFillOnMeta(TorchFunctionMode):
    """Skips ``normal_`` on meta tensors, the one random fill a model's construction makes that costs anything."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.init.normal_ or func is torch.Tensor.normal_:
            tensor = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextmanager
def on_meta() -> Iterator[None]:
    """Modules built inside have their parameters on the meta device, unfilled."""
    # the device mode innermost, so that the fill mode sees nn.init's call before the device mode runs it
    with _NoFillOnMeta(), torch.device("meta"):
        yield
