"""Trace collection from the draft-free block decoder and its parquet round trip.
Run: ``python -m pytest tests/alignment/test_block_traces.py``."""

import numpy as np
import pytest

from streakline.alignment.block_traces import collect_traces, read_trace_shards, write_trace_shard
from streakline.decoding.block_diffusion import BlockDecodeConfig, decode_blocks
from streakline.decoding.vanilla import left_pad
from tests.decoding.test_block_diffusion import L, _model, _prompts


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_traces_replay_the_decode(model, temperature):
    cfg = BlockDecodeConfig(max_new_tokens=10, rule="static", temperature=temperature, seed=1)
    prompts = [p.tolist() for p in _prompts()]
    traces = collect_traces(model, prompts, cfg, batch_size=2, top_k=5)
    ids, mask = left_pad(prompts)
    res = decode_blocks(model, ids, mask, cfg)
    assert sum(len(t.steps) for t in traces) == sum(res.nfe_per_row)
    for p, out in enumerate(res.tokens):
        blocks = [t for t in traces if t.prompt == p]
        assert [t.block for t in blocks] == list(range(len(blocks)))
        decoded = np.concatenate([t.states[-1][max(0, -t.out_start) :] for t in blocks]).tolist()
        assert decoded[: len(out)] == out
        for t in blocks:
            for before, step, after in zip(t.states, t.steps, t.states[1:], strict=False):
                assert step.commit.sum() == 1 and (step.commit <= step.masked).all()  # static: one commit
                assert (after[~step.commit] == before[~step.commit]).all()
                pos = int(step.commit.argmax())
                # The committed token is the rank-0 token of that step's ranking.
                assert after[pos] == step.topk_ids[pos, 0]
                assert (np.diff(step.topk_probs, axis=1) <= 1e-6).all() or temperature > 0
                assert step.topk_ids.shape == (L, 5)


def test_shard_round_trip(model, tmp_path):
    cfg = BlockDecodeConfig(max_new_tokens=6, rule="threshold", threshold=0.05)
    traces = collect_traces(model, [p.tolist() for p in _prompts()], cfg, top_k=4)
    write_trace_shard(tmp_path / "shard-0.parquet", traces, {"target": "random"})
    back = read_trace_shards(tmp_path)
    assert len(back) == len(traces)
    for a, b in zip(traces, back, strict=True):
        assert (a.prompt, a.block, a.out_start) == (b.prompt, b.block, b.out_start)
        assert (a.initial == b.initial).all()
        for x, y in zip(a.steps, b.steps, strict=True):
            for name in ("masked", "commit", "tokens", "topk_ids"):
                assert (getattr(x, name) == getattr(y, name)).all()
            np.testing.assert_allclose(x.topk_probs, y.topk_probs, atol=1e-3)  # float16 on disk
    with pytest.raises(FileNotFoundError, match="no trace shards"):
        read_trace_shards(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.parquet").write_bytes(b"not parquet")
    with pytest.raises(Exception, match="parquet|trace"):
        read_trace_shards(tmp_path / "bad")
