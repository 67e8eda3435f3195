"""Sampling backends for bulk generation (``stage=trajectories``): one interface, identical output schema.

- ``native``: the project's decoder (``speculative.generate`` with no drafter), batched with a KV cache; runs
  anywhere, CPU included. The default.
- ``vllm``: vLLM's engine on the same checkpoint folder; only when vLLM is installed and a GPU is present (a clear
  error otherwise). Its samples follow the same distribution but not the same random stream as ``native``.

    backend = BACKENDS["native"](verifier, settings)      # settings: SampleSettings
    rows = backend.sample(prompts, seed=1234)             # one dict per prompt, see Sample

Each sample: ``completion_ids`` (eos included when produced), ``finish_reason`` ("eos" | "length" | "stop") and,
when ``settings.topk_logprobs`` > 0, ``topk_ids`` / ``topk_logprobs`` per completion token: the verifier's top-k
log-softmax at temperature 1 (the teacher distribution DistillSpec-style losses read).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from streakline.errors import UserError

from .speculative import SpecConfig, generate


class BackendError(UserError, RuntimeError):
    """A sampling backend this machine cannot run; the message names the alternative."""


def check_backend(name: str) -> None:
    """Raise BackendError when backend ``name`` cannot run here (cheap: nothing is loaded), so a stage refuses it
    before any work."""
    import importlib.util

    import torch

    if name != "vllm":
        return
    if importlib.util.find_spec("vllm") is None:
        raise BackendError(
            "data.backend=vllm needs vLLM (`pip install vllm` on a GPU machine); use data.backend=native"
        )
    if not torch.cuda.is_available():
        raise BackendError("data.backend=vllm needs a GPU; none is visible here. Use data.backend=native")


@dataclass(kw_only=True)
class SampleSettings:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    topk_logprobs: int = 0
    batch_size: int = 16
    eos_token_id: int | list[int] | None = None
    stop_strings: tuple[str, ...] = ()


@dataclass
class Sample:
    completion_ids: list[int]
    finish_reason: str
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class NativeBackend:
    """Batches of ``settings.batch_size`` prompts through the vanilla decoder; batch i uses seed ``seed + i``."""

    name = "native"

    def __init__(self, verifier, settings: SampleSettings, tokenizer=None) -> None:
        self.verifier, self.settings, self.tokenizer = verifier, settings, tokenizer

    def sample(self, prompts: list[list[int]], seed: int, on_batch=None) -> list[Sample]:
        """One sample per prompt (repeat a prompt for several samples). ``on_batch(samples)`` after each batch."""
        s = self.settings
        out: list[Sample] = []
        for i, start in enumerate(range(0, len(prompts), s.batch_size)):
            cfg = SpecConfig(
                max_new_tokens=s.max_new_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                eos_token_id=s.eos_token_id,
                stop_strings=s.stop_strings,
                seed=seed + i,
                topk_logprobs=s.topk_logprobs,
            )
            res = generate(self.verifier, prompts[start : start + s.batch_size], cfg, tokenizer=self.tokenizer)
            batch = [
                Sample(
                    completion_ids=res.tokens[j],
                    finish_reason=res.finish_reasons[j],
                    topk_ids=res.topk_ids[j] if res.topk_ids is not None else None,
                    topk_logprobs=res.topk_logprobs[j] if res.topk_logprobs is not None else None,
                )
                for j in range(len(res.tokens))
            ]
            out.extend(batch)
            if on_batch is not None:
                on_batch(batch)
        return out


class VllmBackend:
    """vLLM's engine over the verifier's checkpoint folder (GPU only)."""

    name = "vllm"

    def __init__(
        self,
        checkpoint: str,
        settings: SampleSettings,
        tokenizer=None,
        *,
        tokenizer_folder: str | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        check_backend(self.name)
        import vllm

        self.vllm, self.settings = vllm, settings
        self.llm = vllm.LLM(
            model=checkpoint, tokenizer=tokenizer_folder or checkpoint, seed=0, enable_prefix_caching=True,
            tensor_parallel_size=tensor_parallel_size,
        )  # fmt: skip

    def sample(self, prompts: list[list[int]], seed: int, on_batch=None) -> list[Sample]:
        s = self.settings
        stop_ids = s.eos_token_id if isinstance(s.eos_token_id, list | tuple) else [s.eos_token_id]
        params = self.vllm.SamplingParams(
            n=1,
            temperature=s.temperature,
            top_p=s.top_p,
            max_tokens=s.max_new_tokens,
            seed=seed,
            logprobs=s.topk_logprobs or None,
            stop=list(s.stop_strings) or None,
            stop_token_ids=[i for i in stop_ids if i is not None],
            include_stop_str_in_output=True,
        )
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        out = []
        for o in outputs:
            c = o.outputs[0]
            reason = {"stop": "eos", "length": "length"}.get(c.finish_reason, c.finish_reason)
            if c.finish_reason == "stop" and isinstance(c.stop_reason, str):
                reason = "stop"
            ids = lps = None
            if s.topk_logprobs and c.logprobs is not None:
                # vLLM's logprobs are of the sampling distribution's raw logits (before temperature) by default
                ranked = [sorted(step.items(), key=lambda kv: -kv[1].logprob)[: s.topk_logprobs] for step in c.logprobs]
                ids = [[t for t, _ in step] for step in ranked]
                lps = [[lp.logprob for _, lp in step] for step in ranked]
            out.append(Sample(list(c.token_ids), reason, ids, lps))
        if on_batch is not None:
            on_batch(out)
        return out


BACKENDS = {"native": NativeBackend, "vllm": VllmBackend}
