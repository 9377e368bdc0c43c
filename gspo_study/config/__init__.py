"""Typed configuration: dataclasses are the schema (`schema`), YAML files carry only what differs from their base
(`loading`), and every config is checked before anything is built from it (`validation`).

A YAML file may name a base with `base: other.yaml` (a path relative to the file); the chain is merged
onto the dataclass defaults with OmegaConf, then `key.sub=value` overrides from the command line.
Every mistake becomes a `ConfigError` whose one-line message names the bad key or value and what is
allowed; an unknown key suggests the closest valid one.

A field is its own documentation: its docstring (the string literal under it) and its rules (`knob`: the range or
names it allows, when it takes part in a run, its part in the run's identity) sit beside it, and every table the
suite reads is derived from them (`RANGES`, `CHOICES`, `INERT`; `run.LATER_KNOBS`, `run.NON_IDENTITY`).
This package's names are the configuration's interface; its modules hold each job once.
"""

from gspo_study.config.loading import (
    MAX_YAML_DEPTH,
    MAX_YAML_VALUES,
    FieldRow,
    allowed,
    describe_config,
    field_docs,
    load_config,
    read_yaml_file,
    yaml_values,
)
from gspo_study.config.schema import (
    CHOICES,
    DEVICE,
    DEVICE_TEXT,
    IDENTITY_ROLES,
    INERT,
    PRESET_OVERRIDES,
    RANGES,
    AlgoConfig,
    Config,
    Declared,
    EvalConfig,
    ModelConfig,
    Range,
    RolloutConfig,
    Rules,
    ServerConfig,
    SFTConfig,
    TaskConfig,
    TelemetryConfig,
    TrackingConfig,
    TrainConfig,
    _get,
    choices,
    coldstart_name,
    coldstart_overrides,
    declared,
    inert,
    knob,
    objective_hparams,
    ranges,
    to_flat_dict,
)
from gspo_study.config.validation import InertSettingWarning, registries, validate
from gspo_study.errors import ConfigError

__all__ = [
    "CHOICES",
    "DEVICE",
    "DEVICE_TEXT",
    "IDENTITY_ROLES",
    "INERT",
    "MAX_YAML_DEPTH",
    "MAX_YAML_VALUES",
    "PRESET_OVERRIDES",
    "RANGES",
    "AlgoConfig",
    "Config",
    "ConfigError",
    "Declared",
    "EvalConfig",
    "FieldRow",
    "InertSettingWarning",
    "ModelConfig",
    "Range",
    "RolloutConfig",
    "Rules",
    "SFTConfig",
    "ServerConfig",
    "TaskConfig",
    "TelemetryConfig",
    "TrackingConfig",
    "TrainConfig",
    "_get",
    "allowed",
    "choices",
    "coldstart_name",
    "coldstart_overrides",
    "declared",
    "describe_config",
    "field_docs",
    "inert",
    "knob",
    "load_config",
    "objective_hparams",
    "ranges",
    "read_yaml_file",
    "registries",
    "to_flat_dict",
    "validate",
    "yaml_values",
]
