"""`python -m gspo_study {sft,train,eval,config,sweep,prune,rollout-server,...}`: the command line.

Every user mistake (bad config key or value, missing file, wrong checkpoint) ends with a one-line
message on stderr and exit status 2 — no traceback, nothing half-written.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
import warnings
from pathlib import Path

from gspo_study.config import ConfigError, load_config
from gspo_study.errors import NonFiniteError, SweepInterrupted, Terminated
from gspo_study.models.checkpoint import CheckpointError
from gspo_study.tasks import TaskDataError

USER_ERRORS = (ConfigError, CheckpointError, TaskDataError)


def _files_and_overrides(items: list[str]) -> tuple[list[str], list[str]]:
    """`a.yaml b.yaml x.y=1` → (files, overrides): anything with '=' is an override."""
    return [i for i in items if "=" not in i], [i for i in items if "=" in i]


def _cmd_sft(args) -> None:
    from gspo_study.sft import run_sft

    run_sft(load_config(*_files_and_overrides(args.config)))


def _cmd_train(args) -> None:
    from gspo_study.train.dist import exit_cleanly
    from gspo_study.trainer import train

    with exit_cleanly():
        train(load_config(*_files_and_overrides(args.config)))


def _cmd_config(args) -> None:
    from gspo_study.config import describe_config

    rows = describe_config(*_files_and_overrides(args.config))
    rows = [r for r in rows if r.source != "default"] if args.changed else rows
    if args.json:
        print(json.dumps([r.__dict__ for r in rows], indent=1, default=str))
        return
    for r in rows:
        print(f"{r.key} = {r.value!r}    [{r.source}]")
        print(f"    {r.doc}" + (f" Allowed: {r.allowed}." if r.allowed else ""))


def _cmd_eval(args) -> None:
    from gspo_study.evaluate import evaluate
    from gspo_study.runtime import load_policy, seed_everything
    from gspo_study.tasks import get_task
    from gspo_study.train.checkpointing import RUN_CONFIG

    overrides = list(args.overrides) + ([f"task.name={args.task}"] if args.task else [])
    saved = Path(args.checkpoint or "") / RUN_CONFIG
    if args.config is None and args.checkpoint and saved.is_file():
        args.config = saved  # a run checkpoint: evaluated with its own run's task and settings
    if args.scale:  # the scale's base cold start, trained first if missing (`make coldstart`)
        from gspo_study.study import base_coldstart, scale_base

        args.config = args.config or scale_base(args.scale)
        args.checkpoint = str(base_coldstart(args.scale, tuple(overrides)))
    # --samples / --num-prompts as config overrides, validated like the config's own values
    asked = {"samples": args.samples, "num_prompts": args.num_prompts}
    cfg = load_config(args.config, [*overrides, *(f"eval.{k}={v}" for k, v in asked.items() if v is not None)])
    seed_everything(cfg.seed, cfg.threads)
    model, tokenizer = load_policy(cfg, path=args.checkpoint)
    from gspo_study.train.sizes import check_eval

    check_eval(cfg, model)  # --num-prompts / --samples against what this machine can hold and do
    result = evaluate(
        model,
        tokenizer,
        get_task(cfg.task),
        num_prompts=cfg.eval.num_prompts,
        samples=cfg.eval.samples,
        max_new_tokens=cfg.rollout.max_new_tokens,
        seed=cfg.seed,
        batch_size=cfg.eval.batch_size,
        temperature=cfg.rollout.temperature,
    )
    result["checkpoint"] = args.checkpoint
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.checkpoint}: pass@1 {result['pass@1']:.3f} ± {result['stderr']:.3f} "
            f"({result['n_prompts']} prompts × {result['samples']} samples), greedy {result['greedy']:.3f}"
        )


def _cmd_sweep(args) -> None:
    from gspo_study.study import parse_seeds, run_figure

    seeds = parse_seeds(args.seeds, args.scale, args.figure)
    run_figure(args.figure, args.scale, seeds, tuple(args.overrides), jobs=args.jobs)


def _cmd_calibrate(args) -> None:
    from gspo_study.calibrate import GRID, calibrate, write

    axes = [a for a in args.axes.split(",") if a]
    bad = [a for a in axes if a not in GRID]
    if bad or not axes:
        raise ConfigError(f"bad --axes {args.axes!r}; allowed: a comma list of {', '.join(GRID)}")
    for name, most in (("batches", 64), ("steps", 100)):  # each dose reruns these: minutes, not hours
        value = getattr(args, name)
        if not 1 <= value <= most:
            raise ConfigError(f"bad --{name} {value}; allowed: an integer in [1, {most}]")
    overrides = tuple(args.overrides)
    cfg = load_config(None, [f"scale={args.scale}", *overrides])  # a bad scale or override: one line, before any work
    rows = calibrate(args.scale, tuple(axes), args.batches, args.steps, overrides)
    out = write(rows, Path(args.out) if args.out else cfg.out_dir / "calibration.csv")
    print(f"calibration: {len(rows)} rows in {out}")


def _cmd_prune(args) -> None:
    from gspo_study.models.prune import prune

    plan = prune(
        args.src,
        args.dst,
        layers=args.layers,
        experts=args.experts,
        layer_select=args.layer_select,
        expert_select=args.expert_select,
        top_k=args.top_k,
        calibration=args.calibration,
    )
    print(f"{args.dst}: source layers {plan.layers}, {args.experts} experts per MoE layer, top-{plan.top_k}")


def _cmd_export_study(args) -> None:
    from gspo_study.archive import export_study
    from gspo_study.study import parse_seeds

    figures = [int(f) for f in args.figures.split(",")] if args.figures else None
    seeds = parse_seeds(args.seeds, args.scale) if args.seeds else None  # None: each figure's own
    path, n, missing = export_study(args.scale, seeds, tuple(args.overrides), figures, args.out, args.partial, args.add)
    size = path.stat().st_size / 1e6
    left = f"; {len(missing)} not finished, left out (first: {missing[0]})" if missing else ""
    shown = f"seeds {seeds}" if seeds else "each figure's seeds"
    print(f"{path}: {n} finished runs of scale {args.scale} ({shown}), {size:.2f} MB{left}")


def _cmd_import_study(args) -> None:
    from gspo_study.archive import archive_path, import_study

    figures = [int(f) for f in args.figures.split(",")] if args.figures else None
    path = Path(args.file) if args.file else archive_path(args.scale, tuple(args.overrides))
    if args.if_present and not path.is_file():
        print(f"{path}: no shipped study; nothing to load")
        return
    done, uri = import_study(args.scale, tuple(args.overrides), args.file, figures)
    print(
        f"{args.file or archive_path(args.scale, tuple(args.overrides))} → {uri}: {done.added} runs added, "
        f"{done.present} already there"
        + (f", {done.kept} kept as trained here (same run_key, not the shipped run)" if done.kept else "")
    )


def _cmd_rollout_server(args) -> None:
    """A server of a `vllm_server` pool on this machine, serving the config's cold start (or --checkpoint) as the
    trainer expects it: the command line of `vllm_server.server_argv`, run (or printed). On loopback by default; on
    another address only with the pool's key, vLLM then on loopback behind `pool_key.AuthFront` on that address."""
    import os

    from gspo_study.moe.modes import REPLAY_MODES
    from gspo_study.rollout.pool_key import KEY_ENV, AuthFront, is_loopback, pool_key
    from gspo_study.rollout.vllm_server import (
        ServerProcess,
        _free_port,
        is_cpu_build,
        server_argv,
        server_env,
        write_model_dir,
    )
    from gspo_study.runtime import load_policy

    cfg = load_config(*_files_and_overrides(args.config))
    source = args.checkpoint or cfg.init_checkpoint
    if not source:
        raise ConfigError("rollout-server needs the weights to serve: --checkpoint DIR or init_checkpoint=DIR")
    server, key, fronted = cfg.rollout.server, pool_key(cfg.rollout.server), not is_loopback(args.host)
    if fronted and not key:
        raise ConfigError(
            f"--host {args.host} puts the server on a network, where anyone who reaches it could swap the policy "
            f"(its dev-mode /collective_rpc); allowed: --host 127.0.0.1, or the pool's key in ${KEY_ENV} or "
            "rollout.server.key_file"
        )
    python = server.python or sys.executable
    routing, cpu = REPLAY_MODES[cfg.algo.routing_replay].records_rollout, is_cpu_build(python)
    model_dir = Path(args.model_dir)
    inner = _free_port() if fronted else args.port  # behind the front, vLLM listens on loopback only
    argv = server_argv(python, str(model_dir), inner, cfg.rollout.dtype, server, cpu, routing, "127.0.0.1")
    env = server_env(server, cpu, key)
    if args.print:  # a line a shell runs as it is: the environment first, the key by name only
        shown = [f"{k}=${KEY_ENV}" if k == "VLLM_API_KEY" else f"{k}={v}" for k, v in env.items()]
        print(" ".join([*shown, *argv]))
        if fronted:
            print(f"# and this command's authenticating front on {args.host}:{args.port} -> 127.0.0.1:{inner}")
        return
    model, _ = load_policy(cfg, source)
    write_model_dir(model.named_parameters(), model.config, model_dir)
    if not fronted:
        os.execve(argv[0] if os.path.isabs(argv[0]) else sys.executable, argv, {**os.environ, **env})
    process = ServerProcess(argv, model_dir.parent / "rollout-server.log", {**os.environ, **env})
    try:
        process.wait_ready(f"http://127.0.0.1:{inner}", server.start_timeout_s)
        print(
            f"rollout server ready on {args.host}:{args.port} (vLLM on 127.0.0.1:{inner}, log {process.log_path})",
            flush=True,
        )
        AuthFront(args.host, args.port, ("127.0.0.1", inner), key).serve()
    finally:
        process.stop()


def _cmd_mlflow_urls(args) -> None:
    from gspo_study.mlflow_ui import describe, study_pages

    print(describe(study_pages(args.uri, f"http://127.0.0.1:{args.port}"), args.uri))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gspo_study", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn, text in (
        ("sft", _cmd_sft, "cold-start supervised fine-tuning"),
        ("train", _cmd_train, "RL training"),
    ):
        s = sub.add_parser(name, help=text)
        s.add_argument(
            "config",
            nargs="+",
            help="experiment YAML file(s), layered in order, then key.sub=value overrides",
        )
        s.set_defaults(fn=fn)
    c = sub.add_parser("config", help="every field of the resolved config: value, doc, allowed values, source")
    c.add_argument("config", nargs="*", help="experiment YAML file(s), layered in order, then key.sub=value overrides")
    c.add_argument("--changed", action="store_true", help="only the fields a file or an override set")
    c.add_argument("--json", action="store_true", help="one JSON list of {key, value, doc, allowed, source}")
    c.set_defaults(fn=_cmd_config)
    e = sub.add_parser("eval", help="held-out mean pass@1 of a checkpoint")
    which = e.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", help="local checkpoint directory")
    which.add_argument("--scale", help="the cold start of this scale's base model (trained first if missing)")
    e.add_argument("--task", help="task name (default: the config's)")
    e.add_argument("--samples", type=int, help="samples per prompt K (default: eval.samples)")
    e.add_argument("--num-prompts", type=int, help="held-out prompts (default: eval.num_prompts)")
    e.add_argument("--config", help="experiment YAML for task and generation settings")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    e.set_defaults(fn=_cmd_eval)
    w = sub.add_parser("sweep", help="train every run a figure needs (finished runs are skipped)")
    w.add_argument("--figure", required=True, help="figure number (experiments/figures.yaml)")
    w.add_argument("--scale", default="cpu", help="smoke | cpu | paper")
    w.add_argument("--seeds", help="e.g. 1,2,3 (default: 3 seeds at the CPU scale)")
    w.add_argument("--jobs", type=int, default=1, help="runs trained at once, sharing the `threads` budget")
    w.add_argument("overrides", nargs="*", help="key.sub=value overrides for every run")
    w.set_defaults(fn=_cmd_sweep)
    x = sub.add_parser("export-study", help="a scale's figure runs, to results/<scale>/study-runs.parquet")
    x.add_argument("--scale", default="cpu", help="smoke | cpu | paper")
    x.add_argument("--seeds", help="e.g. 1,2,3 (default: the scale's default seeds)")
    x.add_argument("--figures", help="e.g. 1,3 (default: every figure of experiments/figures.yaml)")
    x.add_argument("--out", help="file to write (default: results/<scale>/study-runs.parquet)")
    x.add_argument("--partial", action="store_true", help="write the finished runs, leave out the others")
    x.add_argument(
        "--add", action="store_true", help="keep the runs the archive already holds that these do not replace"
    )
    x.add_argument("overrides", nargs="*", help="key.sub=value overrides (as for the sweep)")
    x.set_defaults(fn=_cmd_export_study)
    m = sub.add_parser("import-study", help="load an exported study into the MLflow store (idempotent)")
    m.add_argument("--scale", default="cpu", help="smoke | cpu | paper")
    m.add_argument("--file", help="archive to load (default: results/<scale>/study-runs.parquet)")
    m.add_argument("--figures", help="only the runs these figures draw, e.g. 1,13 (default: every run)")
    m.add_argument("--if-present", action="store_true", help="no archive at that path: nothing to load, not an error")
    m.add_argument("overrides", nargs="*", help="key.sub=value overrides (tracking.uri=..., results_dir=...)")
    m.set_defaults(fn=_cmd_import_study)
    u = sub.add_parser("mlflow-urls", help="MLflow UI pages of the study experiments in a store")
    u.add_argument("--uri", required=True, help="MLflow tracking URI of the store")
    u.add_argument("--port", type=int, default=5000, help="port the UI serves on (127.0.0.1)")
    u.set_defaults(fn=_cmd_mlflow_urls)
    v = sub.add_parser("rollout-server", help="a vLLM server for rollout.engine=vllm_server, on this machine")
    v.add_argument("config", nargs="+", help="the run's experiment YAML file(s) and key.sub=value overrides")
    v.add_argument("--checkpoint", help="weights to serve first (default: the config's init_checkpoint)")
    v.add_argument("--model-dir", required=True, help="where to write them for vLLM (storage of this machine)")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (another than loopback: needs the key)")
    v.add_argument("--port", type=int, default=8000, help="port to listen on")
    v.add_argument("--print", action="store_true", help="print the vLLM command line instead of running it")
    v.set_defaults(fn=_cmd_rollout_server)
    k = sub.add_parser("calibrate", help="the routing frontier's doses measured on a cold start (docs/FRONTIER.md)")
    k.add_argument("--scale", default="cpu", help="smoke | cpu | gpu | paper")
    k.add_argument(
        "--axes", default="M,control,V", help="comma list of M, control, V, F, R (the file keeps the other axes' rows)"
    )
    k.add_argument("--batches", type=int, default=4, help="rollout batches per dose (axis M, control)")
    k.add_argument("--steps", type=int, default=4, help="RL steps per dial value (axes V, F, R)")
    k.add_argument("--out", help="CSV to write (default: results/<scale>/calibration.csv)")
    k.add_argument("overrides", nargs="*", help="key.sub=value overrides for every reading")
    k.set_defaults(fn=_cmd_calibrate)
    r = sub.add_parser("prune", help="a local Qwen3-MoE checkpoint cut to N layers and E experts per layer")
    r.add_argument("src", help="local Qwen3-MoE checkpoint directory")
    r.add_argument("dst", help="new directory for the pruned checkpoint")
    r.add_argument("--layers", type=int, required=True, help="decoder layers kept, N")
    r.add_argument("--experts", type=int, required=True, help="experts kept per MoE layer, E")
    r.add_argument("--layer-select", default="first", help="first | spaced | comma list of source layers")
    r.add_argument(
        "--expert-select", help="usage (default with --calibration) | norm (default) | comma list | JSON file"
    )
    r.add_argument("--calibration", help="text file (one sample a line) or .jsonl ('text') for usage counts")
    r.add_argument("--top-k", type=int, help="active experts per token (default: min(source top-k, E))")
    r.set_defaults(fn=_cmd_prune)
    return p


def _error(text: str) -> None:
    """One write per line: ranks of a torchrun job share stderr, which may be unbuffered (print would write the
    text and its newline separately, and two ranks' lines could interleave into one)."""
    sys.stderr.write(f"{text}\n")
    sys.stderr.flush()


# A write that fails part-way: disk full, file too large (RLIMIT_FSIZE), quota, read-only filesystem, I/O error.
WRITE_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EIO}


STORE_FULL = ("database or disk is full", "disk I/O error")  # sqlite's words, through MLflow and SQLAlchemy
FILE_FULL = (
    "No space left on device",
    "File too large",
    "Disk quota exceeded",
)  # e.g. safetensors' own errors


def _write_failure(exc: BaseException) -> str | None:
    """ "store" or "file" when `exc` (or what caused it) is a write that failed for want of space, else None."""
    seen = 0
    while exc is not None and seen < 10:
        text = str(exc)
        if any(m in text for m in STORE_FULL):
            return "store"
        if any(m in text for m in FILE_FULL) or (isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS):
            return "file"
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _one_line_warnings() -> None:
    """The suite's own warnings (a harmless setting the run ignores) as one `warning: …` line on stderr."""
    from gspo_study.config import InertSettingWarning

    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, InertSettingWarning):
            print(f"warning: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _one_line_warnings()
    try:
        args.fn(args)
    except USER_ERRORS as exc:
        _error(f"error: {exc}")
        return 2
    except NonFiniteError as exc:
        _error(f"error: {exc}")
        return 3
    except SweepInterrupted as exc:
        _error(f"error: {exc}")
        return 1
    except OSError as exc:
        if exc.errno not in WRITE_ERRNOS:
            raise
        _error(
            f"error: a write failed ({exc.strerror}: {exc.filename or 'a file'}); what was written before it is "
            "intact (checkpoints and cold starts are replaced atomically): free space and rerun the same command"
        )
        return 4
    except Exception as exc:  # noqa: BLE001 - a full disk under MLflow / SQLAlchemy or a library's writer
        kind = _write_failure(exc)
        if kind is None:
            raise
        if kind == "store":
            _error(
                "error: the MLflow store could not be written (database or disk is full); its committed runs and "
                "steps are intact (sqlite transactions): free space and rerun the same command"
            )
        else:
            _error(
                f"error: a write failed ({str(exc).splitlines()[0][:200]}); what was written before it is intact "
                "(checkpoints and cold starts are replaced atomically): free space and rerun the same command"
            )
        return 4
    except Terminated as exc:
        _error(f"stopped: {exc}")
        return 143  # 128 + SIGTERM, what a scheduler expects of a process it terminated
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    return 0
