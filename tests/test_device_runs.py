"""The route of a sweep to a lent GPU machine that has neither Ray nor MLflow (benchmarks/device_data.py,
benchmarks/device_sweep.py): CIFAR-10's files packed and rebuilt byte for byte; a sweep file's trials run in
processes without Ray or MLflow, then logged here so that ``fedsweep table`` reads them as a sweep's."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient

from benchmarks import device_data, device_sweep
from benchmarks.device_sweep import in_process, read_trial
from fedsweep.engine import run_local
from fedsweep.loading import load_sweep
from fedsweep.table import load_runs

ROOT = Path(__file__).resolve().parents[1]


def test_codec_is_lossless_on_smooth_and_noisy_images():
    rng = np.random.default_rng(0)
    ramp = np.tile(np.arange(32, dtype=np.uint8) * 8, (4, 3, 32, 1)).reshape(4, -1)  # what the predictor gets right
    noisy = rng.integers(0, 256, (5, 3072), dtype=np.uint8)  # what it cannot
    edges = np.where(rng.random((3, 3072)) < 0.5, 0, 255).astype(np.uint8)
    for pixels in (ramp, noisy, edges):
        assert np.array_equal(device_data.decode(device_data.encode(pixels), len(pixels)), pixels)
    assert len(device_data.encode(ramp)) < ramp.size / 20  # residuals of a ramp are nearly all zero


def test_pack_and_unpack_rebuild_every_file_and_refuse_a_changed_one(tmp_path):
    device_data.stand_in_cifar10(tmp_path / "src", per_class=6)  # Python 3's protocol 2: stored as they are
    src = tmp_path / "src" / "cifar-10-batches-py"
    rng = np.random.default_rng(1)  # protocol 4 stores the pixels as one run of bytes, as CIFAR's own files do
    batch = {b"labels": list(range(10)) * 6, b"data": rng.integers(0, 256, (60, 3072), dtype=np.uint8)}
    (src / "data_batch_9").write_bytes(pickle.dumps(batch, protocol=4))
    device_data.pack(src, tmp_path / "pack", parts=2)
    parts = sorted((tmp_path / "pack").iterdir())
    assert [p.name for p in parts] == ["part_0", "part_1"]
    for part in parts:
        device_data.unpack(part, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in src.iterdir())
    for original in src.iterdir():
        assert (tmp_path / "out" / original.name).read_bytes() == original.read_bytes()
    [blob] = (tmp_path / "pack").glob("*/data_batch_9.pixels.xz")
    pixels = device_data.decode(blob.read_bytes(), 60)
    pixels[0, 0] ^= 1
    blob.write_bytes(device_data.encode(pixels))
    with pytest.raises(SystemExit, match="differs from the original"):
        device_data.unpack(blob.parent, tmp_path / "again")


SWEEP = """
name: device-route
data: {dataset: synthetic, num_clients: 6}
rounds: 3
eval_every: 1
model: {name: mlp, hidden: [8]}
algorithm:
  grid:
    - {name: fedavg, beta: 0.05, r: 0.5, tau: 2, batch_size: 10}
    - {name: pfldyn, transform: {grid: [maml, proto]}, alpha: 0.01, beta: 0.05, lambda: 0.01, r: 0.5, tau: 2, batch_size: 10}
tracking: {experiment: device-route}
sweep: {name: device-route, seeds: [0, 1]}
"""

def without_ray_and_mlflow(script: str) -> str:
    """``python -c`` text running ``benchmarks/<script>`` as its main in a process where Ray and MLflow cannot be
    imported: the machine has neither, so the run step must not import them."""
    return ("import sys, runpy\n"
            "for m in ('ray', 'mlflow'): sys.modules[m] = None\n"
            f"sys.argv = [{script!r}, *sys.argv[1:]]\n"
            f"runpy.run_path('benchmarks/{script}', run_name='__main__')\n")


WITHOUT_RAY_AND_MLFLOW = without_ray_and_mlflow("device_sweep.py")


def _run(file: Path, out: Path, *more: str, workers: int = 1, without_ray_and_mlflow: bool = False) -> None:
    """``device_sweep.py run``: in this process (one trial after the other, torch's threads restored after each),
    or as the GPU machine runs it, a process in which Ray and MLflow cannot be imported."""
    args = ["run", str(file), "--out", str(out), "--device", "cpu", "--workers", str(workers), *more]
    if without_ray_and_mlflow:
        subprocess.run([sys.executable, "-c", WITHOUT_RAY_AND_MLFLOW, *args], cwd=ROOT, check=True, timeout=300)
    else:
        assert workers == 1
        device_sweep.main(args)


def _log(file: Path, folder: Path, uri: str, monkeypatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    device_sweep.main(["log", str(file), str(folder)])


def test_trials_run_without_ray_or_mlflow_and_log_as_a_sweep(tmp_path, monkeypatch):
    file = tmp_path / "device_route.yaml"
    file.write_text(SWEEP)
    _run(file, tmp_path / "out", workers=2, without_ray_and_mlflow=True)  # two processes at once
    sweep = load_sweep(file, check_cluster=False)
    files = sorted((tmp_path / "out").glob("trial_*.jsonl"))
    assert len(files) == len(sweep.trials) == 6
    for f in files:  # each trial's rounds are those of the same trial run in this process
        head, rows, end = read_trial(f)
        assert end["complete"] and not end["diverged"] and len(end["clients"]) == 6
        cfg = in_process(sweep.trials[head["trial"]].config, stack=True)
        assert head["vectorize_clients"] == cfg.resources.vectorize_clients
        expected, _ = run_local(cfg)
        assert [{k: v for k, v in m.items() if k != "wall_time_s"} for m in rows] == expected
    assert all(read_trial(f)[0]["vectorize_clients"] for f in files)  # the proto transform stacks too

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _log(file, tmp_path / "out", uri, monkeypatch)
    runs, tags = load_runs(uri, "device-route")
    assert tags["fedsweep.sweep"] == "true" and tags["fedsweep.yaml_sha1"] == sweep.source_hash()
    assert tags["fedsweep.device_run"] == "cpu"
    assert len(runs) == 6 and set(runs["outcome"]) == {"finished"}
    for f in files:
        head, rows, _ = read_trial(f)
        run = runs[(runs["algorithm"] == head["overrides"]["algorithm.name"]) & (runs["seed"] == head["overrides"]["seed"])
                   & (runs["setting_label"].str.contains(head["overrides"].get("algorithm.transform", "")))]
        assert run["personalized_accuracy_mean"].tolist() == [rows[-1]["personalized_accuracy_mean"]]


def test_a_time_box_stops_trials_and_they_log_as_stopped_early(tmp_path, monkeypatch):
    file = tmp_path / "device_route.yaml"
    file.write_text(SWEEP.replace("device-route", "device-box"))
    _run(file, tmp_path / "out", "--time-box", "0", "--trials", "0,4")
    ends = [read_trial(f)[2] for f in sorted((tmp_path / "out").glob("trial_*.jsonl"))]
    assert [(e["reached"], e["complete"]) for e in ends] == [(0, False), (0, False)]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _log(file, tmp_path / "out", uri, monkeypatch)
    runs, _ = load_runs(uri, "device-box")
    assert runs["outcome"].tolist() == ["stopped_early", "stopped_early"]
    # a trial killed mid-run (no end line, its last line cut off mid-write) is logged FAILED with outcome error
    killed = tmp_path / "killed"
    killed.mkdir()
    text = (tmp_path / "out" / "trial_0000.jsonl").read_text().splitlines()
    (killed / "trial_0000.jsonl").write_text("\n".join(text[:-1]) + "\n" + text[-1][:10])
    _log(file, killed, uri, monkeypatch)
    c = MlflowClient(uri)
    [run] = [r for r in c.search_runs([c.get_experiment_by_name("device-box").experiment_id]) if r.data.tags.get("fedsweep.seed")
             and r.info.run_id not in set(runs["run_id"])]
    assert run.info.status == "FAILED" and run.data.tags["fedsweep.outcome"] == "error"
    with pytest.raises(SystemExit, match="holds trial files of an earlier run"):  # run never mixes two runs' files
        device_sweep.main(["run", str(file), "--out", str(killed), "--device", "cpu"])
    cut = tmp_path / "cut"
    _run(file, cut, "--rounds", "1", "--trials", "0")
    assert json.loads((cut / "trial_0000.jsonl").read_text().splitlines()[0])["cut_to"] == 1
    with pytest.raises(SystemExit, match="cut with --rounds"):
        _log(file, cut, uri, monkeypatch)


def test_pace_compares_a_stacked_probe_with_a_one_by_one_probe(tmp_path, capsys):
    """``pace``: per trial file, the seconds a round of both probes (from their own rows), the ratio, and the largest
    difference of the last scores both evaluated (3 rounds of PFLDyn-MAML: equal up to summation order)."""
    file = tmp_path / "device_route.yaml"
    file.write_text(SWEEP)
    _run(file, tmp_path / "on", "--rounds", "3", "--trials", "2")
    _run(file, tmp_path / "off", "--rounds", "3", "--trials", "2", "--no-stack")
    capsys.readouterr()  # the two runs' own lines
    device_sweep.main(["pace", str(tmp_path / "on"), str(tmp_path / "off")])
    line = capsys.readouterr().out.strip()
    pace = {}
    for folder in ("on", "off"):
        _, rows, _ = read_trial(tmp_path / folder / "trial_0002.jsonl")
        pace[folder] = (rows[-1]["wall_time_s"] - rows[1]["wall_time_s"]) / (len(rows) - 2)
    assert line.startswith("trial_0002.jsonl pfldyn maml: stacked ") and ", one by one " in line
    assert f"ratio {pace['off'] / pace['on']:.2f};" in line
    gap = float(line.rsplit("at round 3: ", 1)[1])
    assert gap < 1e-5
