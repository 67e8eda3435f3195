"""Draft windows for diffusion-drafter training: one window per forward, or many packed into one forward.

A draft window at offset ``i`` of a token sequence ``x[0..T)`` is the drafter input ``[x[:i], MASK x W]`` whose
labels are ``x[i:i+W]``. Slots past the end of the sequence have no label: ``valid`` is False there and the label
is the mask id, so a loss must weight by ``valid`` (never treat those slots as certain).

Two forms, with identical logits on a ``prefix_causal`` drafter (docs/algorithms.md sections 1, 4, 6):

    ids, P = window_input(clean, offset, width, mask_id)          # one window: model(ids[None], prefix_len=P)
    labels, valid = window_labels(clean, offset, width, mask_id)

    packed = pack_windows(clean, offsets, width, mask_id, shift=cfg.shift)   # [clean ; window_1 ; ... ; window_K]
    logits = model(packed.input_ids, position_ids=packed.position_ids, attn_mask=packed.attn_mask)
    slot_logits = packed.gather(logits)                            # [B, K, W, V]; weight losses by packed.valid

Packing costs O(T + K*W) tokens per sequence instead of O(K*T). It needs ``prefix_causal`` attention: with
``full`` attention the prefix sees the window, so each window needs its own forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _check_width(width: int) -> None:
    if width < 1:
        raise ValueError(f"window width must be >= 1, got {width}")


def window_input(
    clean: torch.Tensor, offset: int, width: int, mask_id: int, fill: torch.Tensor | None = None
) -> tuple[torch.Tensor, int]:
    """One window per forward: ids ``[offset + W]`` = ``[clean[:offset], fill or MASK x W]`` and ``prefix_len``.

    clean: ``[T]`` token ids; fill: ``[W]`` ids to place in the slots instead of all masks (masked-diffusion
    training reveals some slots). Run as ``model(ids[None], prefix_len=offset)``.
    """
    _check_width(width)
    if clean.dim() != 1:
        raise ValueError(f"clean must be [T], got shape {tuple(clean.shape)}")
    T = clean.shape[0]
    if not 0 <= offset <= T - 1:
        raise ValueError(f"window offset {offset} is outside [0, {T - 1}]: a window needs at least one label")
    if fill is None:
        slots = torch.full((width,), mask_id, dtype=clean.dtype, device=clean.device)
    else:
        if fill.shape != (width,):
            raise ValueError(f"fill must be [W] = [{width}], got shape {tuple(fill.shape)}")
        slots = fill.to(dtype=clean.dtype, device=clean.device)
    return torch.cat([clean[:offset], slots]), offset


def window_labels(clean: torch.Tensor, offset: int, width: int, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels ``[W]`` (``clean[offset:offset+W]``, mask id past the end) and ``valid`` ``[W]`` bool."""
    _check_width(width)
    T = clean.shape[0]
    pos = offset + torch.arange(width, device=clean.device)
    valid = pos < T
    labels = clean[pos.clamp(max=T - 1)].masked_fill(~valid, mask_id)
    return labels, valid


@dataclass
class PackedWindows:
    """K windows per row packed after the clean sequence; S = T + K*W.

    input_ids, position_ids: ``[B, S]``. attn_mask: ``[B, S, S]`` bool, True = query may attend to key.
    slot_index: ``[B, K, W]`` index of each window slot in the packed sequence.
    logit_index: ``[B, K, W]`` index whose logit predicts each slot (the slot itself, or its predecessor when
        shifted). labels, valid: ``[B, K, W]``; invalid slots carry the mask id and must not count.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attn_mask: torch.Tensor
    slot_index: torch.Tensor
    logit_index: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """Pick per-slot rows out of a packed ``[B, S, ...]`` tensor (logits, hidden states) -> ``[B, K, W, ...]``."""
        rows = torch.arange(values.shape[0], device=values.device)[:, None, None]
        return values[rows, self.logit_index.to(values.device)]


def _check_offsets(offsets: torch.Tensor, B: int, T: int, shift: bool) -> None:
    if offsets.dim() != 2 or offsets.shape[0] != B:
        raise ValueError(f"offsets must be [B, K] with B = {B}, got shape {tuple(offsets.shape)}")
    if offsets.dtype.is_floating_point or offsets.dtype == torch.bool:
        raise ValueError(f"offsets must be integer, got {offsets.dtype}")
    if offsets.numel() == 0:
        raise ValueError("offsets is empty: pack at least one window per row")
    lo = 1 if shift else 0
    low, high = int(offsets.min()), int(offsets.max())
    if low < lo:
        why = "a shifted drafter predicts slot 1 from the clean token before the offset" if shift else "negative"
        raise ValueError(f"window offset {low} < {lo}: {why}")
    if high > T - 1:
        raise ValueError(f"window offset {high} > T-1 = {T - 1}: a window needs at least one label")


def pack_windows(
    clean: torch.Tensor,
    offsets: torch.Tensor,
    width: int,
    mask_id: int,
    *,
    shift: bool = False,
    fill: torch.Tensor | None = None,
    pad_valid: torch.Tensor | None = None,
) -> PackedWindows:
    """Pack K windows per row after the clean sequence: ``[clean ; window_1 ; ... ; window_K]``.

    clean: ``[B, T]``; offsets: ``[B, K]`` (``0 <= offset <= T-1``, ``>= 1`` when ``shift``);
    fill: ``[B, K, W]`` slot ids instead of all masks; pad_valid: ``[B, T]`` bool, True = real token, for
    right-padded rows (padding is never attended and never labels; a window starting in the padding is allowed,
    so rows of different lengths can share K, and is entirely invalid).

    Clean tokens attend causally to real clean tokens only. Window k's slots attend to the real clean tokens at
    positions ``< offset_k`` and to every slot of window k (the ``prefix_causal`` rule), and carry position ids
    ``offset_k .. offset_k + W - 1``. When ``shift``, slot 1's logit comes from clean index ``offset_k - 1``:
    that token is causal in both the packed and the one-window form, so the two agree exactly.
    """
    _check_width(width)
    if clean.dim() != 2:
        raise ValueError(f"clean must be [B, T], got shape {tuple(clean.shape)}")
    B, T = clean.shape
    W = width
    device = clean.device
    _check_offsets(offsets, B, T, shift)  # where they are (CPU offsets for a GPU batch: no device sync)
    offsets = offsets.to(device)
    K = offsets.shape[1]

    if pad_valid is not None:
        if pad_valid.shape != (B, T):
            raise ValueError(f"pad_valid must be [B, T] = {(B, T)}, got shape {tuple(pad_valid.shape)}")
        pad_valid = pad_valid.to(device=device, dtype=torch.bool)
        # Lengths below assume right padding; a hole in the middle would silently mislabel windows.
        if bool((pad_valid[:, 1:] & ~pad_valid[:, :-1]).any()):
            raise ValueError("pad_valid must mark right padding: a row's real tokens come first")
        lengths = pad_valid.sum(dim=1)
    else:
        lengths = torch.full((B,), T, dtype=torch.long, device=device)

    j = torch.arange(W, device=device)
    label_pos = offsets[:, :, None] + j  # [B, K, W] absolute position of each slot
    valid = label_pos < lengths[:, None, None]
    labels = clean.gather(1, label_pos.clamp(max=T - 1).reshape(B, K * W)).reshape(B, K, W)
    labels = labels.masked_fill(~valid, mask_id)

    if fill is None:
        slots = torch.full((B, K * W), mask_id, dtype=clean.dtype, device=device)
    else:
        if fill.shape != (B, K, W):
            raise ValueError(f"fill must be [B, K, W] = {(B, K, W)}, got shape {tuple(fill.shape)}")
        slots = fill.to(dtype=clean.dtype, device=device).reshape(B, K * W)
    input_ids = torch.cat([clean, slots], dim=1)
    position_ids = torch.cat([torch.arange(T, device=device).expand(B, T), label_pos.reshape(B, K * W)], dim=1)

    slot_index = (T + torch.arange(K * W, device=device).reshape(K, W)).expand(B, K, W).contiguous()
    if shift:
        logit_index = torch.cat([(offsets - 1)[:, :, None], slot_index[:, :, :-1]], dim=2)
    else:
        logit_index = slot_index.clone()

    attn_mask = _packed_mask(offsets, T, W, pad_valid)
    return PackedWindows(input_ids, position_ids, attn_mask, slot_index, logit_index, labels, valid)


def _packed_mask(offsets: torch.Tensor, T: int, W: int, pad_valid: torch.Tensor | None) -> torch.Tensor:
    """``[B, S, S]`` bool mask of the packed layout (see ``pack_windows``)."""
    B, K = offsets.shape
    device = offsets.device
    S = T + K * W
    idx = torch.arange(S, device=device)
    window = torch.where(idx >= T, torch.div(idx - T, W, rounding_mode="floor"), -1)  # -1 = clean
    # Every query sees a prefix of the clean part: clean query q sees [0, q], window k sees [0, offset_k).
    clean_limit = torch.cat([torch.arange(1, T + 1, device=device).expand(B, T), offsets.repeat_interleave(W, 1)], 1)
    sees_clean = (idx < T)[None, None, :] & (idx[None, None, :] < clean_limit[:, :, None])
    if pad_valid is not None:
        key_real = torch.cat([pad_valid, torch.ones(B, K * W, dtype=torch.bool, device=device)], dim=1)
        sees_clean = sees_clean & key_real[:, None, :]
    same_window = (window[:, None] == window[None, :]) & (window[:, None] >= 0)
    # The diagonal only matters for padded clean queries: a row with no visible key would give NaN in SDPA,
    # and NaN times a zero loss weight still poisons the gradients.
    return sees_clean | (same_window | torch.eye(S, dtype=torch.bool, device=device))[None]


def slot_rows(x: torch.Tensor, offsets: torch.Tensor, width: int) -> torch.Tensor:
    """``[B * W, width, D]``: for every window (``offsets`` ``[B, W]``) the rows of ``x`` ``[B, T, D]`` that predict
    its slots, position ``i`` read from ``i - 1`` (an AR verifier's logits or final states over the clean rows).
    Slots past a row's end (invalid, never counted) read the last row."""
    B, W = offsets.shape
    pos = (offsets[:, :, None] + torch.arange(width, device=x.device) - 1).clamp(0, x.shape[1] - 1)
    rows = torch.gather(x, 1, pos.reshape(B, W * width)[:, :, None].expand(-1, -1, x.shape[-1]))
    return rows.view(B * W, width, -1)
