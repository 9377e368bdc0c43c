"""Where to look in MLflow's UI (3.17): the pages of each study experiment in a store, as URLs (`make mlflow-ui`).

MLflow's UI opens every experiment in its GenAI mode (traces, judges, prompts; runs under "Evaluations") unless
the URL says `workflowType=machine_learning`; the experiment tag `mlflow.experimentKind` alone does not switch
it, but the suite sets it too (`tracking.TRAINING_EXPERIMENT`). Metric charts are the runs page with
`compareRunsMode=CHART` (`#/experiments/<id>/chart` is a 404). Training runs carry a `run_key` tag and analysis
runs (`figure-N`, `report`, whose artifacts are the drawn figures) an `analysis_key` tag, so each page is
given a saved filter (`searchFilter`) that shows one kind: the runs table and the charts show the training
runs only, a third page the figure and report runs. Each figure gets a page of its own runs: `make mlflow-ui` tags
every training run with the figures that use it (`figures` = `,1,3,`, from experiments/figures.yaml at each
figure's seeds), and the page filters on it.

The charts page lays out one chart per metric, sections in name order (`compute/`, `correction/`, `eval/`, …), so
with the CPU study's ~100 metrics held-out pass@1 is below the first screen. A fourth page lands on it: MLflow's
shared view (an experiment tag `mlflow.sharedViewState.<key>` holding a view's JSON, opened with
`viewStateShareKey=<key>`) with the charts' search box set to `eval/pass_at_1`; clearing the box shows every chart.
"""

from __future__ import annotations

import json
from urllib.parse import quote, urlencode

from gspo_study.errors import ConfigError
from gspo_study.tracking import STORES_ALLOWED, TRAINING_EXPERIMENT, _retry, checked_client

TRAINING_RUNS = "tags.run_key LIKE '%'"
ANALYSIS_RUNS = "tags.analysis_key LIKE '%'"
MODE = {"workflowType": "machine_learning"}
PASS_AT_1_VIEW = "pass-at-1"  # the share key of the held-out pass@1 charts view
PASS_AT_1_STATE = json.dumps({"searchFilter": TRAINING_RUNS, "chartsSearchFilter": "eval/pass_at_1"})


def page(base: str, exp_id: str, search: str, charts: bool = False, view: str | None = None) -> str:
    """The runs page of an experiment, filtered by `search`, in model-training mode (charts if asked; the shared
    view `view` if given, which then sets the filter)."""
    chosen = {"viewStateShareKey": view} if view else {"searchFilter": search}
    query = {**chosen, **({"compareRunsMode": "CHART"} if charts else {}), **MODE}
    return f"{base.rstrip('/')}/#/experiments/{exp_id}/runs?{urlencode(query, quote_via=quote)}"


def figure_filter(figure: int) -> str:
    return f"tags.figures LIKE '%,{figure},%'"


def tag_figures(client, exp_id: str, scale: str) -> list[int]:
    """Tag every training run of the experiment with the figures of `scale` that use it (`figures` = `,1,3,`),
    matched by run identity (its `run_key` tag: what a figure's config computes, whatever the run's name says — two
    figures' cells sharing a base name, `grpo-nr-s3`, are told apart); returns the figures that have a run here."""
    from gspo_study.run import run_key
    from gspo_study.study import figure_configs, figures, parse_seeds

    uses: dict[str, set[int]] = {}
    for name in figures():
        n = int(name.removeprefix("figure-"))
        for _, cfg in figure_configs(n, scale, parse_seeds(None, scale, n)):
            uses.setdefault(run_key(cfg), set()).add(n)
    found = set()
    for run in client.search_runs([exp_id], TRAINING_RUNS, max_results=50_000):
        mine = sorted(uses.get(run.data.tags.get("run_key", ""), ()))
        found.update(mine)
        value = "," + ",".join(map(str, mine)) + ","
        if mine and run.data.tags.get("figures") != value:
            _retry(client.set_tag, run.info.run_id, "figures", value)
    return sorted(found)


def study_pages(uri: str, base: str) -> list[dict[str, str]]:
    """For every experiment of the store at `uri` that holds training runs (a `run_key` tag): its name, id and
    page URLs (runs, charts, pass@1 charts, figures). Each is also tagged as a training experiment, and given the
    pass@1 shared view, if it is not yet."""
    client = checked_client(uri)
    try:
        experiments = client.search_experiments(order_by=["name ASC"])
    except Exception as exc:  # noqa: BLE001 - mlflow raises many types for a bad store
        raise ConfigError(
            f"MLflow tracking URI {uri!r} is not usable ({type(exc).__name__}); allowed: {STORES_ALLOWED}"
        ) from None
    out = []
    for exp in experiments:
        if not client.search_runs([exp.experiment_id], TRAINING_RUNS, max_results=1):
            continue
        views = {f"mlflow.sharedViewState.{PASS_AT_1_VIEW}": PASS_AT_1_STATE}
        for key, value in {**TRAINING_EXPERIMENT, **views}.items():
            if exp.tags.get(key) != value:
                _retry(client.set_experiment_tag, exp.experiment_id, key, value)
        out.append(
            {
                "experiment": exp.name,
                "id": exp.experiment_id,
                "runs": page(base, exp.experiment_id, TRAINING_RUNS),
                "charts": page(base, exp.experiment_id, TRAINING_RUNS, charts=True),
                "pass_at_1": page(base, exp.experiment_id, TRAINING_RUNS, charts=True, view=PASS_AT_1_VIEW),
                "figures": page(base, exp.experiment_id, ANALYSIS_RUNS),
                **{f"figure {n}": page(base, exp.experiment_id, figure_filter(n)) for n in _figures_of(client, exp)},
            }
        )
    return out


def _figures_of(client, exp) -> list[int]:
    """The figures with runs in a study experiment (`study-<scale>`), after tagging its runs with them."""
    from gspo_study.study import DEFAULT_SEEDS

    scale = exp.name.removeprefix("study-")
    return tag_figures(client, exp.experiment_id, scale) if scale in DEFAULT_SEEDS else []


def describe(pages: list[dict[str, str]], uri: str) -> str:
    """What `make mlflow-ui` prints before it starts the server."""
    if not pages:
        return (
            f"no study runs in {uri} yet: train some (make reproduce-figure-1) or load the shipped ones "
            "(make import-study SCALE=cpu)"
        )
    lines = [f"MLflow store {uri}; open these once the server below is up:"]
    for p in pages:
        lines += [
            f"  {p['experiment']} (experiment {p['id']})",
            f"    runs table:          {p['runs']}",
            f"    metric charts:       {p['charts']}",
            f"    held-out pass@1:     {p['pass_at_1']}",
            f"    figure/report runs:  {p['figures']}",
            *(f"    {k + ' runs:':<21}{v}" for k, v in p.items() if k.startswith("figure ")),
        ]
    return "\n".join(lines)
