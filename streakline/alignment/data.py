"""Training windows cut from verifier trajectories: the batches that stage ``distill`` feeds its losses.

With ``seq = prompt_ids + completion_ids`` and ``P = len(prompt_ids)``, the window at offset ``i`` is the drafter
input ``[seq[:i], MASK x G]`` with labels ``seq[i:i+G]`` (docs/algorithms.md section 4); slots past the end of ``seq``
are invalid. Offsets run every ``stride`` completion positions from ``P``: ``i = P, P+stride, ... < len(seq)``.
An *example* is one trajectory with up to ``windows_per_seq`` consecutive offsets of it; a trajectory with more
offsets gives several examples, so every offset is used exactly once per epoch.

    windows = TrajectoryWindows(load_trajectories(folder), gamma=8, mask_id=mask, windows_per_seq=8, seed=0)
    for step, batch in enumerate(windows.batches(32, start=resume_step), start=resume_step):  # endless
        # prefix_causal drafter: all windows of a trajectory in one forward (section 6)
        packed = batch.pack(mask_id=mask, shift=cfg.shift)
        logits = model(packed.input_ids, position_ids=packed.position_ids, attn_mask=packed.attn_mask)
        slot_logits = packed.gather(logits)                  # [B, W, G, V] with packed.labels / packed.valid
        # full-attention drafter: one window per row
        ids, attn, prefix_len, labels, valid = unpack_windows(batch, mask)
        logits = model(ids, attention_mask=attn, prefix_len=prefix_len)
        slot_logits = logits[torch.arange(len(ids))[:, None], window_logit_index(prefix_len, G, cfg.shift)]

The stream of examples is the concatenation of one shuffled permutation per epoch (epoch e shuffled by a
``torch.Generator`` seeded from ``(seed, e)``), cut into batches of ``batch_size``; batch s holds stream positions
``[s*batch_size, (s+1)*batch_size)``, so a batch may hold the end of one epoch and the start of the next, and
``batches(batch_size, start=s)`` resumes exactly where step s of an uninterrupted run would be.

``length_grouping=K`` (``trainer.length_grouping``) groups each epoch's shuffled order by length: every run of K
batches' examples is sorted by clean-row length, cut into its batches, and those batches shuffled (the same
generator), so a batch holds rows of about one length and pads little. Batch boundaries are the stream's (positions
``s*batch_size``), also where a batch spans two epochs. A trajectory's examples range from its prompt plus one
window group to its whole row, and SmolLM2's smol prompts run from 48 to 1,578 tokens: drawn as they fall, a third
of the positions a batch of 16 computes (rows padded to 64) are real tokens; grouped by 64 batches, 80%.

Tests: ``pytest tests/alignment/test_data.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from .windows import PackedWindows, pack_windows, window_input

BASE_COLUMNS = ("prompt_ids", "completion_ids")
TOPK_COLUMNS = ("topk_ids", "topk_logprobs")
_TOPK_FIX = "regenerate the trajectories with data.topk_logprobs=20 in stage=trajectories"


@dataclass
class WindowBatch:
    """B examples of W windows of width G (``gamma``).

    Packed form (``prefix_causal`` drafters), one row per example:
      clean ``[B, T]`` int64: row b is ``seq[:min(len(seq), last offset + G)]`` right-padded with the mask id (the
        tokens after the last window's labels are seen by no window of the example, so they are not carried);
      pad_valid ``[B, T]`` bool, True = real token;
      offsets ``[B, W]`` int64 absolute window offsets in ``seq`` (filler windows repeat the row's first offset);
      window_valid ``[B, W]`` bool, False for filler windows of examples with fewer than W windows;
      labels ``[B, W, G]`` int64 ``seq[i:i+G]``, the mask id where invalid;
      valid ``[B, W, G]`` bool slot validity, False past the end of ``seq`` and for every slot of a filler window;
      teacher_ids / teacher_logprobs ``[B, W, G, k]`` int64 / float32: the verifier's stored top-k at each slot's
        completion position ``i + j - P`` (0 where invalid), or None without ``teacher=True``;
      rows ``[B]`` int64: index of each example's trajectory in the dataset (for logging and tests);
      features ``[B, T, L*H]``: the verifier's stored layer states of each clean row's tokens (zeros on padding), in
        the stored dtype (float16, or float32 in tests), or None without ``features=`` (DFlash drafters' input when
        trained offline: ``method.features=stored``).
    """

    clean: torch.Tensor
    pad_valid: torch.Tensor
    offsets: torch.Tensor
    window_valid: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor
    teacher_ids: torch.Tensor | None
    teacher_logprobs: torch.Tensor | None
    rows: torch.Tensor | None = None
    features: torch.Tensor | None = None

    @property
    def gamma(self) -> int:
        return self.labels.shape[-1]

    def to(self, device: torch.device | str) -> WindowBatch:
        """A copy with every tensor on ``device``."""
        return dataclasses.replace(
            self,
            **{
                f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                for f in dataclasses.fields(self)
            },
        )

    def pack(self, mask_id: int, shift: bool, fill: torch.Tensor | None = None) -> PackedWindows:
        """All W windows of each row packed after its clean sequence (``windows.pack_windows``); S = T + W*G.

        The result's ``labels`` / ``valid`` ``[B, W, G]`` are this batch's, so filler windows never count in a loss.
        Raises RuntimeError when ``pack_windows`` labels a real window differently (a batch edited out of shape, or
        ``mask_id`` differing from the one the batch was built with). ``fill`` ``[B, W, G]``: the slots' input ids
        instead of all masks (``method=mdm`` shows the window's unmasked tokens).
        """
        packed = pack_windows(
            self.clean, self.offsets, self.gamma, mask_id, shift=shift, fill=fill, pad_valid=self.pad_valid
        )
        real = self.window_valid[:, :, None].expand_as(self.valid)
        if not (torch.equal(packed.valid & real, self.valid) and torch.equal(packed.labels[real], self.labels[real])):
            raise RuntimeError(
                "pack_windows labels the real windows differently from this WindowBatch; "
                f"was the batch built with mask_id={mask_id}?"
            )
        # pack_windows sees filler windows as ordinary ones (their offsets are real); our valid switches them off.
        return dataclasses.replace(packed, labels=self.labels.clone(), valid=self.valid.clone())


def window_logit_index(prefix_len: torch.Tensor, gamma: int, shift: bool) -> torch.Tensor:
    """``[N, G]`` column of each slot's predicting logit in ``unpack_windows`` rows (prefix_len ``[N]``).

    Unshifted drafters: slot j (0-based) of a row is predicted by the logit at its own position ``prefix_len + j``.
    Shifted drafters (Dream, DiffuCoder): by the logit one position left, ``prefix_len + j - 1`` (slot 0 by the last
    prefix token). Use as ``logits[torch.arange(N)[:, None], index]`` -> ``[N, G, V]``.
    """
    j = torch.arange(gamma, device=prefix_len.device)
    return prefix_len[:, None] + j - int(shift)


def unpack_windows(
    batch: WindowBatch, mask_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row per real window, for ``full``-attention drafters (and as the reference for the packed form).

    Returns ``(input_ids [N, L], attention_valid [N, L] bool, prefix_len [N], labels [N, G], valid [N, G])`` for the
    N real windows in ``batch.window_valid`` order (row-major, so ``x[batch.window_valid] = per_window`` scatters
    back). Row n is ``[seq[:offset], MASK x G]`` (``windows.window_input``) right-padded with the mask id to
    L = max offset + G; right padding keeps the real tokens' position ids at ``0 .. offset+G-1``, as
    ``model(input_ids, attention_mask=attention_valid, prefix_len=prefix_len)`` computes them by default. Which
    logit predicts which slot: ``window_logit_index``.
    """
    where = batch.window_valid.nonzero().tolist()
    G = batch.gamma
    device = batch.clean.device
    prefix_len = batch.offsets[batch.window_valid]
    L = int(prefix_len.max()) + G if len(where) else G
    input_ids = torch.full((len(where), L), mask_id, dtype=batch.clean.dtype, device=device)
    attention_valid = torch.zeros(len(where), L, dtype=torch.bool, device=device)
    for n, (b, w) in enumerate(where):
        ids, _ = window_input(batch.clean[b], int(batch.offsets[b, w]), G, mask_id)
        input_ids[n, : len(ids)] = ids
        attention_valid[n, : len(ids)] = True
    return input_ids, attention_valid, prefix_len, batch.labels[batch.window_valid], batch.valid[batch.window_valid]


def _epoch_seed(seed: int, epoch: int) -> int:
    # A hash, not seed*K + epoch: distinct (seed, epoch) pairs must never share a generator state.
    digest = hashlib.sha256(f"streakline-windows:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _list_lengths(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)


def _flat(column: pa.ChunkedArray) -> np.ndarray:
    """Values of a ``list<x>`` column, all rows concatenated (slices of the Arrow buffers are respected)."""
    return column.combine_chunks().flatten().to_numpy(zero_copy_only=False)


class TrajectoryWindows:
    """Examples of up to ``windows_per_seq`` draft windows of width ``gamma`` from a trajectory ``datasets.Dataset``.

    dataset: columns ``prompt_ids`` and ``completion_ids`` (lists of ids) and, for ``teacher=True``, ``topk_ids`` and
    ``topk_logprobs`` ``[completion tokens][k]`` (``streakline.data.trajectories.load_trajectories``).
    features: the verifier layer states stored beside those shards (``data.features.StoredFeatures``: ``row(i)``
    ``[tokens of row i, L*H]``), carried in every batch as ``WindowBatch.features``; None: none.

    Offsets are ``i = max(P, 1) + n*stride < len(seq)``: a window needs at least one prefix token (a shifted
    drafter predicts slot 0 from it), so an empty prompt starts at offset 1; an empty completion gives no windows.
    ``max_len``: no window may reach past position ``max_len - 1``; offsets with ``i + G > max_len`` are dropped and
    nothing is truncated, so the drafter never sees a context the verifier did not condition on. The clean rows,
    the packed windows' position ids and every ``unpack_windows`` row then stay below ``max_len``; a trajectory whose
    prompt alone is longer than ``max_len - G`` gives no examples (``dropped_windows`` counts what was lost).
    ``windows_per_seq`` W is capped at the largest number of offsets any trajectory has, and is the same for every
    batch. ``pad_multiple``: a batch's clean rows are right-padded to a multiple of it (never past ``max_len``), so
    batch shapes repeat: padding is never attended and never labelled, but with every batch its own length the
    allocator keeps freed blocks of each length (on a CPU, glibc: peak RSS 2.2 -> 6.5 GB over 300 steps of SmolLM2's
    DFlash drafter on stored features, against 2.7 GB padded to 64). See the module docstring for the order of
    examples.
    """

    def __init__(
        self,
        dataset: datasets.Dataset,
        *,
        gamma: int,
        mask_id: int,
        stride: int = 1,
        windows_per_seq: int = 8,
        max_len: int | None = None,
        seed: int = 0,
        teacher: bool = False,
        features=None,
        pad_multiple: int = 1,
        length_grouping: int = 0,
    ) -> None:
        checked = (("gamma", gamma), ("stride", stride), ("windows_per_seq", windows_per_seq),
                   ("pad_multiple", pad_multiple))  # fmt: skip
        if length_grouping < 0:
            raise ValueError(f"TrajectoryWindows: length_grouping must be >= 0 (0: off), got {length_grouping}")
        for name, value in checked:
            if value < 1:
                raise ValueError(f"TrajectoryWindows: {name} must be >= 1, got {value}")
        if max_len is not None and max_len < gamma + 1:
            raise ValueError(f"TrajectoryWindows: max_len={max_len} leaves no room for a prefix and {gamma} slots")
        missing = [c for c in BASE_COLUMNS if c not in dataset.column_names]
        if missing:
            raise ValueError(f"the trajectory dataset lacks columns {missing}; load it with load_trajectories")
        if teacher and not all(c in dataset.column_names for c in TOPK_COLUMNS):
            raise ValueError(
                "teacher=True needs the verifier's top-k log-probs (columns topk_ids, topk_logprobs), which these "
                f"trajectories do not have; {_TOPK_FIX}, or train without teacher top-k"
            )
        self.gamma, self.mask_id, self.stride, self.max_len = gamma, mask_id, stride, max_len
        self.seed, self.teacher, self.features, self.pad_multiple = seed, teacher, features, pad_multiple
        self.length_grouping = length_grouping
        if features is not None and features.rows != len(dataset):
            raise ValueError(
                f"the stored features hold {features.rows} rows but the trajectories {len(dataset)}; regenerate "
                "them together (stage=trajectories with data.feature_layers)"
            )
        columns = list(BASE_COLUMNS) + (list(TOPK_COLUMNS) if teacher else [])
        self._rows = dataset.select_columns(columns).with_format("arrow")

        # Only the lengths are read up front (Arrow, chunk by chunk); ids are fetched per batch.
        prompt_len, completion_len = [], []
        for chunk in dataset.select_columns(list(BASE_COLUMNS)).with_format("arrow").iter(batch_size=65536):
            prompt_len.append(_list_lengths(chunk.column("prompt_ids")))
            completion_len.append(_list_lengths(chunk.column("completion_ids")))
        self._prompt_len = np.concatenate(prompt_len) if prompt_len else np.zeros(0, np.int64)
        seq_len = self._prompt_len + (np.concatenate(completion_len) if completion_len else np.zeros(0, np.int64))
        self._first = np.maximum(self._prompt_len, 1)
        end = seq_len if max_len is None else np.minimum(seq_len, max_len - gamma + 1)  # exclusive bound on offsets
        self._count = np.maximum(0, -(-(end - self._first) // stride))  # offsets per trajectory
        unlimited = np.maximum(0, -(-(seq_len - self._first) // stride))
        self.num_windows = int(self._count.sum())
        self.num_tokens = int(seq_len.sum())  # prompt + completion tokens of every trajectory (the run's metadata)
        self.dropped_windows = int((unlimited - self._count).sum())
        if self.num_windows == 0:
            raise ValueError(
                f"no draft windows in {len(seq_len)} trajectories (gamma={gamma}, max_len={max_len}): every "
                "completion is empty or every prompt is longer than max_len - gamma; raise max_len or check the data"
            )
        self.windows_per_seq = min(windows_per_seq, int(self._count.max()))
        groups = -(-self._count // self.windows_per_seq)
        self._example_row = np.repeat(np.arange(len(groups)), groups)
        # group index of each example within its trajectory: 0, 1, ... per row
        starts = np.cumsum(groups) - groups
        self._example_group = np.arange(len(self._example_row)) - np.repeat(starts, groups)
        # each example's clean row length, as collate cuts it: up to its last window's labels
        first_window = self._example_group * self.windows_per_seq
        n = np.minimum(self.windows_per_seq, self._count[self._example_row] - first_window)
        last = self._first[self._example_row] + stride * (first_window + n - 1)
        self._example_len = np.minimum(seq_len[self._example_row], last + gamma)

        self.topk = 0
        if teacher:
            first = int(self._example_row[0])
            self.topk = int(_list_lengths(self._rows[[first]].column("topk_ids").combine_chunks().flatten())[0])
            if self.topk < 1:
                raise ValueError(f"teacher=True, but the trajectories store no top-k entries; {_TOPK_FIX}")

    def __len__(self) -> int:
        """Examples (trajectory, window group) per epoch."""
        return len(self._example_row)

    def epoch_order(self, epoch: int, batch_size: int = 1) -> torch.Tensor:
        """``[len(self)]`` example indices of epoch ``epoch`` in stream order: a shuffle, grouped by length in
        batches of ``batch_size`` under ``length_grouping`` (module docstring)."""
        gen = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
        order = torch.randperm(len(self), generator=gen)
        if self.length_grouping < 1 or batch_size < 2:
            return order
        return self._grouped(order, epoch, batch_size, gen)

    def _grouped(self, order: torch.Tensor, epoch: int, batch_size: int, gen: torch.Generator) -> torch.Tensor:
        """``order`` with each run of ``length_grouping`` batches sorted by length and its whole batches shuffled.
        Runs start at the stream's batch boundaries: the ``head`` positions that finish the batch the previous epoch
        began stay first, and a last batch the next epoch finishes stays last."""
        E = len(order)
        head = min((-epoch * E) % batch_size, E)
        lengths = torch.from_numpy(self._example_len)[order]
        parts, span = [order[:head]], self.length_grouping * batch_size
        for start in range(head, E, span):
            run = order[start : start + span]
            blocks = run[torch.argsort(lengths[start : start + span], stable=True)].split(batch_size)
            whole = len(blocks) - (len(blocks[-1]) < batch_size)
            parts += [blocks[i] for i in torch.randperm(whole, generator=gen).tolist()] + list(blocks[whole:])
        return torch.cat(parts)

    def real_share(self, batch_size: int, epoch: int = 0, *, grouped: bool = True) -> float:
        """The share of the positions epoch ``epoch``'s batches of ``batch_size`` compute (clean rows padded to the
        batch's ``pad_multiple`` length) that are real tokens, with ``length_grouping`` (``grouped``) or as drawn:
        what the grouping buys, printed by distill."""
        lengths = self._example_len[self.epoch_order(epoch, batch_size if grouped else 1).numpy()]
        batches = [lengths[i : i + batch_size] for i in range(0, len(lengths), batch_size)]
        padded = sum(self._padded_length(int(b.max())) * len(b) for b in batches)
        return float(lengths.sum() / padded)

    def batches(self, batch_size: int, *, start: int = 0) -> Iterator[WindowBatch]:
        """Endless batches ``start, start+1, ...`` of the stream (module docstring), each of ``batch_size`` examples.

        Batch s is the same whatever ``start`` was, for the same dataset, ``seed`` and ``batch_size``.
        """
        if batch_size < 1 or start < 0:
            raise ValueError(f"batches: need batch_size >= 1 and start >= 0, got {batch_size} and {start}")
        E = len(self)
        position = start * batch_size
        epoch, order = -1, None
        while True:
            picked = []
            for pos in range(position, position + batch_size):
                if pos // E != epoch:
                    epoch = pos // E
                    order = self.epoch_order(epoch, batch_size)
                picked.append(int(order[pos % E]))
            position += batch_size
            yield self.collate(picked)

    def collate(self, examples: list[int]) -> WindowBatch:
        """The WindowBatch of these example indices (``0 <= e < len(self)``), in this order."""
        G, W, mask = self.gamma, self.windows_per_seq, self.mask_id
        rows = self._example_row[examples]
        unique, where = np.unique(rows, return_inverse=True)
        table = self._rows[unique.tolist()]
        prompt_len = _list_lengths(table.column("prompt_ids"))
        completion_len = _list_lengths(table.column("completion_ids"))
        prompt_start = np.cumsum(prompt_len) - prompt_len
        completion_start = np.cumsum(completion_len) - completion_len
        prompts = _flat(table.column("prompt_ids")).astype(np.int64)
        completions = _flat(table.column("completion_ids")).astype(np.int64)
        if self.teacher:
            top_ids, top_lp = self._topk(table, completion_len)

        B = len(examples)
        offsets = np.zeros((B, W), np.int64)
        window_valid = np.zeros((B, W), bool)
        labels = np.full((B, W, G), mask, np.int64)
        valid = np.zeros((B, W, G), bool)
        seqs = []
        if self.teacher:
            teacher_ids = np.zeros((B, W, G, self.topk), np.int64)
            teacher_lp = np.zeros((B, W, G, self.topk), np.float32)
        for b, (example, u) in enumerate(zip(examples, where, strict=True)):
            r = rows[b]
            P = prompt_len[u]
            seq = np.concatenate(
                [
                    prompts[prompt_start[u] : prompt_start[u] + P],
                    completions[completion_start[u] : completion_start[u] + completion_len[u]],
                ]
            )
            first_window = int(self._example_group[example]) * W
            n = min(W, int(self._count[r]) - first_window)
            offs = self._first[r] + self.stride * (first_window + np.arange(n))
            offsets[b, :n], offsets[b, n:] = offs, offs[0]
            window_valid[b, :n] = True
            pos = offs[:, None] + np.arange(G)  # [n, G] absolute position of each slot
            ok = pos < len(seq)
            labels[b, :n] = np.where(ok, seq[np.minimum(pos, len(seq) - 1)], mask)
            valid[b, :n] = ok
            seqs.append(seq[: self._example_len[example]])  # up to its last window's labels
            if self.teacher:
                # slot j of the window at offset i is completion token i + j - P
                index = completion_start[u] + np.minimum(pos - P, completion_len[u] - 1)
                teacher_ids[b, :n] = np.where(ok[..., None], top_ids[index], 0)
                teacher_lp[b, :n] = np.where(ok[..., None], top_lp[index], 0.0)

        T = self._padded_length(max(len(s) for s in seqs))
        clean = np.full((B, T), mask, np.int64)
        pad_valid = np.zeros((B, T), bool)
        for b, s in enumerate(seqs):
            clean[b, : len(s)] = s
            pad_valid[b, : len(s)] = True
        feats = (
            None if self.features is None else self._features(rows, prompt_len[where] + completion_len[where], seqs, T)
        )
        return WindowBatch(
            clean=torch.from_numpy(clean),
            pad_valid=torch.from_numpy(pad_valid),
            offsets=torch.from_numpy(offsets),
            window_valid=torch.from_numpy(window_valid),
            labels=torch.from_numpy(labels),
            valid=torch.from_numpy(valid),
            teacher_ids=torch.from_numpy(teacher_ids) if self.teacher else None,
            teacher_logprobs=torch.from_numpy(teacher_lp) if self.teacher else None,
            rows=torch.from_numpy(rows.astype(np.int64)),
            features=feats,
        )

    def _padded_length(self, longest: int) -> int:
        """The batch's clean length: ``longest`` rounded up to ``pad_multiple``, and no further than ``max_len``."""
        padded = -(-longest // self.pad_multiple) * self.pad_multiple
        return padded if self.max_len is None else max(longest, min(padded, self.max_len))

    def _features(self, rows: np.ndarray, seq_len: np.ndarray, seqs: list[np.ndarray], T: int) -> torch.Tensor:
        """``[B, T, L*H]`` stored features of each example's trajectory, cut to its clean row and zero-padded."""
        parts = []
        for r, n, s in zip(rows.tolist(), seq_len.tolist(), seqs, strict=True):
            row = self.features.row(r)
            if row.shape[0] != n:  # features of other rows than these (a shard regenerated alone by hand)
                raise ValueError(
                    f"the stored features of trajectory {r} cover {row.shape[0]} tokens, the trajectory has {n}; "
                    "regenerate them together (stage=trajectories with data.feature_layers)"
                )
            parts.append(torch.from_numpy(np.ascontiguousarray(row[: len(s)])))
        out = torch.zeros(len(parts), T, parts[0].shape[1], dtype=parts[0].dtype)
        for b, part in enumerate(parts):
            out[b, : len(part)] = part
        return out

    def _topk(self, table: pa.Table, completion_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``([sum C, k] int64 ids, [sum C, k] float32 logprobs)`` of the fetched rows, completion tokens in order."""
        out = []
        for name in TOPK_COLUMNS:
            outer = table.column(name).combine_chunks()
            if not np.array_equal(_list_lengths(outer), completion_len):
                raise ValueError(f"{name} must hold one top-k list per completion token; {_TOPK_FIX}")
            inner = outer.flatten()
            if len(inner) and not (_list_lengths(inner) == self.topk).all():
                raise ValueError(f"{name} rows hold different numbers of top-k entries (expected {self.topk})")
            out.append(inner.flatten().to_numpy(zero_copy_only=False).reshape(-1, self.topk))
        return out[0].astype(np.int64), out[1].astype(np.float32)
