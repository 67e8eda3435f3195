"""Drafters: what proposes the draft tokens a speculative decoder verifies (docs/algorithms.md sections 1 and 3).

Three kinds of model, registered in ``DRAFTERS`` (how each kind drafts; ``registry.DECODER_SPECS`` names one for each
drafted speculative decoder: ``ar_draft`` -> ``ar``, ``diffusion_draft`` -> ``diffusion``, ``dflash_draft`` ->
``dflash``), and one without a model (``registry.MODEL_FREE_DRAFTERS``: ``ngram`` -> ``ngram``).
The stages know the same kinds by the same names as ``pipelines/common/kinds.DRAFTER_KINDS``, whose entries also say
how each is built, trained and exported:

- ``ar``: a small causal LM proposes gamma tokens one forward at a time (SpS / Leviathan), one chain (K = 1).
  Any causal checkpoint works; a ``prefix_causal`` diffusion drafter is run in ``causal`` mode, which is the causal
  LM its clean prefix is trained as (the tiny drafter gets a next-token loss on it, so it doubles as the tiny
  world's AR drafter of the same size).
- ``diffusion``: one forward over ``[context, MASK x gamma]`` gives the gamma marginals ``q_j``; K chains are drawn
  from them, slot by slot independently. A ``prefix_causal`` drafter keeps an exact KV cache of the context (the
  masks are cropped after each forward); a ``full`` drafter recomputes the whole context every cycle because its
  prefix attends to the masks. Shifted drafters (Dream, DiffuCoder) read slot j from the logit one position to its
  left; unshifted ones (LLaDA, the tiny drafter) from the slot itself.
- ``dflash``: a DFlash drafter (``models/dflash.py``) drafts ``[pending token, MASK x gamma]`` in one forward after a
  cached context of the verifier's own layer states, which ``speculative.generate`` hands it (``feature_layers``,
  ``propose(..., features=, feature_valid=)``); K chains as for ``diffusion``.

- ``ngram``: no model: prompt lookup, the tokens that followed the latest earlier occurrence of the context's last
  n tokens (``ngram.py``), one chain, a one-hot q; the training-free baseline every trained drafter must beat.

All speak the same protocol to the decoding loop in ``speculative.py``:

    drafter.reset(batch_size, capacity, engine="auto")      # engine: models/kv_cache.py ENGINES
    proposal = drafter.propose(new_ids, new_valid, gamma=8, K=4, generator=g, iid=False)  # -> Proposal
    drafter.keep_rows(index)                                # drop finished rows
    drafter.release()                                       # the decode is over: a pooled cache may serve another

``new_ids`` ``[B, n]`` are the tokens committed since the previous call (the whole prompt first, then the accepted
drafts plus the replacement/bonus token), right-aligned, ``new_valid`` marks the real ones (None = all real).

Sampling: ``q_j = softmax(top_k(z_j) / tau_d)``; ``tau_d = 0`` makes q one-hot at the argmax. With ``iid=False``
chain 0 is the argmax draft and chains 1..K-1 are samples, so K > 1 never proposes worse than the argmax draft alone
(greedy-acceptance is lossless for any proposal, docs/algorithms.md section 2). With ``iid=True`` all K chains are
i.i.d. samples from q (the AR drafter samples its one chain): the decoder asks for that when the acceptance rule
needs it (leviathan, multi-draft leviathan) or when ``decoder.argmax_chain=false`` (SpecDiff-2's drafts).

Tests: ``python -m pytest tests/decoding/test_drafters.py``.
"""

from __future__ import annotations

import torch

from streakline.models import KVCache, Transformer
from streakline.models.dflash import DFlashModel, block_inputs
from streakline.models.kv_cache import resolve_engine
from streakline.models.masks import default_positions

from .proposal import Proposal

# A full-attention drafter re-reads its whole context every cycle; on the static/graphs engines the context is
# left-padded to a multiple of this, so the forward's shape (and its CUDA graph) changes once every this many tokens.
CONTEXT_BUCKET = 64


def draft_distribution(logits: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    """``[..., V]`` fp32 probabilities ``softmax(top_k(logits) / temperature)``; one-hot argmax at temperature 0."""
    z = logits.float()
    if temperature <= 0:
        return torch.zeros_like(z).scatter_(-1, z.argmax(-1, keepdim=True), 1.0)
    if top_k and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    return torch.softmax(z / temperature, dim=-1)


def sample_chains(q: torch.Tensor, K: int, generator: torch.Generator | None, *, argmax_first: bool) -> torch.Tensor:
    """``[B, K, G]`` chains drawn slot by slot from ``q`` ``[B, G, V]``; chain 0 is the argmax when ``argmax_first``."""
    B, G, V = q.shape
    if G == 0:
        return torch.zeros(B, K, 0, dtype=torch.long, device=q.device)
    n_sampled = K - 1 if argmax_first else K
    chains = []
    if argmax_first:
        chains.append(q.argmax(-1)[:, None])
    if n_sampled:
        flat = torch.multinomial(q.reshape(B * G, V), n_sampled, replacement=True, generator=generator)
        chains.append(flat.view(B, G, n_sampled).permute(0, 2, 1))
    return torch.cat(chains, dim=1)


def _restrict(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    if allowed is None:
        return logits
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def _positions(cache: KVCache, valid: torch.Tensor | None, B: int, n: int, device) -> torch.Tensor:
    start = cache.next_positions() if cache.length else None
    return default_positions(valid, B, n, start, device)


class _CachedDrafter:
    """What every drafter with its own KV cache does the same way: hand the cache back, keep rows."""

    cache: KVCache | None = None

    def release(self) -> None:
        if self.cache is not None:
            self.cache.release()

    def keep_rows(self, index: torch.Tensor) -> None:
        self.cache.keep_rows(index)


class ARDrafter(_CachedDrafter):
    """A causal LM drafting gamma tokens autoregressively (gamma forwards per cycle), one chain."""

    kind = "ar"

    def __init__(self, model: Transformer, *, temperature: float = 0.0, top_k: int | None = None) -> None:
        self.model, self.temperature, self.top_k = model, temperature, top_k
        self.cache: KVCache | None = None
        self.allowed: torch.Tensor | None = None  # [V] bool: ids a draft may contain (cross-tokenizer pairs)

    def reset(self, batch_size: int, capacity: int, engine: str | None = None) -> None:
        self.release()
        self.cache = KVCache.for_model(self.model, batch_size, capacity, engine=engine)

    @torch.no_grad()
    def propose(self, new_ids, new_valid, *, gamma: int, K: int, generator, iid: bool) -> Proposal:
        if K != 1:
            raise ValueError(f"ar_draft proposes one chain per cycle (K=1), got K={K}; use diffusion_draft for K > 1")
        B, n = new_ids.shape
        device = new_ids.device
        pos = _positions(self.cache, new_valid, B, n, device)
        h = self.model.hidden(new_ids, position_ids=pos, attention_mask=new_valid, cache=self.cache, mode="causal")
        logits = self.model.logits(h[:, -1])
        last = pos[:, -1]
        qs, toks = [], []
        for j in range(gamma):
            q = draft_distribution(_restrict(logits, self.allowed), self.temperature, self.top_k)
            if iid:
                x = torch.multinomial(q, 1, generator=generator)[:, 0]
            else:
                x = q.argmax(-1)
            qs.append(q)
            toks.append(x)
            if j + 1 < gamma:  # the last draft token is never fed: the verifier scores it
                logits = self.model(x[:, None], position_ids=(last + 1 + j)[:, None], cache=self.cache, mode="causal")
                logits = logits[:, -1]
        if gamma > 1:
            self.cache.crop(self.cache.length - (gamma - 1))
        tokens = torch.stack(toks, 1)[:, None] if gamma else torch.zeros(B, 1, 0, dtype=torch.long, device=device)
        q = torch.stack(qs, 1) if gamma else None
        return Proposal(tokens=tokens, q=q, forwards=max(gamma, 1))


class DiffusionDrafter(_CachedDrafter):
    """A masked-diffusion drafter: one forward gives gamma marginals, K chains are drawn from them."""

    kind = "diffusion"

    def __init__(self, model: Transformer, *, temperature: float = 1.5, top_k: int | None = 64) -> None:
        cfg = model.config
        if cfg.attention not in ("full", "prefix_causal"):
            raise ValueError(
                f"a diffusion drafter attends 'full' or 'prefix_causal', this one '{cfg.attention}'; "
                "for a causal drafter use decoder=ar_draft"
            )
        if cfg.mask_token_id is None:
            raise ValueError(
                "the diffusion drafter has no mask token id; set the checkpoint preset's mask_token "
                "(or add one with streakline.models.tokenizer.add_mask_token)"
            )
        self.model, self.temperature, self.top_k = model, temperature, top_k
        self.cached = cfg.attention == "prefix_causal"
        self.cache: KVCache | None = None
        self.allowed: torch.Tensor | None = None  # [V] bool: ids a draft may contain (cross-tokenizer pairs)
        self.ids: torch.Tensor | None = None  # full attention: the whole context, re-run every cycle
        self.valid: torch.Tensor | None = None
        self.engine = "eager"  # reset() resolves decoder.engine for this model

    def reset(self, batch_size: int, capacity: int, engine: str | None = None) -> None:
        self.release()
        self.engine = resolve_engine(self.model, engine)
        if self.cached:
            self.cache = KVCache.for_model(self.model, batch_size, capacity, engine=engine)
        self.ids = self.valid = None

    def keep_rows(self, index: torch.Tensor) -> None:
        if self.cached:
            self.cache.keep_rows(index)
        else:
            self.ids, self.valid = self.ids[index], self.valid[index]

    def marginals(self, new_ids: torch.Tensor, new_valid: torch.Tensor | None, gamma: int) -> torch.Tensor:
        """Feed the new context tokens and return the drafter logits ``[B, gamma, V]`` for the next gamma slots."""
        B, n = new_ids.shape
        device = new_ids.device
        mask_id = self.model.config.mask_token_id
        masks = torch.full((B, gamma), mask_id, dtype=torch.long, device=device)
        if self.cached:
            pos = _positions(self.cache, new_valid, B, n, device)
            valid = new_valid
            ids = new_ids
        else:
            real = torch.ones_like(new_ids, dtype=torch.bool) if new_valid is None else new_valid.bool()
            self.ids = new_ids if self.ids is None else torch.cat([self.ids, new_ids], 1)
            self.valid = real if self.valid is None else torch.cat([self.valid, real], 1)
            if self.engine == "eager":
                ids, valid = self.ids, (None if bool(self.valid.all()) else self.valid)
            else:  # fixed shapes: the context left-padded to a bucket, so one CUDA graph serves many cycles
                pad = -self.ids.shape[1] % CONTEXT_BUCKET
                ids = torch.nn.functional.pad(self.ids, (pad, 0))
                valid = torch.nn.functional.pad(self.valid, (pad, 0), value=False)
            pos = default_positions(valid, B, ids.shape[1], None, device)
        last = pos[:, -1]  # the rightmost context token is real in every row (segments are right-aligned)
        mask_pos = last[:, None] + 1 + torch.arange(gamma, device=device)
        window_valid = None if valid is None else torch.cat([valid.bool(), torch.ones_like(masks, dtype=torch.bool)], 1)
        h = self.model.hidden(
            torch.cat([ids, masks], 1),
            position_ids=torch.cat([pos, mask_pos], 1),
            attention_mask=window_valid,
            cache=self.cache if self.cached else None,
            prefix_len=last + 1,
            graphed=self.engine == "graphs",  # the cache-less forward of a full-attention drafter too
        )
        if self.cached:
            self.cache.crop(self.cache.length - gamma)  # the masks never enter the context
        T = ids.shape[1]
        start = T - 1 if self.model.config.shift else T  # shifted: slot j is read one position to the left
        return self.model.logits(h[:, start : start + gamma])

    @torch.no_grad()
    def propose(self, new_ids, new_valid, *, gamma: int, K: int, generator, iid: bool) -> Proposal:
        logits = self.marginals(new_ids, new_valid, gamma)
        q = draft_distribution(_restrict(logits, self.allowed), self.temperature, self.top_k)
        tokens = sample_chains(q, K, generator, argmax_first=not iid)
        return Proposal(tokens=tokens, q=q, forwards=1)


class DFlashDrafter(_CachedDrafter):
    """A DFlash drafter (``models/dflash.py``): one forward over ``[pending token, MASK x gamma]`` after a cached
    context of the verifier's own layer states, drafted with the verifier's embedding and head; K chains.

    It reads what no other drafter does: ``feature_layers`` tells ``speculative.generate`` which verifier layers to
    return, and ``propose`` gets ``features`` ``[B, m, F]`` (right-aligned, ``feature_valid`` marks real rows): the
    states of the tokens that entered the verifier's cache since the previous call (the prompt but its last token at
    first; then the previous pending token and the accepted drafts). Every committed token but the pending one is
    then in the drafter's context, exactly as in training (``models.dflash.packed_blocks``)."""

    kind = "dflash"

    def __init__(self, model: DFlashModel, *, temperature: float = 1.5, top_k: int | None = 64) -> None:
        if not isinstance(model, DFlashModel):
            raise ValueError("decoder=dflash_draft needs a DFlash drafter model (streakline.models.dflash.DFlashModel)")
        self.model, self.temperature, self.top_k = model, temperature, top_k
        self.feature_layers = model.dflash.target_layer_ids
        self.cache: KVCache | None = None
        self.allowed: torch.Tensor | None = None  # the protocol's field; a DFlash drafter shares the verifier's vocab

    def reset(self, batch_size: int, capacity: int, engine: str | None = None) -> None:
        self.release()
        # eager: the context grows by a ragged number of rows a cycle; the static engine is for the verifier
        self.cache = KVCache.for_model(self.model, batch_size, capacity, engine="eager")

    @torch.no_grad()
    def propose(
        self, new_ids, new_valid, *, gamma: int, K: int, generator, iid: bool, features=None, feature_valid=None
    ) -> Proposal:
        self.check_gamma(gamma)
        self.absorb(features, feature_valid)
        return self.draft(new_ids[:, -1], gamma=gamma, K=K, generator=generator, iid=iid)

    def check_gamma(self, gamma: int) -> None:
        block_size = self.model.dflash.block_size
        if gamma > block_size - 1:
            raise ValueError(
                f"a DFlash drafter with block size {block_size} drafts at most {block_size - 1} tokens a cycle; "
                f"got gamma={gamma} (set decoder.gamma <= {block_size - 1})"
            )

    def absorb(self, features: torch.Tensor | None, feature_valid: torch.Tensor | None) -> None:
        """Add the verifier's states of the tokens cached since the last call to the drafter's context (cheap: its
        projection and each layer's keys and values, no draft); every cycle must, drafted or not."""
        if features is None:
            raise ValueError("a DFlash drafter drafts from the verifier's layer states: pass features (generate does)")
        self.model.add_context(features, self.cache, feature_valid)

    def draft(self, pending: torch.Tensor, *, gamma: int, K: int, generator, iid: bool) -> Proposal:
        """One drafter forward over ``[pending, MASK x gamma]`` after the absorbed context: K chains and their q."""
        block = block_inputs(pending, gamma + 1, self.model.dflash.mask_token_id)
        logits = self.model.draft(block, self.cache)[:, 1:]  # slot 0 holds the pending token itself
        logits = self.model.target_logits(logits)  # a draft vocabulary's N columns over the whole vocabulary
        q = draft_distribution(_restrict(logits, self.allowed), self.temperature, self.top_k)
        tokens = sample_chains(q, K, generator, argmax_first=not iid)
        return Proposal(tokens=tokens, q=q, forwards=1)


# drafter kind -> class; registry.SPECULATIVE maps each speculative decoder to one of these (vanilla: none)
# (the model-free ngram drafter is registry.MODEL_FREE_DRAFTERS')
DRAFTERS = {"ar": ARDrafter, "diffusion": DiffusionDrafter, "dflash": DFlashDrafter}
