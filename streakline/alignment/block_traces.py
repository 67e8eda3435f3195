"""Draft-free decoding traces of a block-diffusion target: what SPOT trains on and what Spiffy calibrates from.

A trace is one row's decode of one block by the draft-free decoder (``static`` or ``threshold``): for every
forward, the block's masked positions before the step, the top-k tokens per position ranked the way the target
ranks them (``token_scores``: log-probs, plus the coupled noise at temperature > 0), their probabilities, the
rule's confidences, and which positions the step committed. Only top-k is kept (k = 32 by default): a drafter
never needs the tail, and it keeps a step at ``L * k`` numbers.

    traces = collect_traces(target, prompts, BlockDecodeConfig(rule="static", max_new_tokens=64), batch_size=4)
    write_trace_shard(folder / "shard-00000-of-00004.parquet", traces, meta={"target": "tiny-target"})
    traces = read_trace_shards(folder)

A step's ``stale`` view at step t is its own top-k; the SPOT order model and the Spiffy calibrator pair step t's
distribution with the states that follow (docs/algorithms.md sections 8-9; docs/spot.md and docs/spiffy.md say how).
Tests: ``python -m pytest tests/alignment/test_block_traces.py``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm.auto import tqdm

from streakline.artifacts import atomic_file
from streakline.decoding.block_diffusion import (
    BlockDecodeConfig,
    BlockStep,
    decode_blocks,
    stale_probs,
    stale_topk,
    token_scores,
)
from streakline.decoding.registry import BLOCK
from streakline.decoding.vanilla import left_pad

META_KEY = b"streakline"


@dataclass
class TraceStep:
    """One forward of the draft-free decoder, one row. Arrays are over the block's L positions."""

    masked: np.ndarray  # [L] bool, positions masked before this step
    commit: np.ndarray  # [L] bool, positions this step committed
    tokens: np.ndarray  # [L] int64, block contents after the step (mask id where still masked)
    confidence: np.ndarray  # [L] float32, the commit rule's confidence
    topk_ids: np.ndarray  # [L, k] int64, tokens ranked by token_scores (rank 0 = the token the target takes)
    topk_probs: np.ndarray  # [L, k] float32, softmax(logits / T) of those tokens (T = 1 at temperature 0)


@dataclass
class BlockTrace:
    """One row's decode of one block: ``steps`` in order, the block's contents before the first step."""

    prompt: int  # index of the prompt in the collected list
    block: int
    out_start: int  # output index of the block's first position (negative when the prompt ends inside it)
    initial: np.ndarray  # [L] int64
    steps: list[TraceStep]

    @property
    def states(self) -> list[np.ndarray]:
        """The block contents before each step and after the last one (len(steps) + 1 arrays)."""
        return [self.initial, *(s.tokens for s in self.steps)]


def _topk(step: BlockStep, k: int, cfg: BlockDecodeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    return stale_topk(token_scores(step.logits, step.gumbel, cfg), stale_probs(step.logits, cfg), k)


@torch.no_grad()
def collect_traces(
    model,
    prompts: Sequence[Sequence[int]],
    cfg: BlockDecodeConfig,
    *,
    batch_size: int = 4,
    top_k: int = 32,
    progress: bool = False,
) -> list[BlockTrace]:
    """Decode ``prompts`` (token id lists) with the draft-free decoder ``cfg`` and return every block's trace,
    ordered by prompt, then block. Deterministic: at temperature > 0 the coupled noise is keyed by ``cfg.seed``."""
    if cfg.rule not in BLOCK:
        raise ValueError(f"traces come from a draft-free decoder ({' or '.join(BLOCK)}), not {cfg.rule!r}")
    if top_k < 2:
        raise ValueError(f"top_k must be >= 2 (a second token candidate is part of the drafts), got {top_k}")
    device = next(model.parameters()).device
    traces: list[BlockTrace] = []
    bar = tqdm(total=len(prompts), desc="traces", unit="prompt", disable=not progress, dynamic_ncols=True)
    for begin in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[begin : begin + batch_size]]
        ids, mask = left_pad(chunk)
        open_: dict[tuple[int, int], BlockTrace] = {}

        def on_step(step: BlockStep, open_=open_, begin=begin) -> None:
            k = min(top_k, step.logits.shape[-1])
            topk_ids, topk_probs = _topk(step, k, cfg)
            for r in step.masked.any(dim=1).nonzero().flatten().tolist():
                key = (r, step.block)
                if key not in open_:
                    open_[key] = BlockTrace(
                        prompt=begin + r,
                        block=step.block,
                        out_start=int(step.out_positions[r, 0]),
                        initial=step.tokens[r].cpu().numpy().astype(np.int64),
                        steps=[],
                    )
                open_[key].steps.append(
                    TraceStep(
                        masked=step.masked[r].cpu().numpy(),
                        commit=step.commit[r].cpu().numpy(),
                        tokens=step.committed[r].cpu().numpy().astype(np.int64),
                        confidence=step.confidence[r].float().cpu().numpy(),
                        topk_ids=topk_ids[r].cpu().numpy().astype(np.int64),
                        topk_probs=topk_probs[r].float().cpu().numpy(),
                    )
                )

        decode_blocks(model, ids.to(device), mask.to(device), cfg, on_step=on_step)
        traces.extend(open_[key] for key in sorted(open_))
        bar.update(len(chunk))
    bar.close()
    traces.sort(key=lambda t: (t.prompt, t.block))
    return traces


# ----------------------------------------------------------------------------------------------- storage
# One parquet row per (trace, step); a trace's rows are consecutive. Arrays are stored flat with their shapes
# implied by L and k (in the file metadata), so a shard is plain columns any parquet reader can open.


def write_trace_shard(path: str | os.PathLike, traces: Sequence[BlockTrace], meta: dict) -> Path:
    """Write ``traces`` to one parquet file atomically (temp file, fsync, rename). ``meta`` (JSON-able: target,
    decoding config, ...) is stored in the file with the block size L and k."""
    path = Path(path)
    if not traces:
        raise ValueError(f"no traces to write to {path}")
    L, k = traces[0].steps[0].topk_ids.shape
    cols: dict[str, list] = {
        name: []
        for name in (
            "trace",
            "prompt",
            "block",
            "out_start",
            "step",
            "initial",
            "masked",
            "commit",
            "tokens",
            "confidence",
            "topk_ids",
            "topk_probs",
        )
    }
    for t_i, trace in enumerate(traces):
        for s_i, step in enumerate(trace.steps):
            if step.topk_ids.shape != (L, k):
                raise ValueError(f"trace {t_i} step {s_i} has top-k shape {step.topk_ids.shape}, expected {(L, k)}")
            for name, value in (
                ("trace", t_i),
                ("prompt", trace.prompt),
                ("block", trace.block),
                ("out_start", trace.out_start),
                ("step", s_i),
                ("initial", trace.initial.astype(np.int32).tolist()),
                ("masked", step.masked.tolist()),
                ("commit", step.commit.tolist()),
                ("tokens", step.tokens.astype(np.int32).tolist()),
                ("confidence", step.confidence.astype(np.float32).tolist()),
                ("topk_ids", step.topk_ids.astype(np.int32).reshape(-1).tolist()),
                ("topk_probs", step.topk_probs.astype(np.float16).reshape(-1).tolist()),
            ):
                cols[name].append(value)
    table = pa.table(
        {
            **{n: pa.array(cols[n], pa.int32()) for n in ("trace", "prompt", "block", "out_start", "step")},
            **{n: pa.array(cols[n], pa.list_(pa.int32())) for n in ("initial", "tokens", "topk_ids")},
            **{n: pa.array(cols[n], pa.list_(pa.bool_())) for n in ("masked", "commit")},
            "confidence": pa.array(cols["confidence"], pa.list_(pa.float32())),
            "topk_probs": pa.array(cols["topk_probs"], pa.list_(pa.float16())),
        }
    )
    table = table.replace_schema_metadata({META_KEY: json.dumps({**meta, "block_size": L, "top_k": k}).encode()})
    with atomic_file(path, "wb") as f:
        pq.write_table(table, f, compression="zstd")
    return path


def read_trace_meta(path: str | os.PathLike) -> dict:
    raw = pq.read_schema(path).metadata or {}
    if META_KEY not in raw:
        raise ValueError(f"{path} is not a streakline trace shard (no {META_KEY.decode()} metadata); recollect it")
    return json.loads(raw[META_KEY])


def read_trace_shard(path: str | os.PathLike) -> list[BlockTrace]:
    """The traces of one shard, as written."""
    meta = read_trace_meta(path)
    L, k = meta["block_size"], meta["top_k"]
    try:
        table = pq.read_table(path).to_pydict()
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"trace shard {path} cannot be read ({e}); delete it and rerun the stage") from e
    traces: list[BlockTrace] = []
    for i in range(len(table["trace"])):
        if table["step"][i] == 0:
            traces.append(
                BlockTrace(
                    prompt=table["prompt"][i],
                    block=table["block"][i],
                    out_start=table["out_start"][i],
                    initial=np.asarray(table["initial"][i], dtype=np.int64),
                    steps=[],
                )
            )
        traces[-1].steps.append(
            TraceStep(
                masked=np.asarray(table["masked"][i], dtype=bool),
                commit=np.asarray(table["commit"][i], dtype=bool),
                tokens=np.asarray(table["tokens"][i], dtype=np.int64),
                confidence=np.asarray(table["confidence"][i], dtype=np.float32),
                topk_ids=np.asarray(table["topk_ids"][i], dtype=np.int64).reshape(L, k),
                topk_probs=np.asarray(table["topk_probs"][i], dtype=np.float32).reshape(L, k),
            )
        )
    return traces


def read_trace_shards(folder: str | os.PathLike) -> list[BlockTrace]:
    """Every ``*.parquet`` trace shard in ``folder``, in file-name order."""
    paths = sorted(Path(folder).glob("*.parquet"))
    if not paths:
        raise FileNotFoundError(f"no trace shards (*.parquet) in {folder}; run the stage that collects them")
    return [t for p in paths for t in read_trace_shard(p)]
