"""The one base class of every mistake a user can fix: a bad setting, a missing or mismatched checkpoint, an
unreadable data file, an artifact made for another model.

Each kind keeps its own type where it is raised (``ConfigError`` in ``config/``, ``CheckpointError`` in ``models/``,
``BenchmarkError`` in ``data/``, ...), and every such type derives from :class:`UserError`. The command line catches
``UserError`` alone and prints its message as one line with exit status 2; anything else is a bug in streakline and
keeps its traceback. ``STREAKLINE_DEBUG=1`` (or the override ``debug=true``) shows the traceback of a ``UserError``
too, for when the message is not enough.

    class ShardError(UserError, ValueError): ...   # a new kind: also a ValueError, so existing handlers still match
"""

import os

DEBUG_ENV = "STREAKLINE_DEBUG"


class UserError(Exception):
    """Input the user can fix; the message names the thing at fault and the fix, on one line."""


def debugging() -> bool:
    """True when the user asked for full tracebacks (``STREAKLINE_DEBUG`` set to anything but ``""`` or ``0``)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")
