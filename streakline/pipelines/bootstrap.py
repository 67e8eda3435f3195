"""Stage ``bootstrap``: build the tiny world (tokenizer, verifier, diffusion drafter, block-diffusion target).

    python launch.py stage=bootstrap                 # model=tiny: 14-15 minutes cold on 2 cores, 3 s when cached
    python launch.py stage=bootstrap model=micro     # the same code path in seconds (tests)

On a GPU (``common.roles.device()``) the world trains there; on the CPU its weights are what they always were.

The recipe and its cache live in ``streakline/world/`` (every stage attaches the world through the runner, so this
stage only builds it on purpose and prints its sanity report). The world is keyed by the model preset and the
standard-library fingerprint, shared by every experiment, and checked against its file checksums on every use.
"""

from __future__ import annotations

from omegaconf import DictConfig

from streakline.artifacts import read_manifest
from streakline.config import check_world
from streakline.world import ensure_world, format_report

from .common.roles import device
from .runner import Stage, StageResult


class Bootstrap(Stage):
    name = "bootstrap"
    settings = ("model.world",)
    needs_world = False  # building it is the whole recipe

    def check(self, cfg: DictConfig) -> None:
        check_world(cfg)

    def run(self, cfg: DictConfig, stage_run: None) -> StageResult:
        folder = ensure_world(cfg, device=device())  # the GPU when there is one; the same data and seeds
        report = read_manifest(folder).metrics["report"]
        return StageResult(self.name, folder=folder, artifact=folder, metrics=report)

    def report(self, result: StageResult) -> None:
        print(format_report(result.metrics, result.folder))


STAGE = Bootstrap()
