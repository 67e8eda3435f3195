"""evaluation/suite.py's worker on the micro world: the untimed warm-up decode runs once per method, before its first
timed decode, and changes no output. Run: ``python -m pytest tests/evaluation/test_suite.py``."""

from omegaconf import OmegaConf

from streakline.config import compose_config
from streakline.evaluation.methods import EvalMethod
from streakline.evaluation.suite import EvalWorker, with_references
from streakline.pipelines.common.prompts import evaluation_inputs
from streakline.world import attach_world

METHODS = [EvalMethod("ar_draft", "ar_draft"), EvalMethod("ngram", "ngram"), EvalMethod("static", "static")]


def _rows(root, warmup: int) -> list[dict]:
    overrides = ["stage=evaluate", "model=micro", f"run_root={root}", "stage.benchmarks=[tiny-math]", "stage.prompts=2",
                 "stage.max_new_tokens=12", "stage.temperatures=[0.0, 1.0]",
                 f"stage.warmup_tokens={warmup}"]  # fmt: skip
    cfg = attach_world(compose_config(overrides), progress=False)
    methods = with_references(METHODS)
    prompts, eos = evaluation_inputs(cfg, methods)
    job = {"cfg": OmegaConf.to_container(cfg, resolve=True), "methods": methods, "prompts": prompts, "eos": eos}
    worker = EvalWorker(job)
    return [row for i in range(len(methods)) for row in worker.run(i)]


def test_the_warm_up_runs_once_per_method_and_changes_no_output(micro_world):
    """Every decode seeds its own generators, so a warm-up decode before the timed ones leaves the tokens of every
    row alike, at T=0 and when sampling, for the verifier's decoders and the block target's. Each method's rows carry
    the seconds of its one warm-up; with ``stage.warmup_tokens=0`` there is none."""
    cold, warm = _rows(micro_world[0], 0), _rows(micro_world[0], 4)
    assert [(r["method"], r["temperature"]) for r in cold] == [(r["method"], r["temperature"]) for r in warm]
    assert {r["method"] for r in warm} == {"vanilla", "static", "ar_draft", "ngram"}
    for a, b in zip(cold, warm, strict=True):
        assert a["tokens"] == b["tokens"], (a["method"], a["temperature"])
        assert "warmup_s" not in a and b["warmup_s"] > 0
    for method in {r["method"] for r in warm}:  # one warm-up a method: every row of it reports the same one
        assert len({r["warmup_s"] for r in warm if r["method"] == method}) == 1
