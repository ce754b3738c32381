"""Generated junk through `fedsweep validate`: random bytes, and random YAML trees made of the schema's own
keys with values of the wrong types, grids, search spaces (distributions over junk bounds, unknown forms),
aliases, paths and URIs, some then garbled character by character; and data folders damaged one way each. Whatever comes in, the command answers with exit 0 (the rare valid file) or with its own
bad-input report and exit 2 - never another exception - each file within seconds, and the whole run
within a bounded amount of memory.

Seeded: the same files every run, so a failure names a file that can be regenerated."""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
from typing import Any, get_args

import numpy as np
import pytest
import yaml
from pydantic import BaseModel

from fedsweep.algorithms import ALGORITHMS
from fedsweep.config import ExperimentConfig, SweepSettings
from fedsweep.schema import names_of
from tests.test_malformed_sweeps import GOOD, idx

TREES, BYTE_FILES, DATA_FOLDERS = 400, 100, 40

DRIVER = """
import contextlib, io, json, os, resource, sys, time, traceback
from fedsweep.cli import main
main(["validate", sys.argv[2]])  # imports and first-use caches, outside the measurement
base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
results = {}
for path in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(["validate", path])
        except BaseException:
            rc, _ = None, err.write(traceback.format_exc())
    results[path] = {"rc": rc, "stderr": err.getvalue()[-3000:], "seconds": time.perf_counter() - t0}
grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_kb) / 1024
print(json.dumps({"results": results, "grown_mb": grown_mb}))
"""


def schema_keys() -> list[str]:
    """Every field name and alias of the config and sweep schemas, at any depth."""
    keys: set[str] = set()

    def walk(model: type[BaseModel]) -> None:
        for name, info in model.model_fields.items():
            keys.update(names_of(name, info))
            for sub in _models(info.annotation):
                if not keys.issuperset(sub.model_fields):
                    walk(sub)

    for model in (ExperimentConfig, SweepSettings, *(cls.Params for cls in ALGORITHMS.values())):
        walk(model)
    return sorted(keys | {"grid", "sweep"})


def _models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in get_args(annotation) for m in _models(a)]


def junk_value(r: random.Random, keys: list[str], depth: int = 0) -> Any:
    simple = [True, False, None, "", "junk", "1e-3", "0x10", "yes", -1, 0, 1, 3, 2**70, -(2**70), 0.5, -0.0, 1e308,
              float("inf"), float("-inf"), float("nan"), "\u200b", "../../x", "/proc/x", "mongo://x", "sqlite:///",
              "ftp://h/p", "ray://", "auto", *ALGORITHMS, "mnist", "cifar10", "digits", "synthetic", "cnn", "mlr"]
    kind = r.random()
    if depth > 3 or kind < 0.6:
        return r.choice(simple)
    if kind < 0.65:  # a search space: a distribution (or a form that is none) over junk bounds
        form = r.choice(["uniform", "loguniform", "randint", "choice", "normal", "grid"])
        return {form: [junk_value(r, keys, depth + 1) for _ in range(r.randint(0, 3))]}
    if kind < 0.75:
        return [junk_value(r, keys, depth + 1) for _ in range(r.randint(0, 4))]
    if kind < 0.85:
        return {"grid": [junk_value(r, keys, depth + 1) for _ in range(r.randint(0, 4))]}
    return {r.choice(keys): junk_value(r, keys, depth + 1) for _ in range(r.randint(0, 4))}


def junk_data_folder(r: random.Random, root) -> str:
    """A data root whose MNIST or CIFAR-10 files are damaged one way (truncated, wrong image shape, labels
    beyond the classes, float pixels, fewer labels than images, a file that is not the format, the official
    counts missing), and the sweep file that reads it: every one must be refused."""
    dataset = r.choice(["mnist", "cifar10"])
    damage = r.choice(["truncated", "shape", "labels", "dtype", "count", "garbage", "official"])
    n = 10 * r.randint(1, 3)
    y = np.arange(n) % 10
    if damage == "labels":
        y[r.randrange(n)] = r.choice([10, 11, 99, 255])
    if dataset == "mnist":
        folder = root / "MNIST" / "raw"
        folder.mkdir(parents=True)
        for split in ("train", "t10k"):
            shape = (28, r.choice([1, 27, 29])) if damage == "shape" else (28, 28)
            images = idx(np.zeros((n, *shape)), 0x0D if damage == "dtype" else 0x08)
            labels = idx(y[: n - 1] if damage == "count" else y)
            for name, data in ((f"{split}-images-idx3-ubyte", images), (f"{split}-labels-idx1-ubyte", labels)):
                (folder / name).write_bytes(data)
    else:
        folder = root / "cifar-10-batches-py"
        folder.mkdir(parents=True)
        pixels = r.choice([3, 1024, 3071]) if damage == "shape" else 3072
        data = np.zeros((n, pixels), np.float32 if damage == "dtype" else np.uint8)
        batch = pickle.dumps({b"labels": [int(v) for v in (y[: n - 1] if damage == "count" else y)], b"data": data}, protocol=2)
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            (folder / name).write_bytes(batch)
    victim = r.choice(sorted(folder.iterdir()))
    if damage == "truncated":
        victim.write_bytes(victim.read_bytes()[: r.randint(0, victim.stat().st_size - 1)])
    elif damage == "garbage":
        victim.write_bytes(r.randbytes(r.randint(0, 5000)))
    if damage != "official":  # only the counts would be wrong: they are the official files' stand-ins
        (folder / "FEDSWEEP_SUBSET").touch()
    return GOOD.replace("data: {dataset: digits, num_clients: 3, partition: {name: label_skew, classes_per_client: 4}}",
                        f"data: {{dataset: {dataset}, root: '{root}', num_clients: 3}}")


def _mappings(node: Any, out: list[dict]) -> list[dict]:
    if isinstance(node, dict):
        out.append(node)
        for v in node.values():
            _mappings(v, out)
    elif isinstance(node, list):
        for v in node:
            _mappings(v, out)
    return out


def junk_tree(r: random.Random, keys: list[str]) -> str:
    """The valid sweep of the malformed-file tests, mutated a few times, dumped, and sometimes garbled."""
    tree = yaml.safe_load(GOOD)
    for _ in range(r.randint(1, 6)):
        target = r.choice(_mappings(tree, []))
        action = r.random()
        if action < 0.5 and target:
            target[r.choice(list(target))] = junk_value(r, keys)
        elif action < 0.8:
            target[r.choice(keys)] = junk_value(r, keys)
        elif target:
            del target[r.choice(list(target))]
    text = yaml.safe_dump(tree, allow_unicode=True, default_flow_style=r.random() < 0.5)
    if r.random() < 0.3:  # garble: characters replaced, removed or inserted
        chars = list(text)
        for _ in range(r.randint(1, 8)):
            i = r.randrange(len(chars) + 1)
            op = r.random()
            new = r.choice([":", "-", "[", "{", "&a", "*a", "!!", "\t", "\n", "'", '"', "#", "\u00e9", "\x85", " ", "<<: *a"])
            if op < 0.4 and i < len(chars):
                chars[i] = new
            elif op < 0.7 and i < len(chars):
                del chars[i]
            else:
                chars.insert(i, new)
        text = "".join(chars)
    return text


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    r = random.Random(20261124)
    keys = schema_keys()
    folder = tmp_path_factory.mktemp("junk")
    files = []
    for i in range(TREES):
        path = folder / f"tree{i:03d}.yaml"
        path.write_text(junk_tree(r, keys), encoding="utf-8")
        files.append(str(path))
    for i in range(BYTE_FILES):
        path = folder / f"bytes{i:03d}.yaml"
        path.write_bytes(r.randbytes(r.randint(0, 2000)))
        files.append(str(path))
    for i in range(DATA_FOLDERS):
        path = folder / f"data{i:03d}.yaml"
        path.write_text(junk_data_folder(r, folder / f"data{i:03d}"), encoding="utf-8")
        files.append(str(path))
    warm = folder / "warm.yaml"
    warm.write_text(GOOD)
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS", "FEDSWEEP_DATA_DIR")}
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(files), str(warm)], capture_output=True, text=True,
                          env=env, cwd=folder, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.slow  # a fedsweep process per file or case: end to end, outside `make test-fast`
def test_junk_gets_exit_2_and_the_tools_own_report(outcomes):
    results = outcomes["results"]
    crashed = {p: o["stderr"] for p, o in results.items() if o["rc"] not in (0, 2)}
    assert not crashed, next(iter(crashed.items()))
    unreported = [p for p, o in results.items() if o["rc"] == 2 and not o["stderr"].startswith("error: invalid configuration")]
    assert not unreported, results[unreported[0]]
    refused = sum(o["rc"] == 2 for o in results.values())
    assert refused >= 0.9 * len(results)  # junk it is: the generator rarely makes a valid file
    data = {p: o for p, o in results.items() if os.path.basename(p).startswith("data")}
    damaged = {p: o["stderr"] for p, o in data.items() if o["rc"] != 2}
    assert not damaged, damaged  # every damaged data folder is refused by its own report
    unnamed = [p for p, o in data.items() if "data.root:" not in o["stderr"]]
    assert not unnamed, data[unnamed[0]]  # ... naming data.root and the file


def test_junk_is_judged_in_bounded_time_and_memory(outcomes):
    slowest = max(outcomes["results"].items(), key=lambda item: item[1]["seconds"])
    assert slowest[1]["seconds"] < 10, slowest
    assert outcomes["grown_mb"] < 500, outcomes["grown_mb"]
