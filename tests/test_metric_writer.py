"""The metric writer without a tracking server that answers: what it holds (in memory, then in a file), in order,
how soon a trial learns of the outage, and the error past ``tracking.outage_limit_s``; and the store's
deduplication that makes a repeated write harmless. The outage of a real server: tests/test_tracking_outage.py."""

from __future__ import annotations

import time

import pytest

from fedsweep.config import ConfigError
from fedsweep.loading import validate
from fedsweep.metric_writer import MetricWriter, TrackingOutage
from tests.conftest import config_dict
from tests.test_job_submit import free_port


def rounds(n: int, per_round: int = 11, first: int = 0) -> list[list]:
    from mlflow.entities import Metric

    return [[Metric(f"m{k}", float(r * 100 + k), 1_700_000_000_000 + r, r) for k in range(per_round)]
            for r in range(first, first + n)]


def as_tuples(metrics: list) -> list[tuple]:
    return [(m.key, m.value, m.timestamp, m.step) for m in metrics]


def test_an_unreachable_server_holds_every_metric_in_order_then_fails_past_the_limit(tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens: every connection is refused
    writer = MetricWriter(uri, "0" * 32, limit_s=1.5, max_held=30, spill_dir=str(tmp_path))
    put = rounds(10)
    started = time.monotonic()
    writer.put(put[:2])  # 22 metrics: in memory
    assert not writer.wait(until_written=False)  # the outage is reported, not waited out
    assert time.monotonic() - started < 5 and writer.outage_since is not None
    writer.put(put[2:])  # past 30 held metrics every further round goes to the file
    writer.check()  # within the limit: training goes on
    assert writer.held == 110 and writer.written == 0
    assert writer.spill_file is not None and writer.spill_file.parent == tmp_path
    assert len(writer.spill_file.read_text().splitlines()) == 8
    assert as_tuples(writer.held_metrics()) == as_tuples([m for r in put for m in r])

    time.sleep(max(0.0, writer.outage_since + 1.6 - time.monotonic()))
    with pytest.raises(TrackingOutage, match=r"tracking\.outage_limit_s=1\.5: .* 110 metrics from round 0 on are held"):
        writer.check()
    assert writer.gave_up
    with pytest.raises(TrackingOutage):
        writer.wait()  # as finish() would: no longer than the limit
    assert as_tuples(writer.held_metrics()) == as_tuples([m for r in put for m in r])  # nothing dropped
    writer.close()
    assert writer.spill_file is None and not list(tmp_path.iterdir())


def test_held_rounds_from_memory_and_file_reach_the_store_in_order_exactly_once(tmp_path):
    """A SQLite store takes everything at once; a write repeated with the same metrics (an attempt whose answer was
    lost) is stored once, which is what lets the writer retry without counting."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = MlflowClient(uri)
    run_id = c.create_run(c.create_experiment("writer")).info.run_id
    writer = MetricWriter(uri, run_id, limit_s=60, max_held=25, spill_dir=str(tmp_path))
    put = rounds(120, per_round=11)  # 1320 metrics: two calls at least, most rounds through the file
    writer.put(put)
    assert writer.wait()
    writer.put(rounds(3, per_round=11))  # rounds 0-2 again, with their first timestamps
    assert writer.wait() and writer.written == 1353
    writer.close()
    for k in (0, 10):
        history = c.get_metric_history(run_id, f"m{k}")
        assert sorted(m.step for m in history) == list(range(120))
        assert {m.step: m.value for m in history} == {r: float(r * 100 + k) for r in range(120)}
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".jsonl"]


def test_outage_limit_is_a_positive_number_of_seconds():
    assert validate(config_dict()).tracking.outage_limit_s == 600
    assert validate(config_dict(tracking={"outage_limit_s": 45})).tracking.outage_limit_s == 45
    for bad in (0, -5, float("inf"), "600"):
        with pytest.raises(ConfigError, match="outage_limit_s"):
            validate(config_dict(tracking={"outage_limit_s": bad}))


def test_an_action_runs_once_every_metric_before_it_is_written_the_newest_replacing_older_ones(tmp_path):
    """What a sweep's checkpoints use: ``after_written`` runs in the writer's thread after the metrics put before
    it and the ``later`` ones still to come are in the store (the trial does not wait); a newer action replaces
    one not yet run; none runs while the server does not answer; an action's error reaches the trial's check(), once,
and the writer goes on writing."""
    import threading

    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = MlflowClient(uri)
    run_id = c.create_run(c.create_experiment("writer")).info.run_id
    writer = MetricWriter(uri, run_id, limit_s=60)
    seen, ran = [], threading.Event()

    def action(name):
        def run():
            seen.append((name, writer.written, threading.current_thread() is not threading.main_thread()))
            ran.set()
        return run

    writer.after_written(action("first"), later=11)  # round 0 not yet put: it waits for it
    writer.after_written(action("second"), later=22)  # replaces the first
    time.sleep(0.3)
    assert seen == []
    writer.put(rounds(1))
    time.sleep(0.3)
    assert seen == []  # 11 of the 22 metrics written
    writer.put(rounds(1, first=1))
    assert ran.wait(10) and seen == [("second", 22, True)]
    assert sorted(m.step for m in c.get_metric_history(run_id, "m0")) == [0, 1]

    def broken():
        raise OSError("disk full")

    writer.after_written(broken)
    deadline = time.monotonic() + 10
    while writer.action_error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(OSError, match="disk full"):
        writer.check()
    # a checkpoint not saved fails its trial, but the writer goes on: later rounds are written, and wait() returns
    writer.put(rounds(1, first=2))
    assert writer.wait() and not writer.gave_up
    assert sorted(m.step for m in c.get_metric_history(run_id, "m0")) == [0, 1, 2]
    writer.check()  # raised once
    writer.close()

    down = MetricWriter(f"http://127.0.0.1:{free_port()}", "0" * 32, limit_s=60, spill_dir=str(tmp_path))
    down.put(rounds(1))
    down.after_written(action("never"))
    assert not down.wait(until_written=False)
    time.sleep(0.5)
    down.close()
    assert [s[0] for s in seen] == ["second"]


def test_an_action_due_when_the_writer_closes_still_runs(tmp_path):
    """A checkpoint asked for once its rounds are written and the writer closed right after (a trial's last
    checkpoint, then :meth:`RunLogger.finish`): it runs before the thread stops. It was dropped when the thread saw
    the stop before the action (most times: the closing thread takes the lock first)."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = MlflowClient(uri)
    experiment = c.create_experiment("closing")
    ran = []
    for i in range(10):
        writer = MetricWriter(uri, c.create_run(experiment).info.run_id, limit_s=60)
        writer.put(rounds(1))
        assert writer.wait()
        writer.after_written(lambda i=i: ran.append(i))  # due at once: every metric put is written
        writer.close()
    assert ran == list(range(10))

    down = MetricWriter(f"http://127.0.0.1:{free_port()}", "0" * 32, limit_s=60, spill_dir=str(tmp_path))
    down.put(rounds(1))
    down.after_written(lambda: ran.append("never"))  # its round is not written: not due, dropped at close
    assert not down.wait(until_written=False)
    down.close()
    assert ran == list(range(10))


@pytest.mark.timeout(60)
def test_a_writer_whose_thread_stops_on_an_unexpected_error_raises_it_instead_of_waiting_forever(tmp_path):
    """An error outside the writes' own handling (here reading the held rounds, as a vanished overflow file would)
    ends the writer's thread: wait() and check() raise it, where wait() looped for ever on the metrics still held."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = MlflowClient(uri)
    writer = MetricWriter(uri, c.create_run(c.create_experiment("dies")).info.run_id, limit_s=60)

    def vanished(*args, **kwargs):
        raise FileNotFoundError("the held rounds' file")

    writer._next_batch = vanished
    writer.put(rounds(1))
    with pytest.raises(RuntimeError, match=r"stopped: FileNotFoundError"):
        writer.wait()
    assert writer.gave_up
    writer.close()


def test_a_checkpoint_between_evaluations_is_saved_before_the_next_evaluation(tmp_path):
    """``checkpoint_every`` 3 with an evaluation every 10 rounds, rounds of 0.25 s: each checkpoint is saved once the
    rounds before it are written, without waiting for the next evaluation's hand-over (before, round 3's waited for
    round 10's, which replaced it with its own there: checkpoints at evaluations only). Rounds faster than that hand
    over at most every ``LINGER_S`` (0.5 s), as evaluations do."""
    import threading

    from fedsweep.experiment import InProcessRunner, execute
    from fedsweep.tracking import RunLogger, ensure_experiment

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = validate(config_dict(rounds=12, eval_every=10, resources=None, tracking={"experiment": "between"}))
    logger = RunLogger(uri, ensure_experiment(uri, "between"), cfg, "between")
    saved: dict[int, threading.Event] = {r: threading.Event() for r in (3, 6, 9)}

    def on_round(m: dict[str, float]) -> None:
        time.sleep(0.25)  # a round of 0.25 s: a checkpoint 3 rounds after the last hand-over hands over itself
        if int(m["round"]) in (4, 7, 10):  # the round after a checkpoint: it is saved before the next evaluation
            assert saved[int(m["round"]) - 1].wait(30), f"checkpoint of round {int(m['round']) - 1} not saved"

    execute(cfg, logger, on_round, checkpoint_every=3, runner=InProcessRunner(cfg),
            on_checkpoint=lambda m, checkpoint: logger.after_written(saved[int(m["round"])].set))
    assert all(e.is_set() for e in saved.values())
