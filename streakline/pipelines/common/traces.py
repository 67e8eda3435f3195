"""The settings stage=spot and stage=spiffy share: both decode prompts with a draft-free rule of the target into
traces, so both judge the same trace settings the same way (``check_trace_settings``, called by their ``check``).
"""

from __future__ import annotations

from typing import Any

from streakline.config import ConfigError
from streakline.decoding.registry import BLOCK


def check_trace_settings(s: Any, counts: tuple[str, ...], top_k_why: str) -> None:
    """ConfigError for trace settings in ``s`` (a stage's ``cfg.stage``) the draft-free decoder cannot run with:
    ``rule``, ``prompt_sources``, ``temperature``, ``threshold``, ``top_k`` (``top_k_why`` says what needs 2), and
    the stage's own ``counts`` that must be at least 1."""
    if s.rule not in BLOCK:
        raise ConfigError(f"stage.rule={s.rule} is not a draft-free rule; valid: {', '.join(BLOCK)}")
    if not s.prompt_sources:
        raise ConfigError("stage.prompt_sources is empty; name at least one benchmark (e.g. tiny-math-train)")
    for name in counts:
        if s[name] < 1:
            raise ConfigError(f"stage.{name} must be >= 1, got {s[name]}")
    if s.top_k < 2:
        raise ConfigError(f"stage.top_k must be >= 2 ({top_k_why}), got {s.top_k}")
    if s.temperature < 0:
        raise ConfigError(f"stage.temperature must be >= 0, got {s.temperature}")
    if not 0.0 < s.threshold <= 1.0:
        raise ConfigError(f"stage.threshold must be in (0, 1], got {s.threshold}")
