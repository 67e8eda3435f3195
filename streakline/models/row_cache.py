"""A key/value cache whose rows grow independently: what continuous batching decodes from (``decoding/batching.py``).

``KVCache`` gives every row of a batch the same slot count (rows that kept fewer tokens hold masked-out holes), which
suits a speculative batch that starts and ends together. Continuous batching instead retires a row the moment it
ends and puts a new prompt in its place, so rows have different lengths and restart at any time. Here row ``b``
holds its tokens at slots ``[0, lengths[b])``, in order, and the slot index *is* the position id; a row is emptied
by setting its length to 0 (its old keys are masked until overwritten), and ``keep_rows`` drops rows for good.

One forward over some rows (``use_rows``: a subset for a prefill of newly admitted prompts, or all rows for a
decode step) writes its ``T`` tokens at ``lengths[b] + t``, and the cache attends them itself (``attend``, called by
``Attention.forward``): a prefill of fresh rows causally over its own keys; otherwise in chunks of ``CHUNK`` rows,
each over the key span of its longest row (views of the cache, no copy), with query ``t`` of row ``b`` seeing the
row's cached slots and its own new tokens up to ``t``. So shapes are fixed by the capacity, never a concatenation
per step, and one long prompt makes only its chunk read its length of keys. Only causal attention (a verifier's) is
served.

    cache = RowCache.for_model(model, rows=64, capacity=prompt_max + new_max)
    cache.use_rows(torch.tensor([3, 7]))                       # a prefill of two new prompts into rows 3 and 7
    model.hidden(ids, position_ids=cache.positions(T), attention_mask=valid, cache=cache)
    cache.use_rows(None)                                       # a decode step over every row
    model(next_ids, position_ids=cache.positions(1), cache=cache)

Tests: ``pytest tests/models/test_row_cache.py``.
"""

from __future__ import annotations

import torch

from .attention import attend
from .kv_cache import check_room

CHUNK = 16  # rows attended together, over the longest of their key spans (attend)


class RowCache:
    engine = "rows"  # no CUDA graphs, no static-cache mask path (masks.build_mask asks ``per_row``)
    static = False
    per_row = True
    all_valid = False

    def __init__(self, num_layers, rows, num_kv_heads, head_dim, capacity, dtype=torch.float32, device="cpu") -> None:
        shape = (num_layers, rows, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.rows: torch.Tensor | None = None  # the rows the next forwards touch; None: all
        self._write: tuple[torch.Tensor, torch.Tensor] | None = None  # (row ids [n, T], slot ids [n, T])
        self._fresh, self._chunks = False, []  # this forward's (begin): a prefill of fresh rows; the row chunks
        self._added: torch.Tensor | None = None  # [n] tokens each row gains at commit

    @classmethod
    def for_model(cls, model, rows: int, capacity: int) -> RowCache:
        """A cache for ``model`` (one device; a model placed across devices decodes through ``KVCache``), refused
        with the sizes before allocating when it does not fit the free memory."""
        if getattr(model, "layer_devices", None) is not None:
            raise ValueError("a RowCache holds a model on one device; decode a placed model with KVCache")
        cfg, p = model.config, next(model.parameters())
        nbytes = 2 * cfg.num_layers * rows * cfg.num_kv_heads * capacity * cfg.head_dim * p.element_size()
        check_room(
            nbytes, p.device, f"a KV cache of {rows} rows x {capacity} positions",
            "lower data.batch_size (rows decoded together) or data.max_new_tokens",
        )  # fmt: skip
        return cls(cfg.num_layers, rows, cfg.num_kv_heads, cfg.head_dim, capacity, p.dtype, p.device)

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def length(self) -> int:
        """The longest row (``Transformer.hidden`` reads it only when it must guess positions; callers pass them)."""
        return int(self.lengths.max()) if self.batch_size else 0

    def use_rows(self, rows: torch.Tensor | None) -> None:
        """The rows (``[n]`` long, distinct) the next forwards feed, in the order of their inputs; None: all."""
        self.rows = rows

    def _lengths(self) -> torch.Tensor:
        return self.lengths if self.rows is None else self.lengths[self.rows]

    def positions(self, T: int) -> torch.Tensor:
        """``[n, T]`` position ids of the next ``T`` tokens of each used row: its length onwards."""
        return self._lengths()[:, None] + torch.arange(T, device=self.lengths.device)

    def empty(self, rows: torch.Tensor) -> None:
        """Rows ``rows`` start over (a new prompt goes there); their old keys are never read again."""
        self.lengths[rows] = 0

    def mask(self, q_pos: torch.Tensor, q_valid: torch.Tensor | None, mode: str) -> tuple[None, bool]:
        """Called by ``build_mask`` for a forward on this cache: refuses what it cannot serve, and returns
        ``(None, False)``: the cache builds its masks itself, per chunk of rows, in ``attend``."""
        if mode != "causal":
            raise ValueError(f"a RowCache serves causal attention only, not {mode!r}")
        n, T = q_pos.shape
        base = self._lengths()
        new = torch.full((n,), T, device=base.device) if q_valid is None else q_valid.long().sum(1)
        if int((base + new).max()) > self.capacity:
            raise ValueError(f"a row would pass the cache's capacity of {self.capacity} slots")
        return None, False

    # the calls Transformer.hidden / Attention.forward make around a forward
    def begin(self, positions: torch.Tensor, valid: torch.Tensor | None) -> None:
        n, T = positions.shape
        base = self._lengths()
        rows = torch.arange(self.batch_size, device=base.device) if self.rows is None else self.rows
        slots = base[:, None] + torch.arange(T, device=base.device)
        # padding of a right-padded prefill lands past the row's real tokens (masked, overwritten later); clamp so
        # a short row's padding never indexes past the capacity
        self._write = (rows[:, None].expand(n, T), slots.clamp(max=self.capacity - 1))
        self._fresh = not bool(base.any())  # every used row starts empty: a prefill
        self._chunks = [] if self._fresh else self._plan(base, T)
        self._added = torch.full((n,), T, device=base.device) if valid is None else valid.long().sum(1)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this forward's ``k, v`` (``[n, Hkv, T, D]``) for ``layer`` at each used row's next slots."""
        rows, slots = self._write
        self.k[layer][rows, :, slots] = k.transpose(1, 2)  # [n, T, Hkv, D] at (row, slot)
        self.v[layer][rows, :, slots] = v.transpose(1, 2)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write ``k, v`` and attend queries ``q`` ``[n, H, T, D]`` over each used row's keys: ``[n, H, T, D]``.

        A prefill of fresh rows attends over its own keys, causally (right padding comes after a row's real tokens,
        so no real query sees it). Otherwise the rows go in chunks of ``CHUNK`` with each chunk's own key span (the
        longest row of the chunk), so one long prompt does not make every row read its length of keys; query t of a
        row sees the row's cached slots and its new tokens up to t."""
        self.update(layer, k, v)
        if self._fresh:
            return attend(q, k, v, None, q.shape[2] > 1)
        outs = []
        for start, stop, span, mask in self._chunks:
            if self.rows is None:  # views: no copy of the keys
                ks, vs = self.k[layer, start:stop, :, :span], self.v[layer, start:stop, :, :span]
            else:
                pick = self.rows[start:stop]
                ks, vs = self.k[layer, pick, :, :span], self.v[layer, pick, :, :span]
            outs.append(attend(q[start:stop], ks, vs, mask, False))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _plan(self, base: torch.Tensor, T: int) -> list[tuple[int, int, int, torch.Tensor]]:
        """``(start, stop, span, mask [c, 1, T, span])`` of each chunk of used rows: built once per forward, read
        by every layer. Query t of a row sees its slots before ``base`` and its new tokens up to t."""
        ends = (base + T).tolist()
        chunks = []
        for start in range(0, len(ends), CHUNK):
            stop = min(len(ends), start + CHUNK)
            span = max(ends[start:stop])
            rel = torch.arange(span, device=base.device)[None, None, :] - base[start:stop, None, None]
            chunks.append((start, stop, span, (rel <= torch.arange(T, device=base.device)[None, :, None])[:, None]))
        return chunks

    def commit(self) -> None:
        if self.rows is None:
            self.lengths += self._added
        else:
            self.lengths[self.rows] += self._added
        self._write = self._added = None
        self._chunks = []

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep only rows ``index`` (``[B']`` long), in that order: one copy, when most rows have left for good."""
        self.k, self.v = self.k[:, index].contiguous(), self.v[:, index].contiguous()
        self.lengths = self.lengths[index]
        self.rows = None
