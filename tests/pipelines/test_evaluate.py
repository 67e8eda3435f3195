"""stage=evaluate on the micro world: results.json follows its schema with every method lossless, results.md and
the figures exist, a rerun is cached, and discovery finds this experiment's distill runs.
Run: ``python -m pytest tests/pipelines/test_evaluate.py``."""

import json
import shutil
from pathlib import Path

import pytest

from streakline.artifacts import StageRun
from streakline.config import compose_config
from streakline.evaluation.results import RECORD_FIELDS
from streakline.pipelines import run_stage
from streakline.pipelines.evaluate import discover
from streakline.world import attach_world

METHODS = (
    "stage.methods=[{name: vanilla, decoder: vanilla}, {name: ar_draft, decoder: ar_draft},"
    " {name: base, decoder: diffusion_draft, K: 2}, {name: static, decoder: static},"
    " {name: threshold, decoder: threshold}, {name: ngram, decoder: ngram}]"
)


def _cfg(root, *extra):
    return compose_config(
        # the micro verifier repeats one token on both benchmarks: degenerate_share=1 keeps them in the headline
        # (and the figures) so that this test sees the whole report
        ["stage=evaluate", "model=micro", f"run_root={root}", "stage.benchmarks=[tiny-math, tiny-code]",
         "stage.prompts=2", "stage.max_new_tokens=12", "stage.temperatures=[0.0, 1.0]", "stage.degenerate_share=1.0",
         *extra]
    )  # fmt: skip


@pytest.fixture(scope="module")
def evaluated(micro_world):
    return run_stage(_cfg(micro_world[0], METHODS))


def test_results_follow_the_schema_and_every_method_is_lossless(evaluated):
    doc = json.loads(open(evaluated.artifact).read())
    records = doc["records"]
    assert {"hardware", "versions", "experiment"} <= set(doc)
    assert len(records) == 6 * 2 * 2
    for r in records:
        assert set(RECORD_FIELDS) <= set(r)
        assert 0 < r["reference_top_share"] <= 1 and r["degenerate"] is False  # measured, and 1.0 keeps it in
        assert r["lossless"] is True, r["lossless_check"]
        assert r["new_tokens"] > 0 and r["nfe_per_token"] > 0 and r["speedup"] > 0
    spec = [r for r in records if r["family"] == "speculative" and r["decoder"] != "vanilla"]
    assert all(len(r["alpha"]) == r["settings"]["gamma"] for r in spec)
    assert all(r["settings"]["argmax_chain"] is True for r in spec)  # decoder.argmax_chain's default, recorded
    sampled = [r for r in spec if r["temperature"] > 0]
    assert sampled and all("p_value" in r["lossless_check"] for r in sampled)
    md = open(evaluated.details["markdown"]).read()
    assert "Table 2" in md and "| base |" in md and "| threshold |" in md and "| ngram |" in md
    ngram = [r for r in records if r["decoder"] == "ngram"]
    assert all(r["drafter_forwards"] == 0 for r in ngram) and len(ngram) == 4  # no model drafts
    assert set(evaluated.details["figures"]) == {"fig2_acceptance.png", "dllm_nfe.png"}
    for path in evaluated.details["figures"].values():
        assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_rerun_is_cached_by_config(micro_world, evaluated):
    again = run_stage(_cfg(micro_world[0], METHODS))
    assert again.cached and not evaluated.cached
    assert again.folder == evaluated.folder
    assert again.details["records"] == json.loads(json.dumps(evaluated.details["records"]))


def test_discovery_lists_distill_runs_and_the_grid(micro_world, tmp_path):
    root, _, _ = micro_world
    cfg = _cfg(tmp_path, "stage.k_grid=[1,2]", "stage.drafter_temperature_grid=[1.0]")
    cfg.run_root = str(root)
    attach_world(cfg)
    cfg.run_root = str(tmp_path)
    # A complete distill run of this experiment (its drafter: a copy of the world's).
    with StageRun(tmp_path, cfg.experiment.name, "distill", {"method": {"name": "streak"}}) as run:
        shutil.copytree(cfg.model.drafter.path, run.dir / "drafter")
        for step in (20, 40):  # an intermediate checkpoint, and the final one (the drafter/ row)
            shutil.copytree(cfg.model.drafter.path, run.dir / "checkpoints" / f"step-{step:06d}")
        run.add_output("drafter")
        run.metrics.update(steps=40, **{"eval/tiny-math/decoder_streak": 1.5})
    methods = {m.name: m for m in discover(cfg)}
    # Fig. 7: the base drafter is step 0 (evaluated once, at every temperature); the intermediate checkpoint is a
    # point at the lowest temperature only; the final checkpoint is the run's own row, not a second one.
    assert methods["base"].steps == 0 and methods["base"].temperature is None and not methods["base"].curve
    curve = methods["streak@20"]
    assert (curve.steps, curve.temperature, curve.curve, curve.distill_loss) == (20, 0.0, True, "streak")
    assert curve.drafter == str(run.dir / "checkpoints" / "step-000020")
    assert "streak@40" not in methods and not methods["streak"].curve and methods["streak"].temperature is None
    assert {"vanilla", "ngram", "ar_draft", "base", "streak", "grid K=1 tau=1", "grid K=2 tau=1", "static",
            "threshold"} <= set(methods)  # fmt: skip
    assert methods["ngram"].decoder == "ngram" and methods["ngram"].drafter is None
    cfg.stage.ngram = False
    assert "ngram" not in {m.name for m in discover(cfg)}
    assert methods["streak"].steps == 40 and methods["streak"].drafter == str(run.dir / "drafter")
    assert methods["grid K=2 tau=1"].drafter == str(run.dir / "drafter")
    grid = [m for m in methods.values() if m.grid]
    assert len(grid) == 2 and all(m.argmax_chain is False for m in grid)  # the paper's i.i.d. drafts
    assert all(m.argmax_chain is None for m in methods.values() if not m.grid)  # the decoder's setting
    assert methods["grid K=1 tau=1"].as_dict()["argmax_chain"] is False  # part of the run key


def test_a_benchmark_from_a_local_file_and_a_bad_one(micro_world, tmp_path):
    """``stage.benchmarks`` takes ``name@/file`` as ``data.prompt_sources`` does; a benchmark that cannot be loaded
    is a ConfigError naming it (it was a traceback)."""
    from streakline.config import ConfigError
    from streakline.pipelines.common.prompts import benchmark_prompts
    from streakline.pipelines.common.roles import role_tokenizer

    rows = [{"question": f"Sam has {i} apples. How many?", "answer": f"{i}"} for i in range(3)]
    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = role_tokenizer(attach_world(_cfg(micro_world[0]), progress=False), "verifier")
    got = benchmark_prompts(tok, [f"gsm8k@{tmp_path / 'gsm8k.jsonl'}", "tiny-math"], 2, chat_template=False)
    assert list(got) == ["gsm8k", "tiny-math"] and len(got["gsm8k"]) == 2
    assert tok.decode(got["gsm8k"][1]).startswith("Sam has 1 apples. How many?")
    with pytest.raises(ConfigError, match="benchmark 'mmlu': unknown prompt source 'mmlu'"):
        benchmark_prompts(tok, ["mmlu"], 2, chat_template=False)


@pytest.mark.parametrize("grid", ["[0.0,-1.0]", "[nan]"])
def test_a_bad_temperature_is_refused_before_any_row_decodes(micro_world, grid):
    from streakline.config import ConfigError

    root = micro_world[0]
    before = sorted(p for p in Path(root).rglob("*") if p.is_dir())
    with pytest.raises(ConfigError, match="a verifier temperature is >= 0"):
        run_stage(_cfg(root, f"stage.temperatures={grid}", "experiment.name=bad-temperature"))
    assert sorted(p for p in Path(root).rglob("*") if p.is_dir()) == before  # nothing made, nothing decoded


def test_a_decode_past_the_verifiers_positions_names_evaluates_own_setting(micro_world):
    """The decoder's position check says what to lower; under stage=evaluate that is stage.max_new_tokens, which
    evaluate reads, not decoder.max_new_tokens, which stage=decode reads."""
    from streakline.decoding.vanilla import PositionLimitError

    cfg = _cfg(micro_world[0], METHODS, "stage.max_new_tokens=5000", "stage.temperatures=[0.0]",
               "experiment.name=too-long")  # fmt: skip
    with pytest.raises(PositionLimitError, match=r"lower stage\.max_new_tokens") as info:
        run_stage(cfg)
    assert "decoder.max_new_tokens" not in str(info.value)


def test_each_row_says_its_precision_and_the_check_it_passed(micro_world):
    """``precision=fp32`` keeps the token-for-token check; ``precision=bf16`` runs the verifier and the drafter in
    bf16, in a folder of its own, and holds T=0 rows to the near-tie check (evaluation/lossless.py). The block target
    stays in its preset's dtype either way."""
    methods = "stage.methods=[{name: ar_draft, decoder: ar_draft}, {name: static, decoder: static}]"
    runs = {}
    for precision in ("fp32", "bf16"):
        cfg = _cfg(micro_world[0], methods, "stage.temperatures=[0.0]", "stage.benchmarks=[tiny-math]",
                   "experiment.name=precision", f"precision={precision}")  # fmt: skip
        runs[precision] = run_stage(cfg)
        records = {r["method"]: r for r in json.loads(open(runs[precision].artifact).read())["records"]}
        assert records["vanilla"]["precision"] == records["ar_draft"]["precision"] == precision
        assert records["static"]["precision"] == "fp32"  # the micro target's preset dtype
        check = records["ar_draft"]["lossless_check"]
        assert records["ar_draft"]["lossless"] and records["ar_draft"]["divergence_rate"] == check["divergence_rate"]
        assert ("near-ties" in check["check"]) == (precision == "bf16"), check
        assert records["static"]["lossless_check"]["check"] == "reference decoder"
    assert runs["fp32"].folder != runs["bf16"].folder
