"""Config loading: inheritance, overrides, and one-line errors that name the bad key or value."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gspo_study.config import ConfigError, load_config, to_flat_dict


def test_base_inheritance_and_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text("train:\n  lr: 1.0e-4\n  steps: 7\n")
    (tmp_path / "run.yaml").write_text("base: base.yaml\ntrain:\n  steps: 9\nalgo:\n  objective: grpo\n")
    cfg = load_config(tmp_path / "run.yaml", ["algo.routing_replay=r2", "seed=3"])
    assert (cfg.train.lr, cfg.train.steps, cfg.algo.objective, cfg.algo.routing_replay, cfg.seed) == (
        1e-4,
        9,
        "grpo",
        "r2",
        3,
    )
    assert to_flat_dict(cfg)["train.steps"] == 9


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("train.lrr=1", "did you mean 'train.lr'"),
        ("algo.objectiv=gspo", "did you mean 'algo.objective'"),
        ("algo.routing_replay=r4", "'algo.routing_replay'; allowed: none, r2, r3"),
        ("algo.objective=ppo", "allowed: cispo, dppo_kl, dppo_tv, gmpo, grpo, gspo, gspo_token, sapo"),
        ("rollout.group_size=1", "'rollout.group_size'"),
        ("train.num_minibatches=5", "divisor of the rollout batch"),
        ("algo.clip_low=-0.1", "'algo.clip_low'"),
        ("train.lr=abc", "train.lr"),
        ("model.preset=qwen3-huge", "allowed: qwen3-moe-tiny, qwen3-moe-smoke"),
        ("nokey", "key.sub=value"),
        ("train.warmup_steps=-3", "'train.warmup_steps'; allowed: an integer >= 0"),
        ("train.max_nonfinite_updates=0", "'train.max_nonfinite_updates'; allowed: an integer >= 1"),
        ("eval.num_prompts=0", "'eval.num_prompts'; allowed: an integer >= 1"),
        ("eval.batch_size=0", "'eval.batch_size'; allowed: an integer >= 1"),
        ("threads=0", "'threads'; allowed: null (torch's default) or an integer >= 1"),
        ("algo.advantage_eps=-1", "'algo.advantage_eps'; allowed: a number in [0, 1]"),
        ("rollout.group_size=abc", "'rollout.group_size' (Value 'abc'"),
        ("rollout.group_size=abc", "; allowed: an integer"),
        ("rollout.sharded=maybe", "; allowed: true or false"),
        ("train.micro_batch_size=x", "; allowed: null or an integer"),
        ("algo=gspo", "bad value 'gspo' for 'algo'; allowed: a mapping of algo.* keys"),
        ("rollout.vllm_gpu_memory_utilization=0", "allowed: a number in (0, 1]"),
    ],
)
def test_errors_name_key_and_allowed(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config("experiments/smoke/base.yaml", [override])
    msg = str(err.value)
    assert fragment in msg and "\n" not in msg


def test_section_given_a_value_in_file(tmp_path):
    (tmp_path / "bad.yaml").write_text("algo: gspo\n")
    with pytest.raises(ConfigError, match=r"bad value 'gspo' for 'algo'; allowed: a mapping of algo\.\* keys"):
        load_config(["experiments/smoke/base.yaml", tmp_path / "bad.yaml"])


def test_unknown_key_in_file(tmp_path):
    (tmp_path / "bad.yaml").write_text("rollout:\n  group_sise: 4\n")
    with pytest.raises(ConfigError, match="did you mean 'rollout.group_size'"):
        load_config(tmp_path / "bad.yaml")


def test_missing_file_and_cycle(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")


def test_cli_error_is_one_line_exit_2(capsys):
    from gspo_study.cli import main

    assert main(["train", "experiments/smoke/base.yaml", "train.lrr=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "did you mean 'train.lr'" in err and "\n" not in err
    assert main(["eval", "--scale", "bogus"]) == 2  # `make coldstart SCALE=bogus`
    err = capsys.readouterr().err.strip()
    assert err == "error: unknown scale 'bogus'; allowed: cpu, gpu, paper, smoke"


@pytest.mark.parametrize("scale", ["smoke", "cpu", "paper"])
def test_every_experiment_file_loads_on_every_scale(scale):
    from pathlib import Path

    base = Path(f"experiments/{scale}/base.yaml")
    for extra in sorted(Path("experiments/runs").glob("*.yaml")) + sorted(Path("experiments/ablations").glob("*.yaml")):
        cfg = load_config([base, extra])
        assert cfg.scale == scale, extra  # the run file changes switches, never the scale
    assert load_config(Path(f"experiments/{scale}/coldstart.yaml")).scale == scale


def test_later_knobs_at_their_default_keep_run_identity():
    """A knob added after runs were tracked is part of a run's identity only away from its default, and a
    preset override equal to the preset is no override (same run, same cold start)."""
    from gspo_study.config import coldstart_name
    from gspo_study.run import LATER_KNOBS, run_key

    files = ["experiments/cpu/base.yaml", "experiments/runs/gspo.yaml"]
    base = load_config(files)
    assert all(
        run_key(load_config(files, [f"{k}={v}"])) == run_key(base) for k, v in LATER_KNOBS.items() if v is not None
    )
    assert run_key(load_config(files, ["train.router_lr_scale=30"])) != run_key(base)
    # evaluation draws its samples chunk by chunk from one stream: another eval batch size is another run
    assert run_key(load_config(files, ["eval.batch_size=64"])) != run_key(base)
    eight = load_config(files, ["model.num_hidden_layers=8"])  # the tiny preset's own depth
    unset = dataclasses.replace(eight, model=dataclasses.replace(eight.model, num_hidden_layers=None))
    assert run_key(eight) == run_key(unset) and coldstart_name(eight) == coldstart_name(unset) == "coldstart"
    assert coldstart_name(base) == "coldstart-L16" and run_key(eight) != run_key(base)


def _with_default(schema: type, dotted: str, value) -> type:
    """A copy of the config dataclass `schema` whose field `dotted` defaults to `value`, every rule kept."""
    import typing

    head, _, rest = dotted.partition(".")
    hints = typing.get_type_hints(schema)
    specs = []
    for f in dataclasses.fields(schema):
        kind, default, factory = hints[f.name], f.default, f.default_factory
        if f.name == head and rest:
            kind = factory = _with_default(kind, rest, value)
        elif f.name == head:
            default = value
        specs.append((f.name, kind, dataclasses.field(default=default, default_factory=factory, metadata=f.metadata)))
    return dataclasses.make_dataclass(schema.__name__, specs)


@pytest.mark.parametrize(
    "dotted, value, keeps_key",
    [
        ("algo.rollout_correction_cap", 4.0, True),  # "later": left out of the key at whatever its default is
        ("train.checkpoint_every", 5, True),  # "never": not a number the run computes
        ("train.lr", 1e-5, False),  # "identity": a default run is another run (the pinned keys catch it)
    ],
)
def test_a_changed_default_moves_the_identity_tables_with_it(monkeypatch, dotted, value, keeps_key):
    """A field's rules are stated once, on the field: change a default in a copy of the schema and `LATER_KNOBS`
    takes the new default (no second place to edit), the other tables stay, and a run at the new defaults keeps
    or changes its key as the field's identity role says."""
    from gspo_study import run
    from gspo_study.config import Config, declared, inert, ranges

    moved = _with_default(Config, dotted, value)
    section, leaf = dotted.split(".")
    old = getattr(getattr(Config(), section), leaf)
    assert getattr(getattr(moved(), section), leaf) == value != old
    later, was = run.later_knobs(moved), run.later_knobs(Config)
    if dotted in was:  # a later knob's entry is its default, now the new one
        assert (was[dotted], later[dotted]) == (old, value)
    assert {k: v for k, v in later.items() if k != dotted} == {k: v for k, v in was.items() if k != dotted}
    assert run.non_identity(moved) == run.non_identity(Config) and ranges(moved) == ranges(Config)
    assert [(k, needs) for k, _, needs, *_ in inert(moved)] == [(k, needs) for k, _, needs, *_ in inert(Config)]
    assert [d.rules for d in declared(moved)] == [d.rules for d in declared(Config)]
    before = run.run_key(Config())
    monkeypatch.setattr(run, "LATER_KNOBS", later)
    monkeypatch.setattr(run, "NON_IDENTITY", run.non_identity(moved))
    if dotted in was:  # the old default is now a setting like any other: another run
        at_old = moved()
        setattr(getattr(at_old, section), leaf, old)
        assert run.run_key(at_old) != before
    assert (run.run_key(moved()) == before) is keeps_key


def test_bit_identical_kernels_share_run_identity():
    from gspo_study.run import run_key

    files = ["experiments/cpu/base.yaml", "experiments/runs/gspo.yaml"]
    key = {
        impl: run_key(load_config(files, [f"model.experts_implementation={impl}"]))
        for impl in ("grouped_mm_index", "grouped_mm", "eager")
    }
    assert key["grouped_mm_index"] == key["grouped_mm"] == run_key(load_config(files)) != key["eager"]


def test_cold_start_of_a_cell_at_the_preset_depth_on_a_deeper_base():
    """The CPU base is 16 layers on the 8-layer preset: figure 8's 8-layer cells start from the 8-layer cold
    start (`coldstart`), and the overrides the sweep trains it with must say 8 layers, not fall back to the
    cold-start recipe's base depth (they did: the sweep then stopped on a missing checkpoint)."""
    from gspo_study.config import coldstart_name
    from gspo_study.study import EXPERIMENTS, coldstart_overrides, run_config

    eight = run_config("cpu", "gspo", 1, ("model.num_hidden_layers=8",))
    sft = load_config(EXPERIMENTS / "cpu" / "coldstart.yaml", list(coldstart_overrides(eight)))
    assert coldstart_name(sft) == coldstart_name(eight) == "coldstart"
    deep = run_config("cpu", "gspo", 1)
    sft = load_config(EXPERIMENTS / "cpu" / "coldstart.yaml", list(coldstart_overrides(deep)))
    assert coldstart_name(sft) == coldstart_name(deep) == "coldstart-L16"


# ------------------------------------------------------------------ the listing: `python -m gspo_study config`
def test_every_field_has_a_doc_and_allowed_values():
    from gspo_study.config import allowed, field_docs

    flat = to_flat_dict(load_config("experiments/smoke/base.yaml"))
    docs = field_docs()
    assert set(flat) <= set(docs)
    assert [k for k in flat if len(docs[k]) < 10] == []
    assert [k for k in flat if not allowed(k)] == []


@pytest.mark.parametrize("key", sorted(__import__("gspo_study.config", fromlist=["RANGES"]).RANGES))
def test_a_value_outside_each_range_is_refused_with_the_listed_words(key):
    """The allowed values `config` lists are the words of the field's own one-line error, for every range."""
    from gspo_study.config import RANGES, allowed

    rule = RANGES[key]
    bad = (rule.low - (0 if rule.open_low else 1)) if rule.low is not None else rule.high + 1
    extra = ["rollout.engine=vllm_server"] if key.startswith("rollout.server.") else []
    extra += ["rollout.engine=vllm"] if key == "rollout.vllm_gpu_memory_utilization" else []
    extra += ["task.name=math_file", "task.path=x.jsonl"] if key == "task.num_eval" else []
    bad = int(bad) if "an integer" in allowed(key) else bad
    with pytest.raises(ConfigError) as err:
        load_config("experiments/smoke/base.yaml", [*extra, f"{key}={bad}"])
    assert f"for '{key}'; allowed: {allowed(key)}" in str(err.value)


def test_listing_names_the_layer_that_set_each_field(tmp_path, capsys):
    from gspo_study.cli import main
    from gspo_study.config import describe_config

    files = ["experiments/smoke/base.yaml", "experiments/runs/grpo_r2.yaml"]
    rows = {r.key: r for r in describe_config(files, ["train.lr=1e-4"])}
    assert rows["algo.routing_replay"].source == "experiments/runs/grpo_r2.yaml"
    assert rows["train.lr"].source == "override 'train.lr=1e-4'" and rows["train.lr"].value == 1e-4
    assert rows["rollout.group_size"].source == "experiments/smoke/base.yaml"
    assert rows["algo.icepop_low"].source == "default" and rows["algo.icepop_low"].value == 0.5
    assert rows["algo.objective"].allowed.startswith("cispo, dppo_kl, dppo_tv, gmpo, grpo, gspo")
    assert main(["config", "experiments/smoke/base.yaml", "train.lr=1e-4", "--changed", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {r["key"] for r in listed} >= {"train.lr", "scale"} and "algo.icepop_low" not in {r["key"] for r in listed}
    assert main(["config", "experiments/smoke/base.yaml", "train.lr=-1"]) == 2
    assert "for 'train.lr'; allowed: a number in (0, 1]" in capsys.readouterr().err


def test_a_deeply_nested_file_is_refused_in_under_a_second(tmp_path):
    """200,000 nested lists once ended in a RecursionError traceback: the loader refuses past MAX_YAML_DEPTH while
    composing, before any recursion can run out of stack; 32 levels still load."""
    import time

    from gspo_study.config import MAX_YAML_DEPTH

    deep = tmp_path / "deep.yaml"
    deep.write_text("train: {lr: " + "[" * 200_000 + "]" * 200_000 + "}\n")
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=f"nests deeper than {MAX_YAML_DEPTH} levels .line 1.; allowed: at most"):
        load_config(deep)
    assert time.perf_counter() - start < 1.0
    ok = tmp_path / "ok.yaml"
    ok.write_text("tracking: {experiment: " + "[" * (MAX_YAML_DEPTH - 2) + "]" * (MAX_YAML_DEPTH - 2) + "}\n")
    with pytest.raises(ConfigError, match="tracking.experiment"):  # past the depth bound: an ordinary type error
        load_config(ok)
