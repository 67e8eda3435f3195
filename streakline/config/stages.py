"""The stages' own settings (``cfg.stage``): one dataclass per stage that has settings, bound by
``conf/stage/<name>.yaml`` (``defaults: [/schema/stage/<name>@_here_]``), and ``STAGE_SCHEMAS``, which the root
schema (``schema.py``, where everything else in the config lives) registers in Hydra's ConfigStore. The allowed
values named in comments (``SCALING_METRICS``, ``DECODERS``, ...) are ``schema.py``'s tuples.

Run ``python launch.py stage=<name> --cfg job`` to see one stage's settings with their values (docs/config.md).
"""

from dataclasses import dataclass, field

from omegaconf import MISSING


@dataclass
class StageConfig:
    """``cfg.stage``: which stage runs, and (for the stages that have any) that stage's own settings.

    A stage with settings has a subclass below (:data:`STAGE_SCHEMAS`); ``conf/stage/<name>.yaml`` binds it, so
    ``stage=spot`` composes ``cfg.stage`` as a :class:`SpotStage` and ``stage.steps=2000`` sets one of them.
    """

    name: str = MISSING  # STAGES


@dataclass
class SpotStage(StageConfig):
    """stage=spot: collect draft-free traces of the target and train the order model (docs/algorithms.md section 8)."""

    prompt_sources: list[str] = field(default_factory=lambda: ["tiny-math-train", "tiny-code-train"])
    prompts: int = 128  # prompts decoded for traces (split evenly over prompt_sources)
    heldout_fraction: float = 0.2  # of the traces (by prompt) kept for next-commit accuracy
    max_new_tokens: int = 64
    rule: str = "static"  # the draft-free decoder whose commit order is learnt
    temperature: float = 0.0  # traces' sampling temperature (coupled noise when > 0)
    threshold: float = 0.9  # the threshold rule's confidence tau (rule=threshold only)
    top_k: int = 32  # stale probabilities kept per position
    horizon: int = 8  # H: depths d < H replayed per step
    batch_size: int = 8  # prompts per decoding batch
    num_shards: int = 4
    # the order model (about 0.6M parameters at the defaults)
    d_model: int = 128
    layers: int = 3
    heads: int = 8
    ffn: int = 512
    max_block: int = 64  # learned position embedding size: the largest block size the model can serve
    steps: int = 1200
    train_batch: int = 128  # examples per optimizer step
    lr: float = 1.0e-3
    seed: int = 0


@dataclass
class EvalMethodConfig:
    """One row of the evaluation: a decoder with its drafter and settings (None = the ``decoder`` group's value)."""

    name: str = MISSING  # label in results and figures
    decoder: str = MISSING  # DECODERS
    drafter: str | None = None  # checkpoint folder; None: the model preset's drafter (the world's base drafter)
    steps: int | None = None  # distillation steps of that checkpoint (Fig. 7's x axis); None: not a distilled one
    K: int | None = None
    gamma: int | None = None
    drafter_temperature: float | None = None
    argmax_chain: bool | None = None  # None: decoder.argmax_chain
    rule: str | None = None  # spot / spiffy: the draft-free rule they reproduce
    budget: int | None = None
    prune: int | None = None
    prefix_mass_floor: float | None = None
    artifact: str | None = None
    grid: bool = False  # a point of the Fig. 5 K x drafter-temperature grid
    distill_loss: str | None = None  # the loss the drafter was distilled with: Fig. 7 draws one line per loss
    temperature: float | None = None  # evaluate at this verifier temperature only; None: every stage.temperatures
    curve: bool = False  # an intermediate checkpoint: a Fig. 7 point only (left out of Table 2 and Fig. 2)


@dataclass
class EvaluateStage(StageConfig):
    """stage=evaluate: methods x benchmarks x verifier temperatures, with identical prompts and stop rules."""

    benchmarks: list[str] = field(default_factory=lambda: ["tiny-math", "tiny-code"])
    prompts: int = 10  # per benchmark
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    max_new_tokens: int = 64
    batch_size: int = 1
    # Empty: discovered (vanilla, ngram, ar_draft, the base diffusion drafter, every complete distill run of this
    # experiment, and the block-diffusion decoders whose artifacts exist).
    methods: list[EvalMethodConfig] = field(default_factory=list)
    # Fig. 5: diffusion_draft on the best distilled drafter (or the base one) over K x drafter temperature.
    k_grid: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    drafter_temperature_grid: list[float] = field(default_factory=lambda: [0.1, 1.0, 1.5, 2.0])
    grid_temperature: float = 0.0  # verifier temperature of the Fig. 5 grid
    ngram: bool = True  # add the training-free prompt-lookup row (decoder=ngram) every trained drafter must beat
    # add the undistilled drafters: the preset's (base, ar_draft, dflash:base) and the weights a kind's runs started
    # from, the step 0 of the Fig. 7 lines; off, only what training made is decoded (make demo's budget)
    base: bool = True
    # also decode each distilled DFlash drafter with decoder=dflash_lookup (prompt lookup where it matches, the
    # drafter elsewhere), as dflash_lookup:<loss>
    lookup: bool = False
    block: bool = True  # add static / threshold / spiffy / spot rows when their artifacts exist
    threads: int = 1  # torch threads per evaluation process (wall-clock numbers on a shared machine)
    # an untimed decode of each method's first prompt for this many new tokens before its timed runs, so that first-
    # call costs (oneDNN primitives, allocator growth, graph capture) fall on no row; at most max_new_tokens // 4
    # (0: none; evaluation/suite.py)
    warmup_tokens: int = 8
    # the methods take turns prompt batch by prompt batch, so a slow spell of a shared machine falls on all of them
    # alike; false: each method decodes all its prompts before the next (in-process runs; evaluation/suite.py)
    interleave: bool = True
    figures: bool = True
    # a benchmark where one token id is more than this share of the reference's greedy output is degenerate and
    # kept out of the headline table and the figures (docs/evaluation.md); 1.0 keeps every benchmark in
    degenerate_share: float = 0.5


@dataclass
class SpiffyStage(StageConfig):
    """stage=spiffy: calibrate the draft graph from draft-free traces (docs/algorithms.md section 9)."""

    prompt_sources: list[str] = field(default_factory=lambda: ["tiny-math-train", "tiny-code-train"])
    prompts: int = 50  # the paper's 25 MATH500 + 25 MBPP
    max_new_tokens: int = 64
    rule: str = "static"
    temperature: float = 0.0
    threshold: float = 0.9  # the threshold rule's confidence tau (rule=threshold only)
    top_k: int = 32  # token ranks j beyond this are not representable
    horizon: int = 8  # H: realised future states counted per step
    budget: int = 10  # D: graph nodes besides the root
    batch_size: int = 8
    seed: int = 0


@dataclass
class SweepStage(StageConfig):
    """stage=sweep (experiment=nightly_fig7): evaluate every checkpoint of the experiment's distill runs."""

    # distill runs to train (or continue) first, each "method=<name> [overrides]"; empty: evaluate what exists
    train: list[str] = field(default_factory=list)
    temperature: float = 0.0  # verifier temperature of the Fig. 7 points
    history: str | None = None  # JSONL of every evaluated point; None: <run_root>/<experiment>/sweep/history.jsonl


@dataclass
class PlanStage(StageConfig):
    """stage=plan: memory per GPU, disk and time of every stage on ``cluster``, at the presets' real shapes
    (``streakline/planning/``, docs/planning.md). What a config does not say (how long prompts are, how many
    prompts the sources hold, how efficient the kernels are) is assumed here, and printed with the plan."""

    # the stages planned, in this order; empty: trajectories, distill, evaluate, spot, spiffy, sweep
    stages: list[str] = field(default_factory=list)
    prompt_tokens: int = 256  # mean prompt length, tokens (trajectories, distill windows, evaluate)
    prompts: int = 10000  # trajectories prompts when data.max_prompts is null (the sources' size is not read)
    mfu: float = 0.4  # model FLOPs utilisation of training and prefill
    # a distill run folder or its metrics.jsonl: the median MFU its telemetry logged replaces stage.mfu
    mfu_from: str | None = None
    bandwidth_efficiency: float = 0.7  # share of HBM bandwidth a decode step reaches (bench/gpu_decode.py)
    usable_memory: float = 0.9  # share of gpu_memory_gib a stage may plan for (CUDA context, allocator slack)
    eval_methods: int = 3  # evaluate rows when stage.methods is empty (vanilla, base drafter, a distilled one)


@dataclass
class ScalingArm:
    """One drafter recipe of a data-scaling study (``stage.arms``): its losses, sizes and overrides; its lines are
    labelled ``<name>:<loss>``."""

    name: str = MISSING
    methods: list[str] = field(default_factory=list)
    every: int = 1  # runs every k-th of the stage's token_sizes, the smallest and the largest always
    # a method each run starts from: a run of it on the same subset first (e.g. mdm: the cut adapted to masked
    # diffusion), then the run itself with trainer.init_from='distill:method=<adapt>'
    adapt: str | None = None
    run_overrides: list[str] = field(default_factory=list)  # given to each of its runs (after the stage's own)


@dataclass
class ScalingStage(StageConfig):
    """stage=scaling (experiment=scaling): distill throughput against world size, and the held-out accepted streak
    against training tokens per loss, with a power-law fit each (docs/scaling.md)."""

    # throughput: one distill run per world size, the same global batch split evenly over its ranks; [] skips it
    world_sizes: list[int] = field(default_factory=lambda: [1, 2, 4])
    # torchrun: start each missing run's ranks on this machine (gloo on CPU, NCCL on its GPUs); external: start
    # nothing, write the srun commands that make the missing runs and stop until they exist (a Slurm cluster)
    launch: str = "torchrun"  # SCALING_LAUNCHES
    ranks_per_node: int | None = None  # external: ranks per node in the srun commands; None: every rank on one node
    threads_per_rank: int = 1  # OMP_NUM_THREADS of each rank started here
    global_batch: int = 32  # examples per optimizer step of a throughput run (micro batch = global_batch / world size)
    throughput_steps: int = 30
    throughput_method: str = "ce_streak"
    zero_stage: int = 2
    # acceptance: one distill run per method and data size, trainer.max_steps long, with the held-out check every
    # trainer.eval_every steps (each check is a point: its label tokens seen and its mean accepted streak)
    methods: list[str] = field(default_factory=lambda: ["ce_streak", "distillspec"])
    data_sizes: list[int] = field(default_factory=lambda: [32, 64, 128])  # data.max_prompts of each trajectory set
    metric: str = "decoder_streak"  # SCALING_METRICS: the held-out value fitted (eval/<source>/<metric>)
    # Data scaling instead (non-empty: replaces data_sizes): one trajectory set (data.max_prompts), read by each run
    # as a nested subset of this many completion tokens (trainer.train_tokens); one point per run, its best check
    token_sizes: list[int] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)  # token_sizes: more seeds at the smallest and the largest size
    run_overrides: list[str] = field(default_factory=list)  # given to every acceptance run, e.g. model.drafter=...
    # token_sizes: recipes side by side in one report (e.g. a DFlash drafter and a standalone cut), each with its own
    # losses, sizes and overrides; empty: one recipe of methods and run_overrides
    arms: list[ScalingArm] = field(default_factory=list)
    # token_sizes: also decode held-out prompts with each seed-0 run's drafter, beside vanilla and ngram, through
    # stage=evaluate (settings.evaluate: benchmarks, prompts, temperatures): the wall-clock speedup of every point
    evaluate: bool = False
    # token_sizes: points of earlier sittings (each a scaling.json, or a file of its shape: "metric" and "acceptance"),
    # read into this report's table, fits and figures where this study has no run of the same line, size and seed;
    # a study spanning machines whose run folders did not travel keeps its curve (docs/scaling.md)
    prior: list[str] = field(default_factory=list)
    # token_sizes: a JSON file of prior's shape that gathers the study: read first like a prior file (a missing one is
    # started), then given this study's measured points, each replacing the file's point of the same line, size and
    # seed; commit it and every sitting on any machine adds to one curve (docs/scaling.md)
    ledger: str | None = None


# The settings dataclass of each stage that has settings (the others' ``cfg.stage`` is a plain StageConfig).
STAGE_SCHEMAS: dict[str, type[StageConfig]] = {
    "spot": SpotStage,
    "spiffy": SpiffyStage,
    "evaluate": EvaluateStage,
    "sweep": SweepStage,
    "plan": PlanStage,
    "scaling": ScalingStage,
}
