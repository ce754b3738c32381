"""Reading config files: YAML to validated configs, with every problem named by file, line and field.

In a sweep file any value may be replaced by ``{grid: [v1, v2, ...]}``; grids may nest (a grid over
``algorithm`` sections whose own fields are grids), and a random or Optuna search's fields by distributions
(:mod:`fedsweep.search`). :func:`load_sweep` expands the grids, crosses them with ``sweep.seeds`` and
validates every resulting trial config before anything starts; :func:`load_experiment` reads a file of one
experiment. Every problem is reported as a :class:`~fedsweep.config.ConfigError` naming the file, line, field
and the allowed values (pydantic's errors rewritten by :func:`_format_errors`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import numpy as np
from pydantic import BaseModel, TypeAdapter, ValidationError

from fedsweep import config_file, search
from fedsweep.checks import check_before_start, check_resources, raise_problems
from fedsweep.config import SWEEP_WIDE, ConfigError, ExperimentConfig, Seed, Sweep, SweepSettings, Trial
from fedsweep.dotted import dotted, flatten, overrides_label, within
from fedsweep.layout import auto_layout, trial_cpus
from fedsweep.schema import FieldError, names_of


def read_yaml(path: str | Path) -> tuple[dict, str, dict[tuple, int]]:
    """The file's top-level mapping, its text and the line of each key path (:mod:`fedsweep.config_file`)."""
    try:
        return config_file.read(path)
    except config_file.ConfigFileError as e:
        raise ConfigError([str(e)]) from None


# --------------------------------------------------------------------------- grids


def _is_grid(node: Any) -> bool:
    return isinstance(node, dict) and "grid" in node


def _expand(
    node: Any, path: tuple, problems: list[str], locate: Callable[[tuple], str] = lambda path: ""
) -> list[tuple[Any, dict[str, Any]]]:
    """All concrete values of ``node`` with the grid choices (dotted path → value) that produce each.
    ``locate(path)`` prefixes a problem with where it is in the file."""
    if _is_grid(node):
        where = locate(path) + (".".join(map(str, path)) or "<top level>")
        extra = sorted(set(node) - {"grid"})
        if extra:
            problems.append(f"{where}: a grid takes only the key 'grid', found also {extra}")
            return [(None, {})]
        choices = node["grid"]
        if not isinstance(choices, list) or not choices:
            problems.append(f"{where}.grid: must be a non-empty list of values, got {choices!r}")
            return [(None, {})]
        out = []
        for choice in choices:
            for value, sub in _expand(choice, path, problems, locate):
                picked = flatten(value, ".".join(map(str, path)) + ".") if isinstance(value, dict) else {".".join(map(str, path)): value}
                out.append((value, {**picked, **sub}))
        return out
    if isinstance(node, dict):
        keys = list(node)
        options = [_expand(node[k], path + (k,), problems, locate) for k in keys]
        out = []
        for combo in itertools.product(*options):
            value = {k: v for k, (v, _) in zip(keys, combo)}
            overrides: dict[str, Any] = {}
            for _, ov in combo:
                overrides.update(ov)
            out.append((value, overrides))
        return out
    return [(node, {})]


def flatten_grids(node: Any, path: tuple = ()) -> list[tuple[str, Any]]:
    if _is_grid(node):
        return [(".".join(map(str, path)), node)]
    if isinstance(node, dict):
        return [g for k, v in node.items() for g in flatten_grids(v, path + (k,))]
    return []


#: Trials one sweep file may expand to: the grids are crossed (a product) and every point is validated.
MAX_TRIALS = 10_000


def _grid_points(node: Any) -> int:
    """How many configs ``node`` expands to (without expanding it)."""
    if _is_grid(node):
        return sum(_grid_points(c) for c in node["grid"]) if isinstance(node["grid"], list) else 1
    if isinstance(node, dict):
        return math.prod(_grid_points(v) for v in node.values())
    return 1


# --------------------------------------------------------------------------- pydantic's errors, rewritten


def _allowed_keys(model: type[BaseModel] | None) -> list[str]:
    if model is None:
        return []
    return [key for name, info in model.model_fields.items() for key in names_of(name, info)]


def _alias_of(model: type[BaseModel] | None, key: Any) -> str | None:
    """The field that ``key`` is an alias (or the name) of, if any."""
    for name, info in (model.model_fields.items() if model else ()):
        if key in names_of(name, info):
            return name
    return None


def _submodels(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models inside a (possibly Annotated / Union) field annotation."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in get_args(annotation) for m in _submodels(a)]


def _tags(model: type[BaseModel]) -> tuple:
    """The values of a union member's tag field (``name`` or ``dataset``): its Literal's values."""
    for key in ("name", "dataset"):
        if key in model.model_fields:
            return get_args(model.model_fields[key].annotation)
    return ()


def _member(members: list[type[BaseModel]], node: Any) -> type[BaseModel] | None:
    """Which of a field's models validates ``node``: the union member its tag (``name`` or ``dataset``) selects,
    else the field's only model; None when neither says."""
    tag = node.get("name", node.get("dataset")) if isinstance(node, dict) else None
    chosen = [m for m in members if tag is not None and tag in _tags(m)]
    return chosen[0] if chosen else (members[0] if len(members) == 1 else None)


def _model_at(loc: tuple, raw: dict, root: type[BaseModel]) -> type[BaseModel] | None:
    """The pydantic model that validates the mapping at ``loc`` (to list its allowed keys)."""
    model: type[BaseModel] | None = root
    node: Any = raw
    for part in loc:
        field = model.model_fields.get(part) if model else None
        if field is None:
            return None
        node = node.get(part) if isinstance(node, dict) else None
        model = _member(_submodels(field.annotation), node)
    return model


def _without_union_tags(loc: tuple, root: type[BaseModel]) -> tuple:
    """Pydantic puts the selected member's tag after a discriminated-union field in an error's location
    (``algorithm.fedavg.local_lr``); drop exactly those, so the path is the one written in the file."""
    out: list = []
    model: type[BaseModel] | None = root
    i = 0
    while i < len(loc):
        part = loc[i]
        out.append(part)
        field = model.model_fields.get(part) if model is not None and isinstance(part, str) else None
        candidates = _submodels(field.annotation) if field is not None else []
        model = candidates[0] if len(candidates) == 1 else None
        if len(candidates) > 1 and i + 1 < len(loc):
            tagged = [m for m in candidates if loc[i + 1] in _tags(m)]
            if tagged:
                model = tagged[0]
                i += 1  # skip the tag
        i += 1
    return tuple(out)


def _line(lines: dict[tuple, int], loc: tuple) -> int | None:
    """The line of ``loc`` in the file, else of its nearest enclosing key that has one."""
    for end in range(len(loc), -1, -1):
        if tuple(loc[:end]) in lines:
            return lines[tuple(loc[:end])]
    return None


def _where(file: str, lines: dict[tuple, int], loc: tuple) -> str:
    line = _line(lines, loc)
    return f"{file}:{line}" if line else file


def _format_errors(
    err: ValidationError, raw: dict, file: str, lines: dict[tuple, int], root: type[BaseModel] = ExperimentConfig, prefix: tuple = ()
) -> list[str]:
    """One line per pydantic error: ``file:line: field: problem; allowed values``. ``prefix``: where the
    section ``root`` validates sits in the file (``("sweep",)``)."""
    problems = []
    for e in err.errors():
        loc = _without_union_tags(e["loc"], root)
        field = dotted(prefix + loc) or "<config>"
        where = _where(file, lines, prefix + loc)
        msg = e["msg"]
        msg = msg.removeprefix("Value error, ")
        if isinstance(cause := e.get("ctx", {}).get("error"), FieldError):  # a rule across fields: its field at fault
            loc, msg = loc + tuple(cause.field.split(".")), cause.message
            field, where = dotted(prefix + loc), _where(file, lines, prefix + loc)
        if e["type"] == "extra_forbidden":
            model = _model_at(loc[:-1], raw, root)
            twin = _alias_of(model, loc[-1])
            if twin:
                msg = f"{loc[-1]!r} is another name of '{twin}', which is given too: give one of them"
            else:
                msg = _unknown_key(model, loc[-1])
        elif e["type"] == "union_tag_invalid":
            key = e["ctx"]["discriminator"].strip("'")
            field = f"{field}.{key}"
            msg = f"unknown value {e['ctx']['tag']!r}; allowed: {e['ctx']['expected_tags']}"
        elif e["type"] == "union_tag_not_found":
            key = e["ctx"]["discriminator"].strip("'")
            field = f"{field}.{key}"
            msg = "missing; it selects which kind this section is"
        elif "input" in e and e["type"] != "missing" and loc and not isinstance(e["input"], (dict, list)):
            msg = f"{msg} (got {_short(e['input'])})"
        # A cross-field rule (empty location) names its fields in its own message.
        problems.append(f"{where}: {field}: {msg}" if loc else f"{where}: {'.'.join(prefix) + ': ' if prefix else ''}{msg}")
    return problems


def _unknown_key(model: type[BaseModel] | None, key: Any) -> str:
    allowed = _allowed_keys(model)
    return f"unknown key {key!r}" + (f"; allowed keys: {', '.join(allowed)}" if allowed else "")


def _unknown_keys(node: Any, model: type[BaseModel] | None, file: str, lines: dict[tuple, int], path: tuple = ()) -> list[str]:
    """Keys the schema does not have, found without expanding the grids (each grid's mappings walked): what a
    file whose grids would make too many trials is told first, when that is its mistake."""
    if not isinstance(node, dict) or model is None:
        return []
    out = []
    for key, value in node.items():
        name = _alias_of(model, key)
        if name is None:
            out.append(f"{_where(file, lines, path + (key,))}: {dotted(path + (key,))}: {_unknown_key(model, key)}")
            continue
        members = _submodels(model.model_fields[name].annotation)
        for choice in (value["grid"] if _is_grid(value) and isinstance(value["grid"], list) else [value]):
            out += _unknown_keys(choice, _member(members, choice), file, lines, path + (key,))
    return list(dict.fromkeys(out))


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validate(raw: dict, file: str = "<config>", lines: dict[tuple, int] | None = None) -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(raw, strict=True)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, raw, file, lines or {})) from None


# --------------------------------------------------------------------------- files


def load_experiment(path: str | Path, check_cluster: bool = True) -> ExperimentConfig:
    """Read a file of one experiment, judged as `validate` and `sweep` judge it (:func:`load_sweep`, the one
    path of every check: the same problems, the ``sweep:`` section's too, though `run` uses none of it); a valid
    file with grids or distributions is then refused (it is a sweep), and the experiment runs the file's seed."""
    return load_sweep(path, check_cluster, one_experiment=True).trials[0].config


def load_sweep(path: str | Path, check_cluster: bool = True, one_experiment: bool = False) -> Sweep:
    """Read a sweep file, expand its grids × seeds and validate every trial config. ``one_experiment``
    (`fedsweep run`, :func:`load_experiment`): after the same checks, one trial of the file's own seed, laid out
    to run alone, the cluster and data checks made on it."""
    raw, source, lines = read_yaml(path)
    return sweep_from(raw, source, lines, str(path), check_cluster, one_experiment)


def sweep_from(raw: dict, source: str, lines: dict[tuple, int], file: str, check_cluster: bool = True,
               one_experiment: bool = False) -> Sweep:
    """:func:`load_sweep` of a sweep file's mapping already read (``source`` its text, ``lines`` the line of
    each key path, ``file`` the name its messages give): what `fedsweep bench` composes from a benchmark file
    and a method's search space."""
    problems: list[str] = []
    section = raw.get("sweep", {})
    settings = None
    if not isinstance(section, dict):
        problems.append(f"{_where(file, lines, ('sweep',))}: sweep: must be a mapping of sweep settings, got {_short(section)}; "
                        "leave the section out for the defaults")
    else:
        try:
            settings = SweepSettings.model_validate(section, strict=True)
        except ValidationError as err:
            problems += _format_errors(err, section, file, lines, SweepSettings, ("sweep",))
    body = {k: v for k, v in raw.items() if k != "sweep"}
    if settings is not None and settings.seeds and "seed" in body:  # replaced in every trial, but still checked
        try:
            TypeAdapter(Seed).validate_python(body["seed"], strict=True)
        except ValidationError as err:
            problems.append(f"{_where(file, lines, ('seed',))}: seed: {err.errors()[0]['msg']} (got {_short(body['seed'])}); "
                            "sweep.seeds replaces it in every trial: give a valid seed or leave it out")
    for field, _ in flatten_grids(body):
        if within(field, SWEEP_WIDE):
            problems.append(
                f"{_where(file, lines, tuple(field.split('.')))}: {field}: one value serves the whole sweep and cannot be "
                f"a grid (sweep-wide fields: {', '.join(SWEEP_WIDE)})"
            )
    samples = settings.num_samples if settings and settings.search == "random" else 1
    points = _grid_points(body) * samples * len(settings.seeds if settings and settings.seeds else [None])
    if points > MAX_TRIALS:
        if unknown := _unknown_keys(body, ExperimentConfig, file, lines):  # the mistake, rather than its size
            raise ConfigError(problems + unknown)
        grids = ", ".join(f"{f} ({_grid_points(g)})" for f, g in flatten_grids(body))
        raise ConfigError(problems + [f"{file}: the grids ({grids})" + (f" × sweep.num_samples ({samples})" if samples > 1 else "")
                                      + f" × sweep.seeds make {points} trials; at most {MAX_TRIALS} per sweep"])
    expanded = _expand(body, (), problems, lambda at: f"{_where(file, lines, at)}: ")
    if settings is not None:
        _check_distributions(expanded, settings, problems, lambda at: _where(file, lines, at))
    if problems:
        raise ConfigError(problems)
    assert settings is not None  # else its problem was raised above

    def laid_out(value: Any) -> Any:
        return auto_layout(value, trial_cpus(value.get("resources"), settings.max_concurrent_trials)) if isinstance(value, dict) else value

    search_points = None
    if settings.search == "optuna":
        # the settings are drawn while the sweep runs; each point's stand-in trial: every distribution at its low end
        search_points = [(laid_out(value), _without_drawn(value, overrides)) for value, overrides in expanded]
        _check_edges(search_points, settings, file, lines)
        expanded = [(search.corners(value)[0], fixed) for value, fixed in search_points]
    elif settings.search == "random":
        # a space that reaches outside a field's range is refused whatever the draws: checked before drawing
        _check_edges([(value, _without_drawn(value, overrides)) for value, overrides in expanded], settings, file, lines, laid_out)
        expanded = [(laid_out(value), overrides) for value, overrides in _draw(expanded, settings)]
    else:
        expanded = [(laid_out(value), overrides) for value, overrides in expanded]
    seeds = settings.seeds or [None]
    trials: list[Trial] = []
    failing: dict[str, list[str]] = {}  # problem -> labels of the grid points that have it
    points = list(itertools.product(expanded, seeds))
    for (value, overrides), seed in points:
        if seed is not None:
            value = {**value, "seed": seed}
            overrides = {**overrides, "seed": seed}
        try:
            trials.append(Trial(len(trials), validate(value, file, lines), overrides))
        except ConfigError as e:
            for p in e.problems:
                failing.setdefault(p, []).append(overrides_label(overrides))
    for p, labels in failing.items():
        # A problem common to every grid point is the file's; otherwise name the points that have it.
        problems.append(p if len(labels) == len(points) else f"{p} [in trial {'; '.join(labels[:3])}{' ...' if len(labels) > 3 else ''}]")
    if settings.select_on == "validation":
        without = [t.label() for t in trials if t.config.data.validation_fraction == 0]
        if without:
            problems.append(
                f"{_where(file, lines, ('sweep', 'select_on'))}: sweep.select_on: 'validation' needs a validation part in "
                f"every trial, but data.validation_fraction is 0 in {len(without)} of {len(trials)} (e.g. {without[0]}); "
                "allowed: data.validation_fraction > 0 (e.g. 0.2), or select_on: test")
    if settings.metric == "train_loss" and trials and not trials[0].config.tracking.log_train_loss:  # (sweep-wide)
        problems.append(f"{_where(file, lines, ('sweep', 'metric'))}: sweep.metric: 'train_loss' is not measured with "
                        "tracking.log_train_loss: false; allowed: log_train_loss: true, or another metric")
    if settings.scheduler is not None and trials:
        grace = settings.scheduler.asha.grace_rounds
        short = [t for t in trials if t.config.rounds <= grace]
        if short:
            problems.append(
                f"{_where(file, lines, ('sweep', 'scheduler', 'asha', 'grace_rounds'))}: sweep.scheduler.asha.grace_rounds: "
                f"{grace}, but {len(short)} trial(s) run {short[0].config.rounds} round(s) or fewer, so the scheduler could "
                f"stop nothing there; allowed: grace_rounds < rounds ({min(t.config.rounds for t in trials)}), or no scheduler")
    if trials:
        known = {k for t in trials for k in t.config.flat_params()}
        for name in settings.table_group_by:
            if name not in known:
                close = sorted(k for k in known if k.split(".")[-1] == name.split(".")[-1]) or sorted(known)[:8]
                problems.append(f"{file}: sweep.table_group_by: {name!r} is not a parameter of the trials; e.g. {', '.join(close)}")
    if problems:
        raise ConfigError(problems)
    if check_cluster:
        check_before_start([t.config for t in trials], file, settings.storage_path, keep=one_experiment)
    if one_experiment:  # the file is a valid sweep: `run` takes it if it is one experiment, with the file's own seed
        raise_problems([f"{_where(file, lines, at)}: {dotted(at)}: a {kind} is only allowed in a sweep ('fedsweep sweep {file}')"
                        for kind, found in (("grid", [tuple(f.split(".")) for f, _ in flatten_grids(body)]),
                                            ("distribution", [at for at, _ in search.distributions(body)])) for at in found])
        trials = [Trial(0, validate(auto_layout(body, trial_cpus(body.get("resources"), 1)), file, lines), {})]
        if check_cluster:  # its own layout (one trial at a time) fits too
            check_resources([trials[0].config], file)
    return Sweep(settings, trials, source, file, search_points)


def _check_distributions(points: list[tuple[Any, dict[str, Any]]], settings: SweepSettings, problems: list[str],
                         locate: Callable[[tuple], str]) -> None:
    """The distributions of the grid points, each usable by the sweep's search (:mod:`fedsweep.search`); a
    mapping where the schema takes one value, of a form that is neither a grid nor a distribution, named."""
    found = {path: node for value, _ in points for path, node in search.distributions(value)}
    for path, keys in {p: k for value, _ in points for p, k in _unknown_forms(value, ExperimentConfig)}.items():
        form = f"unknown form {keys[0]!r}" if len(keys) == 1 else f"a mapping with keys {keys}, which is no form"
        problems.append(f"{locate(path)}: {dotted(path)}: {form}; allowed: a value, {{grid: [values]}}, or a "
                        f"distribution drawn by a search: " + ", ".join(f"{{{k}: {v}}}" for k, v in search.DISTRIBUTIONS.items()))
    for path, node in found.items():
        field = ".".join(map(str, path))
        if within(field, SWEEP_WIDE):
            problems.append(f"{locate(path)}: {field}: one value serves the whole sweep and cannot be drawn "
                            f"(sweep-wide fields: {', '.join(SWEEP_WIDE)})")
        elif settings.search == "grid":
            problems.append(f"{locate(path)}: {field}: a distribution ({next(iter(node))}) is drawn by a search; "
                            "allowed: sweep.search: random or optuna with sweep.num_samples, or a grid: [values]")
        elif problem := search.distribution_problem(node):
            problems.append(f"{locate(path)}: {field}: {problem}")
    if settings.search == "grid" or problems:
        return
    if not found:
        problems.append(f"{locate(('sweep', 'search'))}: sweep.search: {settings.search!r} draws the fields given as "
                        f"distributions ({', '.join('{' + k + ': ...}' for k in search.DISTRIBUTIONS)}), but the file has none")
    if settings.search == "optuna":
        for path, node in found.items():
            field = ".".join(map(str, path))
            if field.startswith("resources."):
                problems.append(f"{locate(path)}: {field}: an Optuna search places its trials before it draws them, so "
                                "resources cannot be drawn; allowed: a fixed value or a grid")
            elif "choice" in node and any(search.distributions(v) for v in node["choice"]):
                problems.append(f"{locate(path)}: {field}: an Optuna search does not draw inside a choice; allowed: a "
                                "grid of mappings, each with its own distributions, or search: random")


def _unknown_forms(node: Any, model: type[BaseModel] | None, path: tuple = ()) -> list[tuple[tuple, list[str]]]:
    """Non-empty mappings given where the schema takes one value that are neither a grid nor a distribution
    (``local_lr: {normal: [0.05, 0.01]}``): their paths and keys."""
    out: list[tuple[tuple, list[str]]] = []
    if not isinstance(node, dict) or model is None:
        return out
    for key, value in node.items():
        field = model.model_fields.get(_alias_of(model, key) or "")
        if field is None or not isinstance(value, dict) or not value or _is_grid(value) or search.is_distribution(value):
            continue
        members = _submodels(field.annotation)
        if not members:
            out.append((path + (key,), [str(k) for k in value]))
            continue
        out += _unknown_forms(value, _member(members, value), path + (key,))
    return out


def _check_edges(points: list[tuple[Any, dict[str, Any]]], settings: SweepSettings, file: str, lines: dict[tuple, int],
                 prepare: Callable[[Any], Any] = lambda value: value) -> None:
    """Every grid point's search space validated at its edges (:func:`fedsweep.search.corners`: each
    distribution at its low and its high end, each value of each choice), whatever a search would draw; a
    point's ``prepare`` (its layout) applied to each corner as to a drawn setting."""
    problems: list[str] = []
    for value, fixed in points:
        for corner in search.corners(value):
            try:
                validate(prepare({**corner, **({"seed": settings.seeds[0]} if settings.seeds else {})}), file, lines)
            except ConfigError as e:
                for p in e.problems:
                    of = f" of {overrides_label(fixed)}" if fixed else ""
                    if (line := f"{p} [at an edge of the search space{of}]") not in problems:
                        problems.append(line)
    if problems:
        raise ConfigError(problems)


def _draw(points: list[tuple[Any, dict[str, Any]]], settings: SweepSettings) -> list[tuple[Any, dict[str, Any]]]:
    """A random search's settings: each grid point's distributions drawn ``num_samples`` times
    (:func:`fedsweep.search.draw`), from a generator seeded by ``search_seed`` and the point's position."""
    out = []
    for index, (value, overrides) in enumerate(points):
        rng = np.random.default_rng([settings.search_seed, index])
        fixed = _without_drawn(value, overrides)
        for _ in range(settings.num_samples or 1):
            drawn, picked = search.draw(value, rng)
            out.append((drawn, {**fixed, **picked}))
    return out


def _without_drawn(value: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    """A grid point's overrides without the leaves of its distributions (a grid point that chose a mapping
    lists its leaves; a distribution among them is a drawn value instead)."""
    drawn_at = tuple(".".join(map(str, path)) for path, _ in search.distributions(value))
    return {k: v for k, v in overrides.items() if not within(k, drawn_at)}
