"""Checking a config: names (`CHOICES`, the registries), numbers (`RANGES`), then the rules that relate fields to each
other; every mistake a one-line `ConfigError` naming the bad value and what is allowed."""

from __future__ import annotations

import functools
import math
import re
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gspo_study.config.schema import (
    _KINDS,
    CHOICES,
    DEVICE,
    DEVICE_TEXT,
    INERT,
    PRESET_OVERRIDES,
    RANGES,
    AlgoConfig,
    Config,
    ModelConfig,
    ServerConfig,
    _field_kind,
    _get,
    objective_hparams,
    to_flat_dict,
)
from gspo_study.errors import ConfigError  # noqa: F401  (defined below config, where tasks import it)


def _normalise(cfg: Config) -> None:
    """A preset override equal to the preset's own value is no override: `model.num_hidden_layers=8` on the
    8-layer preset is the same run (same `run_key`, same cold start) as leaving it unset."""
    if cfg.model.path is None:
        from gspo_study.models import PRESETS

        preset = PRESETS[cfg.model.preset]
        for key in PRESET_OVERRIDES:
            if getattr(cfg.model, key) == preset[key]:
                setattr(cfg.model, key, None)


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
