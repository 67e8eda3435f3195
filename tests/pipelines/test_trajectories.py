"""stage=trajectories on the micro world: resumable shards, Ray fan-out equal to one process, faults survived.

Runs share the session's micro world and differ by ``experiment.name`` (the run folder), never by settings, so every
run must produce the very same rows.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from streakline.config import compose_config
from streakline.data.trajectories import load_trajectories
from streakline.pipelines import run_stage
from streakline.pipelines.trajectories import FAULT_EXIT_AFTER, FAULT_WORKER_EXIT, build_verifier
from streakline.world import attach_world

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = [
    "data.max_prompts=12",
    "data.samples_per_prompt=2",
    "data.max_new_tokens=16",
    "data.num_shards=4",
    "data.batch_size=5",
    "data.topk_logprobs=3",
    "data.temperature=1.0",
]


def _overrides(root, experiment, *extra):
    return ["stage=trajectories", "model=micro", f"run_root={root}", f"experiment.name={experiment}", *SETTINGS, *extra]


def _run(root, experiment, *extra):
    return run_stage(compose_config(_overrides(root, experiment, *extra)))


def _rows(result):
    ds = load_trajectories(result.artifact)
    return [dict(r) for r in ds]


@pytest.fixture(scope="module")
def reference(micro_world):
    root = micro_world[0]
    return root, _run(root, "single")


def test_single_process_run_stores_every_sample_with_teacher_logprobs(reference):
    root, result = reference
    rows = _rows(result)
    assert len(rows) == 24 and result.details["generated_shards"] == [0, 1, 2, 3]
    assert len({(r["prompt_id"], r["sample_index"]) for r in rows}) == 24  # no duplicates, no gaps
    assert {r["finish_reason"] for r in rows} <= {"eos", "length"}
    cfg = attach_world(compose_config(_overrides(root, "single")), progress=False)
    verifier = build_verifier(cfg)  # in the precision the stage sampled in (bf16 on a CPU with native bf16)
    for r in rows[:6]:
        ids = r["prompt_ids"] + r["completion_ids"]
        with torch.no_grad():
            logits = verifier(torch.tensor([ids]))[0, len(r["prompt_ids"]) - 1 : -1].float()
        lp = torch.log_softmax(logits, -1)
        stored = torch.tensor(r["topk_logprobs"], dtype=torch.float32)
        # each stored id carries its verifier log-probability, and they are the top 3 (a whole-row forward and a
        # decode step round differently, so near-ties may swap places in bf16: compared by value, not order)
        torch.testing.assert_close(lp.gather(1, torch.tensor(r["topk_ids"])), stored, atol=3e-2, rtol=1e-2)
        torch.testing.assert_close(lp.topk(3, -1).values, stored, atol=3e-2, rtol=1e-2)
    again = _run(root, "single")  # a rerun finds every shard done and generates nothing
    assert again.details["generated_shards"] == [] and _rows(again) == rows


def test_ray_with_two_workers_and_a_dying_worker_gives_the_same_rows(reference, tmp_path, monkeypatch):
    root, result = reference
    marker = tmp_path / "worker-died"
    monkeypatch.setenv(FAULT_WORKER_EXIT, str(marker))
    ray_result = _run(root, "ray", "launcher=ray", "launcher.workers=2")
    assert marker.exists()  # a worker really died mid-run, after sampling a shard and before writing it
    assert _rows(ray_result) == _rows(result)


def test_killed_stage_resumes_with_only_the_missing_shards(reference):
    root, result = reference
    env = dict(os.environ, **{FAULT_EXIT_AFTER: "2"})
    proc = subprocess.run(
        [sys.executable, "launch.py", *_overrides(root, "killed")], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    folder = Path(str(result.artifact).replace("/single/", "/killed/"))
    assert len(list(folder.glob("shard-*.parquet"))) == 2 and not (folder.parent / "manifest.json").exists()
    resumed = _run(root, "killed")
    assert len(resumed.details["generated_shards"]) == 2
    assert _rows(resumed) == _rows(result)
    manifest = json.loads((folder.parent / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["metrics"]["rows"] == 24


def test_a_damaged_shard_is_reported_and_regenerated(reference, capsys):
    root, result = reference
    _run(root, "damaged")
    folder = Path(str(result.artifact).replace("/single/", "/damaged/"))
    victim = sorted(folder.glob("shard-*.parquet"))[1]
    victim.write_bytes(victim.read_bytes()[:200])
    capsys.readouterr()
    again = _run(root, "damaged")
    assert "shard 1 is corrupt" in capsys.readouterr().out
    assert again.details["generated_shards"] == [1]
    assert _rows(again) == _rows(result)


@pytest.mark.parametrize("mode", ["error", "skip", "truncate"])
def test_a_prompt_past_the_verifiers_positions_is_refused_skipped_or_cut_to_its_end(micro_world, mode):
    from streakline.config import ConfigError
    from streakline.pipelines.trajectories import fit_positions

    root = micro_world[0]
    # the micro verifier has 2048 positions: 2040 new tokens leave room for prompts of 8
    cfg = compose_config(["stage=trajectories", "model=micro", f"run_root={root}", "data.max_new_tokens=2040",
                          f"data.long_prompts={mode}"])  # fmt: skip
    attach_world(cfg, progress=False)
    records = [{"id": "a"}, {"id": "b"}, {"id": "c"}]
    prompts = [list(range(3, 8)), list(range(3, 15)), list(range(3, 11))]  # 5, 12 and 8 tokens
    if mode == "error":
        with pytest.raises(ConfigError, match=r"1 of 3 prompts \(first: b, 12 tokens\).*data.long_prompts=skip"):
            fit_positions(cfg, records, prompts)
        return
    kept, fitted, counts = fit_positions(cfg, records, prompts)
    if mode == "skip":
        assert [r["id"] for r in kept] == ["a", "c"] and fitted == [prompts[0], prompts[2]]
        assert counts == {"skipped_long_prompts": 1}
    else:
        assert kept == records and fitted == [prompts[0], list(range(7, 15)), prompts[2]]
        assert counts == {"truncated_prompts": 1}


def test_conversations_are_sampled_with_every_turn_and_an_evaluation_prompt_is_refused(micro_world, tmp_path):
    from streakline.config import ConfigError
    from streakline.data import load_benchmark
    from streakline.pipelines.common.roles import role_tokenizer

    root = micro_world[0]
    turns = [("Sam has 3 apples.", "He eats one."), ("How many are left?", None)]
    chat = [{"role": r, "content": c} for q, a in turns for r, c in (("user", q), ("assistant", a)) if c]
    held_out = load_benchmark("tiny-math", limit=1)[0]["prompt"]  # a prompt stage=evaluate measures on
    rows = [{"messages": chat}, {"messages": [{"role": "user", "content": "def add(a, b):"}]}]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "leak.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": held_out}]}) + "\n")
    common = ["data.mix_weights=[]", "data.chat_template=true", "data.topk_logprobs=0"]
    result = _run(root, "chats", f"data.prompt_sources=[conversations@{tmp_path / 'chats.jsonl'}]", *common)
    tok = role_tokenizer(attach_world(compose_config(_overrides(root, "chats")), progress=False), "verifier")
    assert tok.chat_template  # the micro tokenizer has one, so both turns of the first chat go through it
    expected = tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"]  # fmt: skip
    assert _rows(result)[0]["prompt_ids"] == expected and len(_rows(result)) == 2 * 2  # 2 prompts x 2 samples
    leak = [f"data.prompt_sources=[conversations@{tmp_path / 'leak.jsonl'}]", *common]
    with pytest.raises(ConfigError, match="1 training prompts .* evaluation set tiny-math.*allow_eval_overlap=true"):
        _run(root, "leak", *leak)
    assert not (root / "leak").exists()  # refused before any folder was made
    assert len(_rows(_run(root, "leak", *leak, "data.allow_eval_overlap=true"))) == 2


def test_a_set_of_fewer_prompts_is_the_first_rows_of_a_larger_one(micro_world):
    # the mix interleaves the sources in one fixed order (data/mix.py) and every row samples from its own seed, so
    # a smaller data.max_prompts, cut into other shards, makes the first rows of the larger set: a data-scaling
    # study builds only the rows its largest size reads. One row a batch here, so that no row's rounding depends on
    # its batch mates (with larger batches a sampled token can flip on float rounding: docs/data.md)
    root = micro_world[0]
    one = ["data.batch_size=1", "data.samples_per_prompt=1", "data.topk_logprobs=0"]
    small = _rows(_run(root, "fewer", "data.max_prompts=4", "data.num_shards=2", *one))
    large = _rows(_run(root, "more", "data.max_prompts=7", "data.num_shards=3", *one))
    assert len(small) == 4 and len(large) == 7 and len({r["prompt_id"].split("/")[0] for r in large[:4]}) == 2
    for a, b in zip(small, large, strict=False):
        assert (a["prompt_id"], a["seed"], a["completion_ids"]) == (b["prompt_id"], b["seed"], b["completion_ids"])
