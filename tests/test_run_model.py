"""The model a run names is the model it trains: a `model.path` gets its own cold start (its name
and fingerprint), never the preset's; `sft.per_seed` gives each seed its own; settings a run ignores are refused."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from gspo_study.config import ConfigError, coldstart_name, load_config
from gspo_study.models import build_char_tokenizer, build_model, save_pretrained
from gspo_study.models.checkpoint import fingerprint
from gspo_study.run import run_key

SMOKE = "experiments/smoke/base.yaml"


def test_a_local_model_path_trains_from_its_own_cold_start(tmp_path):
    from gspo_study.sft import run_sft
    from gspo_study.trainer import train

    tok = build_char_tokenizer()
    local = tmp_path / "my-model"
    save_pretrained(build_model("qwen3-moe-smoke", tok, seed=7), tok, local)
    common = [
        f"results_dir={tmp_path / 'res'}",
        f"tracking.uri=sqlite:///{tmp_path}/m.db",
        "sft.steps=3",
        "train.steps=1",
        "eval.num_prompts=2",
    ]
    run_sft(load_config(SMOKE, common))  # the preset's cold start exists, as after any `make coldstart`
    cfg = load_config(SMOKE, [*common, f"model.path={local}"])
    name = coldstart_name(cfg)
    assert name.startswith("coldstart-my-model-") and name != coldstart_name(load_config(SMOKE, common))
    with pytest.raises(ConfigError, match=f"initial checkpoint not found: .*{name}"):
        train(cfg)  # never the preset's cold start: the run names another model
    out = run_sft(cfg)  # the cold start of the named model
    assert out.name == name
    train(cfg)
    client = MlflowClient(f"sqlite:///{tmp_path}/m.db")
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    (run,) = client.search_runs([exp.experiment_id], f"tags.run_key = '{run_key(cfg)}'")
    assert run.data.tags["init_fingerprint"] == fingerprint(out)


def test_per_seed_cold_starts(tmp_path):
    common = [f"results_dir={tmp_path}", "sft.per_seed=true"]
    one, two = (load_config(SMOKE, [*common, f"seed={s}"]) for s in (1, 2))
    assert coldstart_name(one) == "coldstart" and coldstart_name(two) == "coldstart-s2"
    # seed 1's own cold start is the shared one: the same run as without the knob; other seeds are other runs
    assert run_key(one) == run_key(load_config(SMOKE, [f"results_dir={tmp_path}"]))
    assert run_key(two) != run_key(load_config(SMOKE, [f"results_dir={tmp_path}", "seed=2"]))
    from gspo_study.config import coldstart_overrides

    assert {"sft.per_seed=true", "seed=2"} <= set(coldstart_overrides(two))


# Every INERT entry set where it takes no part: refused, or warned for the harmless ones (tests/ table rows).
INERT_CASES = [
    (
        ["task.path=/x.jsonl"],
        "task.path='/x.jsonl' takes no part in this run (only with task.name=math_file)",
    ),
    (["task.eval_path=/x.jsonl"], "task.eval_path"),
    (["task.prompt_template=Question {prompt}"], "task.prompt_template"),
    (["rollout.server.tensor_parallel_size=2"], "only with rollout.engine=vllm_server"),
    (["rollout.server.urls=[http://127.0.0.1:1]"], "rollout.server.urls"),
    (["rollout.vllm_gpu_memory_utilization=0.9"], "only with rollout.engine=vllm"),
    (["algo.icepop_low=0.4"], "only with algo.rollout_correction=icepop"),
    (["algo.icepop_high=3"], "algo.icepop_high"),
    (["algo.rollout_correction_cap=5"], "algo.rollout_correction_cap"),
    (["algo.rollout_correction=icepop", "algo.rollout_correction_cap=5"], "algo.rollout_correction_cap"),
    (["algo.rollout_correction_geo_cap=1.1"], "only with algo.rollout_correction=geometric_mask"),
    (["train.zero_stage=3"], "only with train.backend=deepspeed"),
    (["sft.check_every=5"], "only with sft.target_pass1 set"),
    (["rollout.engine=vllm", "rollout.router_precision=bfloat16"], "only with rollout.engine=hf"),
    (["rollout.engine=vllm", "rollout.router_noise=0.5"], "rollout.router_noise"),
    (["rollout.engine=vllm_server", "rollout.head_noise=0.5"], "rollout.head_noise"),
    (["train.route_sham=true"], "only with train.route_noise > 0"),
]
WARN_CASES = [
    (
        ["task.name=math_file", "task.path=/x.jsonl", "task.eval_path=/y.jsonl", "task.num_eval=3"],
        "task.num_eval",
    ),
]


@pytest.mark.parametrize("overrides, fragment", INERT_CASES, ids=[" ".join(o) for o, _ in INERT_CASES])
def test_a_setting_the_run_ignores_is_refused(overrides, fragment):
    with pytest.raises(ConfigError, match="takes no part in this run") as err:
        load_config(SMOKE, overrides)
    assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, fragment", WARN_CASES, ids=[" ".join(o) for o, _ in WARN_CASES])
def test_a_harmless_ignored_setting_is_one_warning(overrides, fragment):
    from gspo_study.config import InertSettingWarning

    with pytest.warns(InertSettingWarning, match=fragment):
        load_config(SMOKE, overrides)


def test_the_same_settings_are_accepted_where_they_take_part():
    load_config(SMOKE, ["algo.rollout_correction=icepop", "algo.icepop_low=0.4", "rollout.dtype=bfloat16"])
    load_config(
        SMOKE, ["algo.rollout_correction=sequence_mask", "algo.rollout_correction_cap=5", "rollout.dtype=bfloat16"]
    )
    load_config(SMOKE, ["train.backend=deepspeed", "train.zero_stage=3"])
    load_config(SMOKE, ["sft.target_pass1=0.5", "sft.check_every=5"])
    load_config(SMOKE, ["rollout.engine=vllm_server", "rollout.server.tensor_parallel_size=2"])


def test_every_inert_entry_has_a_case():
    from gspo_study.config import INERT

    covered = " ".join(" ".join([*o, f]) for o, f in INERT_CASES + WARN_CASES)
    for prefix, *_ in INERT:
        assert prefix.rstrip(".") in covered, prefix
