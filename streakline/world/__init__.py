"""The tiny world the project builds for itself (``model=tiny``, ``model=micro``); see ``world/build.py``.

from streakline.world import attach_world, ensure_world
"""

from .build import ROLES, WORLD_EXPERIMENT, attach_world, ensure_world, world_key
from .report import format_report

__all__ = ["ROLES", "WORLD_EXPERIMENT", "attach_world", "ensure_world", "format_report", "world_key"]
