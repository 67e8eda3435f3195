"""SPOT (docs/algorithms.md section 8): training data from draft-free block traces, and order-model training.

    from streakline.alignment.spot import build_examples, split_by_prompt, train_order_model, SpotTrainConfig

``stage=spot`` (``streakline/pipelines/spot.py``) runs the whole thing; ``streakline.decoding.spot.SpotDrafter``
uses the trained model. docs/spot.md describes the data convention.
"""

from .data import SpotExamples, build_examples, confidence_baseline, heldout_prompts, split_by_prompt
from .train import SpotTrainConfig, evaluate, predict, train_order_model

__all__ = [
    "SpotExamples",
    "SpotTrainConfig",
    "build_examples",
    "confidence_baseline",
    "evaluate",
    "heldout_prompts",
    "predict",
    "split_by_prompt",
    "train_order_model",
]
