"""Hydra entry point for every streakline stage; all the work is in ``streakline.cli``.

    python launch.py stage=<stage> model=<preset> [group=option ...] [key=value ...]
    python launch.py --help

The ``streakline`` console script runs the same function.
"""

from streakline.cli import main

if __name__ == "__main__":
    main()
