"""streakline: align drafters with verifiers for speculative decoding, and measure the speedup.

Packages (imports flow one way, top to bottom):
    pipelines/   one module per stage, ``run(cfg)``; only ``streakline.cli`` imports it
    alignment/   losses, windows, trainer, SPOT data/training, Spiffy calibration
    evaluation/  benchmark runner, tables, figures
    decoding/    the speculative decoder and its kernels
    models/      the transformer core, KV cache, checkpoint import/export, tokenizers
    data/, launch/, config/, artifacts   ground level: import none of the layers above

Run ``python launch.py --help`` or see README.md.
"""

__version__ = "0.1.0"
