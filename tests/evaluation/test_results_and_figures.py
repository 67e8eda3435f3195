"""results.json / results.md from hand-made records, and every figure from them. Run:
``python -m pytest tests/evaluation/test_results_and_figures.py``."""

import json

import pytest

from streakline.evaluation.figures import draw_all, fig5_drafting
from streakline.evaluation.results import RECORD_FIELDS, finalize, markdown, write_results


def _rec(method, decoder, bench="tiny-math", T=0.0, tps=100.0, nfe_tok=1.0, family="speculative", **kw):
    r = {f: None for f in RECORD_FIELDS}
    r.update(method=method, decoder=decoder, family=family, benchmark=bench, temperature=T, settings={},
             prompts=2, new_tokens=64, tokens_per_s=tps, tokens_per_verifier_call=1 / nfe_tok,
             accepted_per_cycle=0.0, alpha=[], nfe=64, nfe_per_token=nfe_tok, lossless=True,
             lossless_check={"lossless": True}, wall_s=1.0)  # fmt: skip
    r.update(kw)
    return r


def _records():
    recs = [_rec("vanilla", "vanilla"), _rec("ar_draft", "ar_draft", tps=150.0, alpha=[0.8, 0.6])]
    for steps, tps in ((100, 120.0), (200, 180.0)):
        recs.append(_rec(f"streak@{steps}", "diffusion_draft", tps=tps, steps=steps, alpha=[0.9, 0.5, 0.2],
                         settings={"method": "streak"}, drafter=f"/ckpt/{steps}"))  # fmt: skip
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
