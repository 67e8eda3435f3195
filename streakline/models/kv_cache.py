"""Preallocated key/value cache shared by every decoder in ``streakline.decoding``.

One tensor per direction holds all layers, ``[layers, batch, kv_heads, capacity, head_dim]``, so appending a step
is a slice write (no ``torch.cat`` per token) and keeping an accepted tree path is one gather over all layers.
Each slot also records the token's position id and whether it is real (``valid``), because after a tree
verification rows of a batch keep different numbers of tokens: the unused slots stay in place but are masked out.

Lifecycle of one forward (driven by ``Transformer.forward``):
    cache.begin(positions, valid)      # reserve slots [length, length + T)
    k, v = cache.update(layer, k, v)   # per layer: write the new slots, read everything so far
    cache.commit()                     # length += T

Between forwards the decoder may ``crop(n)`` (drop rejected draft tokens) or ``gather(index, start)``
(keep the accepted path of a draft tree).

Two engines (``ENGINES``; ``resolve_engine`` turns ``auto`` into one of them for a model):

- ``eager``: ``update`` returns the slots written so far (``[:length + T]``), so shapes grow by one every step and
  the fast paths of ``masks.build_mask`` skip the mask where they can. The CPU default.
- ``static``: fixed capacity (rounded up to ``STATIC_ROUND`` slots) and fixed shapes: new keys/values are written with
  ``index_copy_`` at slot ids held in a device tensor, ``update`` returns the whole capacity, and the mask (built
  over every slot; unused ones are invalid) has the same shape every step. It is sized like the eager one and, in
  the rare batch that outgrows it, doubles (new tensors, new graphs). A step's kernels then never change, which
  is what lets ``graphs`` replay them (``models/graphs.py``), and what keeps the GPU's attention kernels from
  re-planning per length.
- ``graphs``: ``static`` plus CUDA graphs of each cached forward after the prefill (``GRAPHS_BY_DEFAULT`` says
  whether ``auto`` picks it on a GPU; until the first GPU check it picks ``static``).

``KVCache.for_model`` hands a static cache out of a small pool kept on the model, so the graphs captured on it are
reused by the next decode of the same batch size; ``release()`` returns it.
"""

from __future__ import annotations

import torch

from streakline.errors import UserError

GIB = 2**30
ENGINES = ("auto", "eager", "static", "graphs")
STATIC_ROUND = 256  # a static cache's capacity is a multiple of this: prompts of similar length share a pooled cache
_POOL_SIZE = 4  # static caches kept per model (each holds its CUDA graphs)
# What ``auto`` means on one GPU. The CUDA-graph path was written and its static layout tested on CPU, but it has
# not yet run on a GPU: until ``bench/gpu.sh`` (the engine tests: graphs against eager, token for token) has passed
# on one, ``auto`` takes the static engine there and graphs are asked for by name (``decoder.engine=graphs``).
GRAPHS_BY_DEFAULT = False


class MemoryLimitError(UserError, MemoryError):
    """A request whose memory alone exceeds what the device has free: refused with the sizes before the allocator
    fails mid-run (on a GPU) or the machine starts swapping (on a CPU)."""


def free_bytes(device: torch.device | str) -> int | None:
    """Memory free for new tensors on ``device``: the GPU's free memory, or the host's ``MemAvailable`` on Linux;
    None where it cannot be read (no check is made then)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo", encoding="ascii") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def check_room(nbytes: int, device: torch.device | str, what: str, fix: str) -> None:
    """Raise MemoryLimitError when ``nbytes`` (for ``what``) exceed the free memory of ``device``."""
    free = free_bytes(device)
    if free is not None and nbytes > free:
        raise MemoryLimitError(
            f"{what} needs {nbytes / GIB:,.1f} GiB but {free / GIB:,.1f} GiB are free on {torch.device(device)}; {fix}"
        )


def _static_capacity(slots: int) -> int:
    """A static cache's capacity for ``slots``: rounded up to a multiple of ``STATIC_ROUND``."""
    return -(-slots // STATIC_ROUND) * STATIC_ROUND


def device_runs(devices) -> list[tuple[int, int, torch.device]]:
    """``(first layer, end layer, device)`` of each run of consecutive layers on one device, in layer order."""
    runs: list[tuple[int, int, torch.device]] = []
    for i, d in enumerate(devices):
        if runs and runs[-1][2] == d:
            runs[-1] = (runs[-1][0], i + 1, d)
        else:
            runs.append((i, i + 1, d))
    return runs


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int = 256,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        layer_devices: list[torch.device] | None = None,
        engine: str = "eager",
    ) -> None:
        """``device`` holds the slot bookkeeping (positions, validity: where the model's inputs live);
        ``layer_devices`` (one per layer, for a model placed across devices) where each layer's keys and values
        live, each run of consecutive layers on one device in one tensor; None: all on ``device``.
        engine: ``eager``, ``static`` or ``graphs`` (module docstring); a static cache never grows."""
        if engine not in ENGINES[1:]:
            raise ValueError(f"unknown cache engine {engine!r}; valid: {', '.join(ENGINES[1:])}")
        self.engine = engine
        self.static = engine != "eager"
        if self.static:
            capacity = _static_capacity(capacity)
        devices = [torch.device(d) for d in (layer_devices or [device] * num_layers)]
        if len(devices) != num_layers:
            raise ValueError(f"layer_devices names {len(devices)} devices for {num_layers} layers")
        runs = device_runs(devices)
        # segments: (first layer, device); _where[layer] = (segment, layer within it)
        self.segments = [(start, d) for start, _, d in runs]
        self._where = [(s, i - start) for s, (start, end, _) in enumerate(runs) for i in range(start, end)]
        self.ks = [torch.zeros((end - start, batch_size, num_kv_heads, capacity, head_dim), dtype=dtype, device=d)
                   for start, end, d in runs]  # fmt: skip
        self.vs = [torch.zeros_like(k) for k in self.ks]
        self.pos = torch.zeros(batch_size, capacity, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)
        self.length = 0
        # Python-side flag so the hot decode path can skip building a mask without a device sync.
        self.all_valid = True
        self._pending = 0
        self._slots: dict[int, torch.Tensor] = {}  # static: per forward width T, the device tensor of slot ids
        self.version = 0  # bumped when the tensors are replaced (rows leave): graphs captured before are stale
        self.graphs = None  # models.graphs.GraphRunner, made by the model on first use (engine "graphs")
        self.in_use = True  # a pooled cache is handed out again only once released

    @property
    def k(self) -> torch.Tensor:
        """All layers' keys ``[layers, B, Hkv, capacity, D]``, for a cache on one device (kernels, tests)."""
        return self._whole(self.ks)

    @property
    def v(self) -> torch.Tensor:
        return self._whole(self.vs)

    def _whole(self, parts: list[torch.Tensor]) -> torch.Tensor:
        if len(parts) != 1:
            raise AttributeError("this cache spans several devices; read its segments (ks, vs)")
        return parts[0]

    @classmethod
    def for_model(cls, model, batch_size: int, capacity: int = 256, engine: str | None = None) -> KVCache:
        """A cache for ``model``'s shapes; engine None: the model's ``engine`` attribute (default ``auto``).
        A static cache of the same rows and capacity bucket released earlier is reused (with its graphs)."""
        cfg = model.config
        p = next(model.parameters())
        layer_devices = getattr(model, "layer_devices", None)
        engine = resolve_engine(model, engine)
        if engine != "eager":
            capacity = _static_capacity(capacity)
            pool = model.__dict__.setdefault("_cache_pool", _Pool())
            for cache in pool:
                if (not cache.in_use and cache.engine == engine and cache.batch_size == batch_size
                        and cache.capacity == capacity):  # fmt: skip
                    cache.reset()
                    return cache
        layers: dict[torch.device, int] = {}  # per device, over all its runs
        for start, end, d in device_runs(layer_devices or [p.device] * cfg.num_layers):
            layers[d] = layers.get(d, 0) + end - start
        for d, n in layers.items():
            nbytes = 2 * n * batch_size * cfg.num_kv_heads * capacity * cfg.head_dim * p.element_size()
            check_room(
                nbytes, d, f"a KV cache of {batch_size} rows x {capacity} positions",
                "lower decoder.batch_size (rows decoded together) or decoder.max_new_tokens",
            )  # fmt: skip
        cache = cls(
            cfg.num_layers, batch_size, cfg.num_kv_heads, cfg.head_dim, capacity, p.dtype,
            model.embed.weight.device, layer_devices, engine,
        )  # fmt: skip
        if engine != "eager":
            pool.append(cache)
            del pool[: max(0, len(pool) - _POOL_SIZE)]  # the oldest go (a cache in use stays alive with its user)
        return cache

    def release(self) -> None:
        """The decode that owned this cache is done: a pooled static cache may be handed out again."""
        self.in_use = False

    def reset(self) -> None:
        """Empty, in place (same tensors, so graphs captured on them stay valid)."""
        self.valid.zero_()
        self.length, self.all_valid, self._pending, self.in_use = 0, True, 0, True

    @property
    def batch_size(self) -> int:
        return self.pos.shape[0]

    @property
    def capacity(self) -> int:
        return self.pos.shape[1]

    def next_positions(self) -> torch.Tensor:
        """``[B]`` position id the next token of each row gets: one past its last valid slot (0 when empty)."""
        if self.length == 0:
            return torch.zeros(self.batch_size, dtype=torch.long, device=self.pos.device)
        pos = self.pos[:, : self.length].masked_fill(~self.valid[:, : self.length], -1)
        return pos.max(dim=1).values + 1

    def _grow(self, needed: int) -> None:
        # A static cache grows too (rarely: a speculative batch whose rows keep different lengths can outgrow the
        # usual bound). Its tensors are replaced, so graphs captured on the old ones are dropped (version) and the
        # next forwards record new ones at the new capacity.
        if self.static:
            self.version += 1
        cap = self.capacity
        while cap < needed:
            cap *= 2
        if cap == self.capacity:
            return
        for parts in (self.ks, self.vs):
            for i, old in enumerate(parts):
                L, B, H, _, D = old.shape
                parts[i] = old.new_zeros((L, B, H, cap, D))
                parts[i][:, :, :, : self.length] = old[:, :, :, : self.length]
        for name in ("pos", "valid"):
            old = getattr(self, name)
            new = old.new_zeros((B, cap))
            new[:, : self.length] = old[:, : self.length]
            setattr(self, name, new)

    def begin(self, positions: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Reserve ``T`` slots for the tokens of the coming forward. positions, valid: ``[B, T]``."""
        T = positions.shape[1]
        end = self.length + T
        if end > self.capacity:
            self._grow(end)
        self.pos[:, self.length : end] = positions
        if valid is None:
            self.valid[:, self.length : end] = True
        else:
            self.valid[:, self.length : end] = valid
            self.all_valid = False
        self._pending = T
        if self.static:
            slots = self._slots.get(T)
            if slots is None:
                slots = self._slots[T] = torch.empty(T, dtype=torch.long, device=self.pos.device)
            # in place: a captured graph reads this very tensor
            torch.arange(self.length, end, out=slots)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's ``k, v`` (``[B, Hkv, T, D]``) for one layer; return all keys/values so far."""
        end = self.length + self._pending
        segment, i = self._where[layer]
        ks, vs = self.ks[segment], self.vs[segment]
        if self.static:  # fixed shapes: write at the slot ids, read the whole capacity (the mask hides the rest)
            slots = self._slots[self._pending]
            if slots.device != ks.device:
                slots = slots.to(ks.device)
            ks[i].index_copy_(2, slots, k)
            vs[i].index_copy_(2, slots, v)
            return ks[i], vs[i]
        ks[i, :, :, self.length : end] = k
        vs[i, :, :, self.length : end] = v
        return ks[i, :, :, :end], vs[i, :, :, :end]

    def commit(self) -> None:
        self.length += self._pending
        self._pending = 0

    def crop(self, length: int) -> None:
        """Forget every slot from ``length`` on (e.g. rejected draft tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.valid[:, length : self.length] = False
        self.length = length

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep only the batch rows ``index`` (``[B']`` long), in that order: finished rows leave the batch."""
        for parts in (self.ks, self.vs):
            for i, t in enumerate(parts):
                parts[i] = t[:, index.to(t.device)]
        idx = index.to(self.pos.device)
        self.pos, self.valid = self.pos[idx], self.valid[idx]
        self.version += 1

    def gather(
        self,
        index: torch.Tensor,
        start: int,
        keep: torch.Tensor | None = None,
        copy=None,
    ) -> None:
        """Keep, per row, the slots ``index[b]`` (absolute slot ids ``>= start``) at ``start .. start+n``.

        index: ``[B, n]`` long; keep: optional ``[B, n]`` bool, False for entries a row does not keep (its slot is
        written but masked out, so rows that accepted fewer tokens stay aligned with the others).
        Everything past ``start + n`` is dropped. Used to commit the accepted path of a verified draft tree.
        copy: optional ``copy(k, v, index, start)`` doing the K/V move in place (the decoder passes the tree-path
        compaction kernel); the default gathers into a temporary, which is safe for any index.
        """
        B, n = index.shape
        if B != self.batch_size:
            raise ValueError(f"index has {B} rows, cache has {self.batch_size}")
        # checked where it costs nothing; on a GPU it would be two host syncs per cycle, and the decoder's index
        # comes from the tree layout (tests check it on CPU)
        if n and index.device.type == "cpu" and (int(index.min()) < start or int(index.max()) >= self.length):
            raise ValueError(f"gather indices must lie in [{start}, {self.length})")
        for k, v in zip(self.ks, self.vs, strict=True):
            L, _, H, _, D = k.shape
            at = index.to(k.device)
            if copy is not None:
                copy(k, v, at, start)
            else:
                kv_idx = at[None, :, None, :, None].expand(L, B, H, n, D)
                for t in (k, v):
                    t[:, :, :, start : start + n] = torch.gather(t, 3, kv_idx)
        idx = index.to(self.pos.device)
        self.pos[:, start : start + n] = torch.gather(self.pos, 1, idx)
        valid = torch.gather(self.valid, 1, idx)
        if keep is not None:
            valid = valid & keep.to(valid.device)
            self.all_valid = False
        self.valid[:, start : start + n] = valid
        self.valid[:, start + n : self.length] = False
        self.length = start + n


class _Pool(list):
    """The static caches kept on a model; a copy of the model starts with none (they belong to the original)."""

    def __deepcopy__(self, memo):
        return _Pool()


def resolve_engine(model, engine: str | None = None) -> str:
    """``eager``, ``static`` or ``graphs`` for ``model``: ``engine`` (or the model's ``engine`` attribute) with
    ``auto`` meaning eager on a CPU or a model placed across devices, and on one CUDA device static (graphs once
    ``GRAPHS_BY_DEFAULT``)."""
    engine = engine or getattr(model, "engine", None) or "auto"
    if engine not in ENGINES:
        raise ValueError(f"unknown decoder engine {engine!r}; valid: {', '.join(ENGINES)}")
    placed = getattr(model, "layer_devices", None) is not None
    cuda = model.embed.weight.device.type == "cuda"
    if engine == "auto":
        if not cuda or placed:
            return "eager"
        return "graphs" if GRAPHS_BY_DEFAULT else "static"
    if engine == "graphs" and (not cuda or placed):
        raise ValueError(
            "decoder.engine=graphs needs the model on one CUDA device; use decoder.engine=static (same shapes, no "
            "graphs) or auto"
        )
    return engine
