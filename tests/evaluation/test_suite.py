"""evaluation/suite.py's worker on the micro world: the untimed warm-up decode runs once per method, before its first
timed decode, and changes no output; the methods take turns batch by batch and decode what they decode one by one.
Run: ``python -m pytest tests/evaluation/test_suite.py``."""

import functools
from itertools import groupby

from omegaconf import OmegaConf

from streakline.config import compose_config
from streakline.evaluation.methods import EvalMethod
from streakline.evaluation.suite import EvalWorker, with_references
from streakline.pipelines.common.prompts import evaluation_inputs
from streakline.world import attach_world

METHODS = [EvalMethod("ar_draft", "ar_draft"), EvalMethod("ngram", "ngram"), EvalMethod("static", "static")]
COUNTS = ("new_tokens", "nfe", "cycles", "accepted", "alpha", "drafts_per_forward", "accepted_per_cycle")


@functools.cache
def _run(root, warmup: int, interleave: bool = True) -> tuple[list[dict], EvalWorker]:
    overrides = ["stage=evaluate", "model=micro", f"run_root={root}", "stage.benchmarks=[tiny-math]", "stage.prompts=2",
                 "stage.max_new_tokens=12", "stage.temperatures=[0.0, 1.0]",
                 f"stage.warmup_tokens={warmup}"]  # fmt: skip
    cfg = attach_world(compose_config(overrides), progress=False)
    methods = with_references(METHODS)
    prompts, eos = evaluation_inputs(cfg, methods)
    job = {"cfg": OmegaConf.to_container(cfg, resolve=True), "methods": methods, "prompts": prompts, "eos": eos}
    worker = EvalWorker(job)
    return worker.run_all(list(range(len(methods))), interleave=interleave), worker


def test_the_warm_up_runs_once_per_method_and_changes_no_output(micro_world):
    """Every decode seeds its own generators, so a warm-up decode before the timed ones leaves the tokens of every
    row alike, at T=0 and when sampling, for the verifier's decoders and the block target's. Each method's rows carry
    the seconds of its one warm-up; with ``stage.warmup_tokens=0`` there is none."""
    (cold, _), (warm, _) = _run(micro_world[0], 0), _run(micro_world[0], 4)
    assert [(r["method"], r["temperature"]) for r in cold] == [(r["method"], r["temperature"]) for r in warm]
    assert {r["method"] for r in warm} == {"vanilla", "static", "ar_draft", "ngram"}
    for a, b in zip(cold, warm, strict=True):
        assert a["tokens"] == b["tokens"], (a["method"], a["temperature"])
        assert "warmup_s" not in a and b["warmup_s"] > 0
    for method in {r["method"] for r in warm}:  # one warm-up a method: every row of it reports the same one
        assert len({r["warmup_s"] for r in warm if r["method"] == method}) == 1


def test_interleaved_methods_take_turns_and_decode_what_they_decode_one_by_one(micro_world):
    """With ``stage.interleave`` (the default) every method decodes a benchmark's first batch of prompts before any
    decodes the second, and the first to go moves on by one each batch; one by one, each method decodes all its
    prompts before the next starts. The rows are the same either way: the same order, tokens and counts (the counts of
    a method's calls are summed, and each call seeds its own generators), at T=0 and T=1, for the verifier's decoders
    and the block target's."""
    (turns, interleaved), (alone, one_by_one) = _run(micro_world[0], 0), _run(micro_world[0], 0, False)
    assert [(r["method"], r["benchmark"], r["temperature"]) for r in turns] == [
        (r["method"], r["benchmark"], r["temperature"]) for r in alone
    ]
    for a, b in zip(turns, alone, strict=True):
        assert a["tokens"] == b["tokens"], (a["method"], a["temperature"])
        assert {k: a.get(k) for k in COUNTS} == {k: b.get(k) for k in COUNTS}, (a["method"], a["temperature"])
        assert a["wall_s"] > 0 and a["tokens_per_s"] > 0
    speculative = {"vanilla", "ar_draft", "ngram"}  # the block target's static has cells of its own
    cells = [list(calls) for _, calls in groupby(interleaved.decodes, key=lambda d: (d[1], d[2], d[0] in speculative))]
    assert len(cells) == 4  # (speculative, block) x (T=0, T=1)
    for calls in cells:
        names = [d[0] for d in calls]
        n = len(set(names))
        rounds = [names[i : i + n] for i in range(0, len(names), n)]
        assert len(rounds) == 2 and all(sorted(r) == sorted(set(names)) for r in rounds), names  # 2 prompts, batch 1
        if n > 1:
            assert rounds[1][0] == rounds[0][1], names  # the next batch starts with the method that went second
    # one by one: each method's calls in one stretch
    assert len([m for m, _ in groupby(d[0] for d in one_by_one.decodes)]) == len({d[0] for d in one_by_one.decodes})
