"""CUDA graphs of a model's cached forwards: one graph per input shape, replayed instead of ~900 kernel launches.

A decode step of a 7B model is ~6 ms of GPU work but was ~20 ms of wall time on an H200, because Python issued every
kernel one by one. A CUDA graph records the kernels of one forward once and replays them with a single launch. What
makes that correct here is the static KV cache (``kv_cache.py``, engine ``graphs``): its tensors never move, the
slots a forward writes come from a device tensor the cache refills in place before each forward, and the mask has
the same shape every step. Everything that changes between steps (token ids, position ids, mask) is copied into
the graph's input buffers; the cache's bookkeeping (slot ids, positions, lengths) stays outside the graph.

``Transformer.hidden`` calls ``run`` for every cached forward after the prefill on the ``graphs`` engine (so vanilla
steps, verify forwards of each (K, gamma), AR-drafter steps, a prefix-causal drafter's windows and block-diffusion
verify forwards are all graphed), and for the cache-less window of a full-attention drafter (DiffuCoder, Dream), whose
context ``DiffusionDrafter`` left-pads to a multiple of 64 tokens so that one graph serves many cycles; those graphs
live on the model. Graphs are keyed by (rows, new tokens) and live with the cache, so a pooled cache
reused by the next decode reuses them; when rows leave the batch the cache's tensors are replaced and the graphs
captured on the old ones are dropped.

Why ``torch.cuda.CUDAGraph`` directly rather than ``torch.compile(mode="reduce-overhead")``: no compile time (a
7B model compiles for about a minute, longer than a benchmark's whole decode), no recompiles when a Python int such as
the cache length changes, and the set of shapes is known (the decoder's own T values), so there is nothing for a
compiler to discover. CUDA only: ``kv_cache.resolve_engine`` refuses ``graphs`` elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    out: torch.Tensor


class GraphRunner:
    """The CUDA graphs of one model's forwards on one static cache (or without a cache, kept on the model)."""

    def __init__(self, model, cache) -> None:
        self.model, self.cache = model, cache  # cache None: a cache-less forward (a full-attention drafter)
        self.graphs: dict[tuple, _Graph] = {}
        self.version = cache.version if cache is not None else 0
        self.pool = torch.cuda.graph_pool_handle()  # the graphs of one cache share memory: they never run at once
        self.captures = 0  # how many graphs were recorded (tests and benchmarks read it)

    def __deepcopy__(self, memo):
        # a copy of a model (or cache) gets no graphs: these replay kernels on the original's tensors
        return None

    def run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Hidden states of the forward ``Transformer.body(input_ids, position_ids, mask, False, cache)``, by replay;
        the first forward of a shape records its graph. The cache's ``begin`` has already run. A forward needs a mask
        (a static cache always has one): ``is_causal`` would be baked into the graph."""
        if self.cache is not None and self.cache.version != self.version:  # rows left: new tensors, stale graphs
            self.graphs.clear()
            self.version = self.cache.version
        key = (tuple(input_ids.shape), tuple(mask.shape))
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(input_ids, position_ids, mask)
        else:
            g.input_ids.copy_(input_ids)
            g.position_ids.copy_(position_ids)
            g.mask.copy_(mask)
        g.graph.replay()
        # the output buffer belongs to the graph's pool, which the next replay of any shape may overwrite
        return g.out.clone()

    def _capture(self, input_ids, position_ids, mask) -> _Graph:
        ids, pos, m = input_ids.clone(), position_ids.clone(), mask.clone()
        # Warm up on a side stream (cuBLAS handles, lazy kernel loads must not happen during capture). It writes this
        # forward's keys/values into its slots, the same values the replay below writes again.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.model.body(ids, pos, m, False, self.cache)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model.body(ids, pos, m, False, self.cache)
        self.captures += 1
        return _Graph(graph, ids, pos, m, out)
