"""Spiffy calibration (docs/algorithms.md section 9): draft-free traces in, a ``SpiffyGraph`` of D states out.

    from streakline.alignment.spiffy import calibrate
    graph, stats = calibrate(traces, horizon=8, budget=10, header={"target": "tiny-target", ...})

``stage=spiffy`` (``streakline/pipelines/spiffy.py``) collects the traces and writes the graph; docs/spiffy.md.
"""

from .calibrate import calibrate, count_states, realised_paths, select_nodes

__all__ = ["calibrate", "count_states", "realised_paths", "select_nodes"]
