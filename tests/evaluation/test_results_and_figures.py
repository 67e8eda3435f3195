"""results.json / results.md from hand-made records, every figure from them, and the training temperatures a row
reads from its drafter's run manifests. Run: ``python -m pytest tests/evaluation/test_results_and_figures.py``."""

import json
import shutil

import pytest

from streakline.artifacts import StageRun
from streakline.evaluation import figures
from streakline.evaluation.figures import draw_all, fig5_drafting, fig7_speedup_vs_steps
from streakline.evaluation.results import RECORD_FIELDS, finalize, headline, markdown, steps_curves, write_results
from streakline.evaluation.suite import mark_reference_diversity, training_temperatures


def _rec(method, decoder, bench="tiny-math", T=0.0, tps=100.0, nfe_tok=1.0, family="speculative", **kw):
    r = {f: None for f in RECORD_FIELDS}
    r.update(method=method, decoder=decoder, family=family, benchmark=bench, temperature=T, settings={},
             prompts=2, new_tokens=64, tokens_per_s=tps, tokens_per_verifier_call=1 / nfe_tok,
             accepted_per_cycle=0.0, alpha=[], nfe=64, nfe_per_token=nfe_tok, lossless=True,
             lossless_check={"lossless": True}, wall_s=1.0)  # fmt: skip
    r.update(kw)
    return r


def _records():
    recs = [_rec("vanilla", "vanilla"), _rec("ar_draft", "ar_draft", tps=150.0, alpha=[0.8, 0.6]),
            _rec("base", "diffusion_draft", tps=90.0, steps=0, alpha=[0.5, 0.1],
                 settings={"distill_loss": None})]  # fmt: skip
    for steps, tps in ((100, 120.0), (200, 180.0)):
        recs.append(_rec(f"streak@{steps}", "diffusion_draft", tps=tps, steps=steps, alpha=[0.9, 0.5, 0.2],
                         settings={"distill_loss": "streak", "curve": steps < 200}, drafter=f"/ckpt/{steps}",
                         accepted_per_cycle=steps / 100))  # fmt: skip
    for K in (1, 4):
        for tau in (1.0, 2.0):
            recs.append(_rec(f"grid K={K} tau={tau}", "diffusion_draft", tps=100 + 10 * K * tau, drafter="/ckpt/200",
                             settings={"grid": True, "K": K, "drafter_temperature": tau,
                                       "argmax_chain": False}))  # fmt: skip
    recs += [_rec("static", "static", family="block", tps=50.0, nfe_tok=1.0),
             _rec("spot", "spot", family="block", tps=100.0, nfe_tok=0.25, lossless=False)]  # fmt: skip
    return finalize(recs)


def test_finalize_and_markdown():
    recs = _records()
    by = {r["method"]: r for r in recs}
    assert by["ar_draft"]["speedup"] == pytest.approx(1.5)
    assert by["spot"]["speedup"] == pytest.approx(2.0) and by["spot"]["forward_reduction"] == pytest.approx(4.0)
    md = markdown(recs, {"experiment": "x", "prompts": 2, "max_new_tokens": 64})
    assert "| ar_draft | 1.50x / 0.00 |" in md
    assert "| spot | 0.250 / 4.00x (LOSSY) |" in md


def test_write_results_and_figures(tmp_path):
    recs = _records()
    j, m = write_results(tmp_path, recs, {"experiment": "x"})
    assert json.loads(j.read_text())["records"] == json.loads(json.dumps(recs))
    with pytest.raises(ValueError, match="miss fields"):
        write_results(tmp_path / "bad", [{"method": "x"}], {})
    figs = draw_all(recs, tmp_path / "figures")
    assert set(figs) == {"fig2_acceptance.png", "fig5_speedup_vs_k.png", "fig7_speedup_vs_steps.png", "dllm_nfe.png"}
    for path in figs.values():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    # Nothing to draw: no file, no error.
    assert draw_all([r for r in recs if r["method"] == "vanilla"], tmp_path / "none") == {}


def test_fig5_note_reads_the_drafting_from_the_rows():
    grid = [r for r in _records() if r["settings"].get("grid")]
    assert "i.i.d." in fig5_drafting(grid)
    argmax = [{**r, "settings": {**r["settings"], "argmax_chain": True}} for r in grid]
    assert "argmax-first" in fig5_drafting(argmax)
    assert "mixed" in fig5_drafting(grid[:1] + argmax[1:])
    old = [{**r, "settings": {k: v for k, v in r["settings"].items() if k != "argmax_chain"}} for r in grid]
    assert fig5_drafting(old) is None  # rows from before the setting: no claim either way


def _drawn(monkeypatch):
    """Keep the figures drawn (their axes are read back) instead of only writing them."""
    kept = []
    save = figures._save

    def keep(fig, path):
        kept.append(fig)
        return save(fig, path)

    monkeypatch.setattr(figures, "_save", keep)
    return kept


def test_fig7_draws_a_line_per_loss_each_starting_at_the_base_row(tmp_path, monkeypatch):
    recs = _records()
    recs += [_rec(f"ar_distill@{s}", "diffusion_draft", tps=tps, steps=s, settings={"distill_loss": "ar_distill"})
             for s, tps in ((100, 95.0), (200, 110.0))]  # fmt: skip
    # a line from a history written before the rename (settings.method), and a point at another temperature
    recs += [_rec("expce@1", "diffusion_draft", tps=130.0, steps=150, settings={"method": "expce"}),
             _rec("vanilla", "vanilla", T=1.0),
             _rec("streak", "diffusion_draft", T=1.0, tps=10.0, steps=200,
                  settings={"distill_loss": "streak"})]  # fmt: skip
    recs = finalize(recs)
    kept = _drawn(monkeypatch)
    path = fig7_speedup_vs_steps(recs, tmp_path / "fig7.png")
    assert path.read_bytes()[:4] == b"\x89PNG" and len(kept) == 1
    speedup_ax = kept[0].axes[0]
    assert "T=0" in speedup_ax.get_title()  # the lowest temperature with points
    lines = {ln.get_label(): ln for ln in speedup_ax.get_lines()}
    assert set(lines) == {"streak", "ar_distill", "expce", "AR drafter"}
    base = 0.9  # the base row's speedup: 90 tokens/s over vanilla's 100
    expected = {"streak": [0, 100, 200], "ar_distill": [0, 100, 200], "expce": [0, 150]}
    for loss, steps in expected.items():
        assert list(lines[loss].get_xdata()) == steps
        assert lines[loss].get_ydata()[0] == pytest.approx(base)
    assert list(lines["AR drafter"].get_ydata()) == pytest.approx([1.5, 1.5])
    # The same points as data, at T=1 only the one row there (no base row at T=1: no step 0).
    T, curves = steps_curves(recs, 1.0)
    assert T == 1.0 and [s for s, _ in curves["tiny-math"]["streak"]] == [200]
    # Nothing distilled: no figure, even with the base row.
    assert fig7_speedup_vs_steps([r for r in recs if r.get("steps") in (None, 0)], tmp_path / "none.png") is None


def test_dflash_lines_start_at_the_dflash_base_and_plain_lines_at_the_plain_base(tmp_path, monkeypatch):
    """One loss trained on both kinds of drafter: two lines (``ce_streak``, ``dflash:ce_streak``), each starting at
    the step-0 row drawn with its own decoder; a DFlash line without a dflash:base row has no step 0."""
    recs = _records()
    recs += [_rec("ce_streak", "diffusion_draft", tps=150.0, steps=200, settings={"distill_loss": "ce_streak"}),
             _rec("dflash:base", "dflash_draft", tps=40.0, steps=0, settings={"distill_loss": None}),
             _rec("dflash:ce_streak@100", "dflash_draft", tps=110.0, steps=100,
                  settings={"distill_loss": "ce_streak", "curve": True}),
             _rec("dflash:ce_streak", "dflash_draft", tps=160.0, steps=200,
                  settings={"distill_loss": "ce_streak"})]  # fmt: skip
    recs = finalize(recs)
    _, curves = steps_curves(recs)
    lines = {name: [(s, r["method"]) for s, r in pts] for name, pts in curves["tiny-math"].items()}
    assert lines["ce_streak"] == [(0, "base"), (200, "ce_streak")]
    assert lines["dflash:ce_streak"] == [(0, "dflash:base"), (100, "dflash:ce_streak@100"), (200, "dflash:ce_streak")]
    assert lines["streak"][0] == (0, "base")
    kept = _drawn(monkeypatch)
    fig7_speedup_vs_steps(recs, tmp_path / "fig7.png")
    drawn = {ln.get_label(): ln for ln in kept[0].axes[0].get_lines()}
    assert list(drawn["dflash:ce_streak"].get_ydata()) == pytest.approx([0.4, 1.1, 1.6])  # tokens/s over vanilla's
    assert (drawn["dflash:ce_streak"].get_linestyle(), drawn["ce_streak"].get_linestyle()) == ("--", "-")  # kinds
    md = markdown(recs, {"experiment": "x"})
    assert "| dflash:ce_streak | tiny-math | 0.40x / 0.00 | 1.10x / 0.00 | 1.60x / 0.00 |" in md
    # without the DFlash start, the DFlash line has no step 0 (the plain base drafter is not where it started)
    _, curves = steps_curves([r for r in recs if r["method"] != "dflash:base"])
    assert [s for s, _ in curves["tiny-math"]["dflash:ce_streak"]] == [100, 200]


def test_markdown_has_the_fig7_points_and_the_training_temperatures():
    recs = _records()
    for r in recs:
        if r["method"].startswith("streak@"):
            r["settings"].update(train_drafter_temperature=1.5, data_temperature=0.5, data_top_p=0.95,
                                 drafter_temperature=1.5)  # fmt: skip
    md = markdown(recs, {"experiment": "x"})
    table2 = md.split("## Speedup and mean accepted streak (Table 2)")[1].split("Cells:")[0]
    assert "| streak@200 |" in table2 and "| streak@100 |" not in table2  # a checkpoint's point: the Fig. 7 table
    assert "## Speedup vs distillation steps (Fig. 7), T=0" in md
    assert "| loss | benchmark | 0 | 100 | 200 |" in md
    assert "| streak | tiny-math | 0.90x / 0.00 | 1.20x / 1.00 | 1.80x / 2.00 |" in md
    assert "streak@200 tau_q=1.5 on trajectories sampled at T=0.5, top-p 0.95" in md
    assert "| method | benchmark | T | tau_d | tokens/s |" in md
    assert "| streak@100 | tiny-math | 0 | 1.5 | 120.0 |" in md


def test_training_temperatures_follow_the_drafter_to_its_runs(tmp_path):
    with StageRun(tmp_path, "x", "trajectories", {"data": {"temperature": 0.7, "top_p": 0.9}}) as traj:
        (traj.dir / "shards").mkdir()
    key = {"method": {"name": "streak", "drafter_temperature": 1.5}, "trajectories": str(traj.dir / "shards")}
    with StageRun(tmp_path, "x", "distill", key) as run:
        (run.dir / "checkpoints" / "step-000002").mkdir(parents=True)
        (run.dir / "drafter").mkdir()
    want = {"train_drafter_temperature": 1.5, "data_temperature": 0.7, "data_top_p": 0.9}
    assert training_temperatures(str(run.dir / "drafter")) == want
    assert training_temperatures(str(run.dir / "checkpoints" / "step-000002")) == want
    unknown = dict.fromkeys(want)
    assert training_temperatures(None) == unknown  # the preset's drafter
    assert training_temperatures(str(tmp_path / "elsewhere" / "drafter")) == unknown
    assert training_temperatures(str(run.dir / "init")) == unknown  # what a DFlash run started from: untrained
    shutil.rmtree(traj.dir)  # trajectories gone: the drafter's own temperature is still known
    assert training_temperatures(str(run.dir / "drafter")) == {**unknown, "train_drafter_temperature": 1.5}


def test_a_degenerate_benchmark_is_kept_out_of_the_headline_and_the_figures(tmp_path):
    """The reference's greedy output on 'newlines' is one token: its rows get their own table with the reason, and
    neither the headline table nor a figure shows it; the diversity comes from the reference's real tokens."""
    rows = [
        _rec("vanilla", "vanilla", tokens=[[5, 6, 7, 8], [9, 5, 6, 7]]),
        _rec("vanilla", "vanilla", bench="newlines", tokens=[[3, 3, 3, 3], [3, 3, 3, 4]]),
        _rec("vanilla", "vanilla", bench="newlines", T=1.0, tokens=[[1, 2], [3, 4]]),  # sampled: not the measure
        _rec("base", "diffusion_draft", tps=90.0, alpha=[0.5, 0.1], tokens=[]),
        _rec("base", "diffusion_draft", bench="newlines", tps=400.0, alpha=[1.0, 1.0], tokens=[]),
    ]
    mark_reference_diversity(rows)
    by = {(r["method"], r["benchmark"], r["temperature"]): r for r in rows}
    assert by[("base", "newlines", 0.0)]["reference_top_share"] == pytest.approx(7 / 8)
    assert by[("base", "newlines", 0.0)]["reference_top_token"] == 3
    assert by[("base", "tiny-math", 0.0)]["reference_top_share"] == pytest.approx(2 / 8)
    assert [r["degenerate"] for r in rows] == [False, True, True, False, True]
    loose = [dict(r) for r in rows]
    mark_reference_diversity(loose, threshold=0.9)  # stage.degenerate_share=0.9: 7/8 is not above it
    assert not any(r["degenerate"] for r in loose)
    recs = finalize([{k: v for k, v in r.items() if k != "tokens"} for r in rows])
    assert [r["benchmark"] for r in headline(recs)] == ["tiny-math", "tiny-math"]
    md = markdown(recs, {"experiment": "x"})
    headline_table = md.split("## Speedup")[1].split("Left out")[0]
    assert "tiny-math T=0" in headline_table and "newlines" not in headline_table
    assert "**newlines**, where 88% of the vanilla decoder's greedy output is one token (id 3)" in md
    assert "| base | 4.00x / 0.00 |" in md.split("Left out")[1]  # its rows are still reported, in their own table
    # the figures of all records are the figures of the headline records, byte for byte; drawn with the degenerate
    # benchmark (fig2 called directly), the same figure differs
    whole = draw_all(recs, tmp_path / "all")["fig2_acceptance.png"].read_bytes()
    assert whole == draw_all(headline(recs), tmp_path / "head")["fig2_acceptance.png"].read_bytes()
    assert whole != figures.fig2_acceptance(recs, tmp_path / "with_newlines.png").read_bytes()
