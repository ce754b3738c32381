"""The fedsweep PFL benchmark (issue 34, ``docs/benchmark.md``): every method tuned with the same budget on
validation, its chosen setting then run again on fresh seeds.

A benchmark file is a sweep file without ``algorithm:`` and with a ``bench:`` section::

    bench:
      methods: methods.yaml       # the per-method search spaces, one file shared by every benchmark file
      common: {r: 0.25, tau: 10}  # algorithm fields every method gets, never tuned
      final_seeds: [1, 2, 3]      # fresh seeds the chosen settings run on (none of sweep.seeds)
      budgets: [4]                # smaller budgets: each method's best of its first N settings, also re-run

Two sweeps run it, both nested in MLflow under the benchmark's run:

1. ``<name>-tune``: every method's ``sweep.num_samples`` settings, drawn at random from its space, on
   ``sweep.seeds``; each method's settings ranked on the clients' validation parts (``select_on: validation``;
   the test metrics choose nothing);
2. ``<name>-final``: each method's setting chosen with the whole budget (and with each smaller one) on
   ``final_seeds``.

A method's space has no grid (each method gets exactly ``num_samples`` settings) and at least one
distribution. Its draws come from its space and ``sweep.search_seed`` alone (a random search of that one
method), not from its place in the file: adding a method changes no other method's settings, and only the
methods without results run (``--methods`` picks some). The drawn settings are then one grid sweep, so the
trials of every method share the cluster without one Tune run per method. The search is random, not Optuna's:
its settings do not depend on the order concurrent trials finish in, so a cell run again from a clean clone
draws the same settings and gives the same numbers. No scheduler stops trials early: ASHA ranks the trials of
one sweep against each other, so one method's trials would be stopped for another's accuracy.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import pandas as pd
from pydantic import Field, ValidationError

from fedsweep.algorithms import ALGORITHMS
from fedsweep.checks import check_before_start
from fedsweep.config import KEY_OMITS_AT_DEFAULT, ConfigError, Seed, Sweep, Trial, without_new_defaults
from fedsweep.conv_kernels import CONV_HELP, CONV_VAR, NATIVE
from fedsweep.loading import _alias_of, _format_errors, _short, _where, flatten_grids, read_yaml, sweep_from
from fedsweep.schema import StrictModel
from fedsweep.search import distributions
from fedsweep.table import draw_order
from fedsweep.tracking import ATEN_CAPABILITIES, KERNEL_VARS, STOPPED_EARLY, kernel_settings, names_kernels

STATE = "bench_state.json"
#: MKL's code branches (``MKL_CBWR``; Intel's "Conditional Numerical Reproducibility"): COMPATIBLE is the one branch
#: MKL documents as the same on Intel and AMD CPUs.
MKL_BRANCHES = ("AUTO", "COMPATIBLE", "SSE2", "SSSE3", "SSE4_1", "SSE4_2", "AVX", "AVX2", "AVX512", "AVX512_E1",
                "AVX512_MIC", "AVX512_MIC_E1")
#: The metrics of a benchmark table: the ranked one first, then fairness (10th percentile, worst client), the
#: global model's, the floats moved (in models), a final run's wall time, and the clients held out of training
#: (``unseen_fraction``), scored with the method's own personalization.
BENCH_METRICS = ("personalized_accuracy_mean", "personalized_accuracy_p10", "personalized_accuracy_worst", "global_accuracy",
                 "transmissions", "wall_time_s", "unseen_personalized_accuracy_mean")


class BenchSettings(StrictModel):
    methods: str = Field(..., description="The methods file (relative to the benchmark file): `methods: {key: search space}`.")
    common: dict[str, Any] = Field(default_factory=dict, description="Algorithm fields every method gets (r, τ, batch size): never tuned.")
    final_seeds: list[Seed] = Field(..., min_length=2, description="Fresh seeds each chosen setting runs on; none of sweep.seeds.")
    budgets: list[int] = Field(default_factory=list, description="Smaller budgets (< sweep.num_samples), each its own table.")
    kernels: dict[str, str] = Field(default_factory=dict, description=(
        "The CPU kernels the cell's runs are computed with (ATEN_CPU_CAPABILITY, MKL's / oneDNN's variables, and "
        "FEDSWEEP_CONV: native for convolutions without oneDNN): "
        "`fedsweep bench` starts its Ray workers with them, and a run computed without them is not the cell's."))


@dataclass
class Bench:
    """A benchmark file, read and validated: each method's random search (``tunes``: its draws, checked as
    `fedsweep sweep` checks them, never run as such), from which the tuning and final sweeps are composed."""

    path: str
    name: str
    settings: BenchSettings
    body: dict[str, Any]  # the file without bench:, sweep: and algorithm: — every method's data, model, rounds
    sweep_section: dict[str, Any]
    methods: dict[str, dict[str, Any]]  # key -> the method's algorithm section (common fields in it)
    tunes: dict[str, Sweep]
    only: list[str] | None = None  # --methods: the methods this run tunes and re-runs (None: every method of the file)
    in_file: list[str] = dataclasses.field(default_factory=list)  # every method of the methods file, --methods or not

    @property
    def first(self) -> Sweep:
        """The first method's search: its sweep settings and its first trial's config hold what every method shares
        (data, model, rounds, tracking, resources)."""
        return next(iter(self.tunes.values()))

    @property
    def budgets(self) -> list[int]:
        """The full budget first, then the smaller ones."""
        return [self.first.settings.num_samples, *self.settings.budgets]

    @cached_property
    def sections(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Method -> setting key (``fedsweep.setting``) -> its algorithm section, exactly, in the order drawn (the
        fields added at their default left out, as from the key: the composed sweeps' text, which a resume matches,
        stays the same when such a field is added)."""
        return {key: {t.config.setting_key(): without_new_defaults("algorithm", t.config.algorithm.model_dump(mode="json"))
                      for t in sweep.trials} for key, sweep in self.tunes.items()}

    def owner(self) -> dict[str, str]:
        """Setting key -> the method that drew it."""
        return {setting: key for key, by_setting in self.sections.items() for setting in by_setting}

    def drawn(self, key: str) -> list[dict[str, Any]]:
        """Method ``key``'s settings in the order drawn: their algorithm sections."""
        return list(self.sections[key].values())

    def tuned(self, key: str) -> list[tuple[str, str]]:
        """The fields method ``key`` draws: (the name written in its space, its name in the algorithm's schema)."""
        from fedsweep.algorithms import ALGORITHMS
        from fedsweep.loading import _alias_of

        params = ALGORITHMS[self.methods[key]["name"]].Params
        return [(str(path[0]), _alias_of(params, path[0]) or str(path[0])) for path, _ in distributions(self.methods[key])]

    def label(self, key: str, setting: str) -> str:
        """The drawn values of a setting of method ``key``, in the shared symbols: what tells its settings apart."""
        from fedsweep.tracking import in_vocabulary

        section = self.section(key, setting)
        # a field left out of the section at its default (config.without_new_defaults) is labelled with that default
        values = [(written, section.get(field, KEY_OMITS_AT_DEFAULT.get(("algorithm", field)))) for written, field in self.tuned(key)]
        return in_vocabulary(", ".join(f"{written}={value:.4g}" if isinstance(value, float) else f"{written}={value}"
                                       for written, value in values))

    def section(self, key: str, setting: str) -> dict[str, Any]:
        """The algorithm section of method ``key``'s drawn setting ``setting``."""
        return self.sections[key][setting]

    def phase(self, phase: str, sections: list[dict[str, Any]], seeds: list[int]) -> Sweep:
        """The grid sweep of a phase: these algorithm sections, each on every seed."""
        section = {k: v for k, v in self.sweep_section.items() if k not in ("search", "num_samples", "search_seed")}
        section.update(name=f"{self.name}-{phase}", seeds=seeds)
        raw = {**self.body, "algorithm": {"grid": sections} if len(sections) > 1 else sections[0], "sweep": section}
        sweep = _sweep(raw, f"{self.path} [{phase} sweep]")
        owner = self.owner()

        def named(t: Trial) -> Trial:  # by its method and drawn values, not the whole section its grid point is
            key, drawn = owner[t.config.setting_key()], t.config.algorithm.model_dump(mode="json")
            return replace(t, overrides={"method": key, **{f"algorithm.{written}": drawn[field] for written, field in self.tuned(key)},
                                         "seed": t.config.seed})

        return replace(sweep, trials=[named(t) for t in sweep.trials])

    def tune_sweep(self, keys: list[str]) -> Sweep:
        return self.phase("tune", [s for key in keys for s in self.drawn(key)], self.sweep_section["seeds"])

    def final_sections(self, chosen: dict[str, dict[str, str | None]]) -> dict[str, dict[str, Any]]:
        """The settings each method chose at any budget (method -> budget -> setting) -> their algorithm sections:
        what their final phase runs."""
        return {s: self.section(k, s) for k, by_budget in chosen.items() for s in by_budget.values() if s is not None}

    def final_sweep(self, sections: list[dict[str, Any]]) -> Sweep:
        return self.phase("final", sections, self.settings.final_seeds)


def _sweep(raw: dict[str, Any], label: str) -> Sweep:
    import yaml

    # the composed file's text is what its resume is matched on (sweep.yaml_sha1): the same inputs, the same text
    return sweep_from(raw, yaml.safe_dump(raw, sort_keys=False), {}, label, check_cluster=False)


def load_bench(path: str | Path, check_cluster: bool = True, only: list[str] | None = None) -> Bench:
    """Read and check a benchmark file and its methods file; every problem named, before any cluster work."""
    raw, _, lines = read_yaml(path)
    file = str(path)
    problems: list[str] = []
    section = raw.get("bench")
    settings = None
    if not isinstance(section, dict):
        problems.append(f"{_where(file, lines, ('bench',))}: bench: a benchmark file needs a bench section "
                        f"(methods, final_seeds; common, budgets), got {_short(section)}")
    else:
        try:
            settings = BenchSettings.model_validate(section, strict=True)
        except ValidationError as err:
            problems += _format_errors(err, section, file, lines, BenchSettings, ("bench",))
    if "algorithm" in raw:
        problems.append(f"{_where(file, lines, ('algorithm',))}: algorithm: a benchmark file takes its methods from "
                        "bench.methods; remove this section")
    sweep_section = raw.get("sweep") if isinstance(raw.get("sweep"), dict) else {}
    rules = (("search", lambda v: v == "random", "'random' (its draws do not depend on when concurrent trials finish)"),
             ("select_on", lambda v: v == "validation", "'validation' (the test data chooses nothing)"),
             ("num_samples", lambda v: isinstance(v, int) and v >= 1, "an integer >= 1: every method's budget"),
             ("seeds", lambda v: isinstance(v, list) and len(v) >= 1, "a list of the tuning seeds"),
             ("scheduler", lambda v: v is None, "none (ASHA would stop one method's trials for another's accuracy)"))
    for key, ok, allowed in rules:
        if not ok(sweep_section.get(key)):
            problems.append(f"{_where(file, lines, ('sweep', key))}: sweep.{key}: {_short(sweep_section.get(key))} in a "
                            f"benchmark file; allowed: {allowed}")
    methods: dict[str, dict] = {}
    in_file: list[str] = []
    if settings is not None:
        budget = sweep_section.get("num_samples")
        if isinstance(budget, int) and any(not 1 <= b < budget for b in settings.budgets):
            problems.append(f"{_where(file, lines, ('bench', 'budgets'))}: bench.budgets: {settings.budgets}; allowed: "
                            f"integers from 1 to sweep.num_samples - 1 ({budget - 1})")
        if overlap := sorted(set(settings.final_seeds) & set(sweep_section.get("seeds") or [])):
            problems.append(f"{_where(file, lines, ('bench', 'final_seeds'))}: bench.final_seeds: {overlap} also tune "
                            "(sweep.seeds); allowed: fresh seeds, none of sweep.seeds")
        for var, value in settings.kernels.items():
            where = f"{_where(file, lines, ('bench', 'kernels', var))}: bench.kernels.{var}"
            if var not in KERNEL_VARS:
                problems.append(f"{where}: not a variable that chooses CPU kernels; allowed: {', '.join(KERNEL_VARS)}")
            elif var == "ATEN_CPU_CAPABILITY" and value not in ATEN_CAPABILITIES:
                problems.append(f"{where}: {_short(value)}; allowed: {', '.join(ATEN_CAPABILITIES)} (PyTorch ignores any other)")
            elif var == CONV_VAR and value != NATIVE:
                problems.append(f"{where}: {_short(value)}; allowed: {CONV_HELP}")
            elif var == "MKL_CBWR":
                if value.removesuffix(",STRICT") not in MKL_BRANCHES:
                    problems.append(f"{where}: {_short(value)}; allowed: {', '.join(MKL_BRANCHES)}, each optionally followed by ',STRICT'")
            elif var != "ATEN_CPU_CAPABILITY" and not re.fullmatch(r"[A-Za-z0-9_]+", value):
                problems.append(f"{where}: {_short(value)}; allowed: a value as the variable takes it (letters, digits and "
                                "'_'), e.g. AVX2")
        methods = _methods(Path(file).parent / settings.methods, settings.common, problems)
        in_file = list(methods)
        if only:
            if unknown := [m for m in only if m not in methods]:
                problems.append(f"--methods: {', '.join(unknown)} not in {settings.methods}; allowed: {', '.join(methods)}")
            methods = {k: v for k, v in methods.items() if k in only}
    if problems:
        raise ConfigError(problems)
    assert settings is not None
    body = {k: v for k, v in raw.items() if k not in ("bench", "sweep")}
    bench = Bench(file, str(sweep_section.get("name", Path(file).stem)), settings, body, sweep_section, methods, {}, only, in_file)
    for key, algorithm in methods.items():
        try:
            # a random search of this method alone: its draws, checked as `fedsweep sweep` checks them
            raw_one = {**body, "algorithm": algorithm, "sweep": {**sweep_section, "name": f"{bench.name}-{key}"}}
            bench.tunes[key] = _sweep(raw_one, f"{file} [method {key} from {settings.methods}]")
        except ConfigError as e:
            problems += e.problems
    seen: dict[str, str] = {}
    for key, by_setting in bench.sections.items():
        if (distinct := len(by_setting)) < sweep_section["num_samples"]:  # a small space draws a setting again
            problems.append(f"{settings.methods}: methods.{key}: its space gave {distinct} distinct setting(s) in "
                            f"{sweep_section['num_samples']} draws, so its budget would be smaller than the others'; allowed: "
                            "a space with more settings than sweep.num_samples (e.g. a continuous distribution)")
        if other := next((seen[s] for s in by_setting if seen.setdefault(s, key) != key), None):
            problems.append(f"{file}: methods {other} and {key} of {settings.methods} draw the same setting; allowed: "
                            "methods whose spaces differ")
    if problems:
        raise ConfigError(problems)
    if check_cluster:
        check_before_start([t.config for s in bench.tunes.values() for t in s.trials], file, bench.first.settings.storage_path)
    return bench


def _methods(path: Path, common: dict[str, Any], problems: list[str]) -> dict[str, dict[str, Any]]:
    """The methods file's spaces, each with the common fields; the equal-budget rules checked."""
    try:
        raw, _, lines = read_yaml(path)
    except ConfigError as e:
        problems += e.problems
        return {}
    file = str(path)
    spaces = raw.get("methods")
    if not isinstance(spaces, dict) or not spaces:
        problems.append(f"{_where(file, lines, ('methods',))}: methods: a mapping of method keys to search spaces, "
                        f"got {_short(spaces)}")
        return {}
    out = {}
    for key, space in spaces.items():
        at = ("methods", key)
        where = f"{_where(file, lines, at)}: methods.{key}"
        if not isinstance(space, dict) or "name" not in space:
            problems.append(f"{where}: a method's search space is a mapping with the algorithm's name, got {_short(space)}")
            continue
        for field, _ in flatten_grids(space):
            problems.append(f"{_where(file, lines, at + tuple(field.split('.')))}: methods.{key}.{field}: a grid gives this "
                            "method more settings than the others; allowed: a distribution, e.g. {choice: [values]}")
        if not distributions(space):
            problems.append(f"{where}: no distribution, so its budget of settings would be one setting run again; "
                            "allowed: at least one field as {loguniform|uniform|randint|choice: ...}")
        params = getattr(ALGORITHMS.get(space["name"]), "Params", None)  # an unknown name: reported when the trials are read
        field = {k: _alias_of(params, k) or k for k in (*space, *common)}  # tau and local_steps are one field
        if both := sorted(k for k in space if field[k] in {field[c] for c in common}):
            problems.append(f"{where}: {', '.join(both)} also in bench.common (as "
                            f"{', '.join(c for c in common if field[c] in {field[k] for k in both})}), which every method "
                            "gets; allowed: leave them to bench.common")
        out[str(key)] = {**space, **common}
    return out


def use_kernels(benches: list[Bench]) -> dict[str, str]:
    """The CPU kernels this command's runs are computed with (``bench.kernels``), put in this process's environment
    before it starts Ray, whose local workers inherit it; returned. Refused, naming the field, before Ray or MLflow:
    files that declare other kernels in one command; a variable set here to another value, or one that chooses
    kernels and that the files leave out (it would change the numbers too); kernels this CPU does not have (PyTorch
    would fall back to others); and workers this process does not start (a joined cluster, or Ray already running
    in it) while the variables are not set here: those keep the environment they started with (a job submitted with
    them in its runtime environment has them here too; a cluster's nodes started without them give runs that
    :func:`with_kernels` leaves out)."""
    kernels, first = benches[0].settings.kernels, benches[0].path
    problems = [f"{b.path}: bench.kernels: {b.settings.kernels or 'none'}, {first}'s {kernels or 'none'}; "
                "allowed: files with the same kernels in one command (others in a command of their own)"
                for b in benches[1:] if b.settings.kernels != kernels]
    if problems:
        raise ConfigError(problems)
    if not kernels:
        return {}
    problems += [f"{first}: bench.kernels.{var}: {value}, but ${var} is {os.environ[var]} in this environment; "
                 f"allowed: {var}={value}, or unset (this command sets it)"
                 for var, value in kernels.items() if os.environ.get(var, value) != value]
    problems += [f"{first}: bench.kernels: ${var} is {os.environ[var]} in this environment and the file leaves it out; "
                 f"allowed: unset it, or declare it (bench.kernels.{var})" for var in KERNEL_VARS
                 if var not in kernels and os.environ.get(var)]
    unset = {var: value for var, value in kernels.items() if var not in os.environ}
    joined = sorted({a for b in benches for s in b.tunes.values() if (a := s.trials[0].config.resources.address())})
    if unset and (joined or _ray_running()):
        workers = f"a joined cluster's ({', '.join(joined)})" if joined else "the Ray instance already running in this process"
        problems.append(f"{first}: bench.kernels: {workers} workers keep the environment they started with, and "
                        f"{', '.join(unset)} is not set here; allowed: start them with {kernel_settings(kernels)} and set "
                        "it here too (or in the job's runtime environment), or run the cell on a Ray instance of its own")
    if not problems and "ATEN_CPU_CAPABILITY" in kernels and (got := _capability({**os.environ, **unset})) != kernels["ATEN_CPU_CAPABILITY"]:
        problems.append(f"{first}: bench.kernels.ATEN_CPU_CAPABILITY: {kernels['ATEN_CPU_CAPABILITY']}, but this CPU runs "
                        f"{got} with it (PyTorch falls back to the kernels the CPU has); allowed: a capability of this CPU, "
                        "or another machine")
    if problems:
        raise ConfigError(problems)
    os.environ.update(unset)
    return kernels


def _capability(env: dict[str, str]) -> str:
    """The kernels PyTorch dispatches to in a process of environment ``env`` (a child: this one may have chosen)."""
    import subprocess

    code = "import torch; print(torch.backends.cpu.get_cpu_capability().lower())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=True).stdout.strip()


def _ray_running() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


def with_kernels(bench: Bench, runs: pd.DataFrame) -> pd.DataFrame:
    """The runs among ``runs`` computed with the file's ``bench.kernels`` (their platform names them,
    :func:`fedsweep.tracking.run_platform`): a cell's runs. The others are said and left out, so that the phase
    owes them (it runs again)."""
    kernels = bench.settings.kernels
    if not kernels or runs.empty:
        return runs
    platforms = runs["platform"].fillna("")
    ok = platforms.map(lambda platform: names_kernels(platform, kernels)).astype(bool)
    if not ok.all():
        print(f"[bench {bench.name}] {int((~ok).sum())} run(s) computed without bench.kernels "
              f"({kernel_settings(kernels)}), on "
              f"{'; '.join(sorted(p or 'no platform recorded' for p in set(platforms[~ok])))}: "
              "not the cell's, so owed again (a joined cluster's workers keep the environment their nodes started with)",
              file=sys.stderr)
    return runs[ok]


# --------------------------------------------------------------------------- selection


def choose(runs: pd.DataFrame, metric: str, mode: str, budget: int) -> str | None:
    """The setting (``fedsweep.setting``) a method's tuning runs choose with a budget of its first ``budget``
    settings (trial order): the best mean over its seeds of ``val_<metric>``, among the settings all of whose
    seeds finished. A tie goes to the setting drawn first. Only the validation column and the run outcomes are
    read: never a test metric."""
    ranked = "val_" + metric
    tried = runs[["setting", "trial", "outcome", ranked]]
    first = draw_order(tried)[:budget]
    tried = tried[tried["setting"].isin(first)]
    eligible = tried[~tried["setting"].isin(tried.loc[tried["outcome"] != "finished", "setting"])]
    if eligible.empty:
        return None
    means = eligible.groupby("setting")[ranked].mean()
    means = means.loc[[s for s in first if s in means.index]]
    return str(means.idxmax() if mode == "max" else means.idxmin())  # the first of equal values: the earliest draw


def missing_runs(runs: pd.DataFrame, settings: list[str], seeds: list[int]) -> int:
    """How many of the runs a phase owes (each of ``settings`` on each of ``seeds``) are not among ``runs`` (the
    phase's finished or diverged runs): a sweep stopped before its end (Ctrl-C, a lost driver) returns without
    errors, and a choice among the runs it has would not be the budget's. A run marked stopped_early counts as
    missing: a benchmark has no scheduler, so only an interruption ended it (before fedsweep ended those KILLED)."""
    ran = runs[runs["outcome"] != STOPPED_EARLY] if len(runs) else runs
    have = set(zip(ran["setting"], ran["seed"].astype(int))) if len(ran) else set()
    return sum((s, int(seed)) not in have for s in settings for seed in seeds)


def chosen_settings(bench: Bench, runs: pd.DataFrame, keys: list[str]) -> dict[str, dict[int, str | None]]:
    """Method -> budget -> the setting that budget chooses, from the tuning sweep's runs."""
    settings = bench.first.settings
    method = runs["setting"].map(bench.owner())
    return {key: {b: choose(runs[method == key], settings.metric, settings.mode, b) for b in bench.budgets} for key in keys}


# --------------------------------------------------------------------------- tables


def bench_table(final: pd.DataFrame, chosen: dict[str, dict[int, str | None]], tried: dict[str, int], budget: int,
                metric: str, mode: str, labels: dict[str, str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The table of one budget, and the runs behind it (labelled by method key): from the ``final`` runs, each
    method's chosen setting on the final seeds, mean ± 95% CI of the test metrics, rows by the test metric's
    mean (that order is what the table shows; nothing was chosen by it). ``tried``: the settings each method's
    tuning ran; ``labels``: setting key -> its drawn values."""
    from fedsweep.table import best_settings

    rows = []
    for key, by_budget in chosen.items():
        if by_budget.get(budget) is None:
            continue
        mine = final[final["setting"] == by_budget[budget]].copy()
        mine["algorithm"] = key
        mine["setting_label"] = labels[by_budget[budget]]
        rows.append(mine)
    if not rows:
        return pd.DataFrame(), pd.DataFrame()
    runs = pd.concat(rows, ignore_index=True)
    # one setting per method here: best_settings' "best" is the chosen one; its mean ± CI over the final seeds
    table = best_settings(runs, metric, mode, (), "test", reported=BENCH_METRICS)
    table["settings tried"] = [min(budget, tried[key]) for key in table["algorithm"]]  # in the tuning, not here
    table = table.sort_values(f"{metric} mean", ascending=mode != "max", kind="stable").reset_index(drop=True)
    table.attrs.update(select_on="validation", ranked_by="val_" + metric, metric=metric, budget=budget)
    return table, runs


def compact_markdown(tables: dict[int, pd.DataFrame], metric: str) -> str:
    """The cell's table for docs/benchmark.md: each method's row at the full budget (its drawn values, the
    metric, its 10th percentile and worst client, the global model's, transmissions, the unseen clients' score
    when some were held out), beside the metric and the rank its smaller-budget choices got. Percent, mean ± 95%
    CI; "—" where a method has no global model."""
    from fedsweep.table import _pm, md

    budgets = sorted(tables, reverse=True)
    full = tables[budgets[0]]
    unseen = f"{BENCH_METRICS[-1]} mean" in full.columns
    head = ["rank", "method", f"chosen setting (budget {budgets[0]})", "personalized (%)", "10th pct. (%)", "worst client (%)",
            "global model (%)", "transmissions"] + (["unseen clients (%)"] if unseen else []) + [
            x for b in budgets[1:] for x in (f"budget {b}: personalized (%)", "rank")]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    smaller = {b: tables[b].set_index("algorithm") for b in budgets[1:]}
    ranks = {b: t[f"{metric} mean"].rank(ascending=tables[b].attrs.get("mode", "max") != "max", method="min")
             for b, t in smaller.items()}
    for i, r in full.iterrows():
        cells = [str(i + 1), md(r["algorithm"]), md(r["best setting"])]
        # a column is missing when no method of the table has the metric (no global model among them): "—"
        cells += [_pm(r.get(f"{m} mean", float("nan")), r.get(f"{m} ci95", float("nan")), True)
                  for m in (metric, *BENCH_METRICS[1:4])]
        cells.append(f"{r['transmissions mean']:.0f}")
        cells += [_pm(r[f"{BENCH_METRICS[-1]} mean"], r[f"{BENCH_METRICS[-1]} ci95"], True)] if unseen else []
        for b in budgets[1:]:
            if r["algorithm"] not in smaller[b].index:  # its choice at b has no row (a final seed diverged): said below that table
                cells += ["—", "—"]
                continue
            row = smaller[b].loc[r["algorithm"]]
            cells += [_pm(row[f"{metric} mean"], row[f"{metric} ci95"], True), str(int(ranks[b][r["algorithm"]]))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def read_state(folder: Path) -> dict[str, Any]:
    path = folder / STATE
    return json.loads(path.read_text()) if path.exists() else {}


def write_state(folder: Path, state: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (STATE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
    tmp.replace(folder / STATE)

