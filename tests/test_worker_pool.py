"""A worker pool (``resources.client_workers``): the ServerActor and W - 1 ClientActors share each round's
clients; the same numbers as the in-process loop, states kept by the ServerActor, validation before any Ray call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsweep.checks import check_fits
from fedsweep.config import ConfigError
from fedsweep.engine import local_federation, run_local
from fedsweep.federation import Client, Server, Setup
from fedsweep.loading import validate
from fedsweep.pool import run_train
from tests.conftest import config_dict
from tests.test_actors import _kill_a_client_actor_between_calls, run_actors, strip_time

SCAFFOLD = {"_replace": True, "name": "scaffold", "local_lr": 0.1, "local_steps": 2, "batch_size": 8}
PFEDME = {"_replace": True, "name": "pfedme", "coupling": 15, "local_lr": 0.05, "personalization_lr": 0.05,
          "inner_steps": 2, "local_steps": 2, "batch_size": 8}


def pool_config(workers: int, algorithm: dict | None = None, clients: int = 5, rounds: int = 4, **extra):
    raw = config_dict(
        data={"num_clients": clients, "partition": {"name": "label_skew", "classes_per_client": 4}},
        algorithm={**(algorithm or {}), "participation_rate": 0.6},
        rounds=rounds,
        eval_every=2,
        **extra,
    )
    raw["resources"] = {**raw["resources"], "client_workers": workers}
    return validate(raw)


def test_training_from_sent_states_is_the_clients_own_training():
    """The plain-PyTorch step of a host that does not hold a client's current state: load the sent state, train,
    return the new one; the same message and state as a client that kept its state itself."""
    cfg = pool_config(1, SCAFFOLD)
    server, pool = local_federation(cfg)
    kept = pool.hosts[0].clients[2]
    worker = {2: Client(2, kept.data, Setup.of(cfg, 64, 10))}
    payload = server.payloads([2])
    held = (None, 0)
    for rnd in (1, 2, 3):
        expected = kept.train(payload[2], rnd)
        (message,), states = run_train(worker, {2: held}, payload, rnd, stacked=False)
        held = states[2]
        assert message.client_id == 2 and message.stats == expected.stats
        assert all(np.array_equal(message.payload[k], expected.payload[k]) for k in expected.payload)
        assert held[1] == kept.times_trained == rnd
        assert all(np.array_equal(held[0][k], v.numpy()) for k, v in kept.state.items())


@pytest.mark.ray
@pytest.mark.parametrize("workers, algorithm", [(1, None), (3, PFEDME), (2, SCAFFOLD)])
def test_a_worker_pool_gives_the_numbers_of_the_in_process_loop(ray_session, workers, algorithm):
    cfg = pool_config(workers, algorithm)
    history, params, info, table = run_actors(cfg)
    local, server = run_local(cfg)
    assert strip_time(history) == local
    assert torch.equal(params, server.params)
    assert table == [e.row() for e in server.last_evals]
    # W processes hold every client each, the ServerActor's rows first.
    pids = [i["pid"] for i in info]
    assert len(info) == 5 * workers and len(set(pids)) == workers
    assert [i["client_id"] for i in info] == list(range(5)) * workers
    assert len(set(pids[:5])) == 1


@pytest.mark.ray
def test_the_server_keeps_the_states_and_unsampled_clients_keep_theirs(ray_session):
    from ray.util.placement_group import placement_group_table

    from fedsweep.experiment import ExperimentRunner
    from fedsweep.federation import Server

    cfg = pool_config(2, SCAFFOLD, clients=4, rounds=4)
    reference = Server.of(cfg, 64, 10)
    runner = ExperimentRunner(cfg)
    try:
        runner.start()
        bundles = placement_group_table(runner.pg)["bundles"]
        assert [b["CPU"] for b in bundles.values()] == [pytest.approx(0.3), pytest.approx(0.1)]  # server + one worker
        rounds = runner.rounds()
        history = [next(rounds)]
        states = lambda: ray_session.get(runner.server.client_states.remote([0, 1, 2, 3]))
        for rnd in range(1, 5):
            before = states()
            history.append(next(rounds))
            after = states()
            for i in range(4):
                same = (before[i] is None and after[i] is None) or (
                    before[i] is not None and all(np.array_equal(before[i][k], after[i][k]) for k in before[i]))
                assert same == (i not in reference.sample(rnd)), (rnd, i)
    finally:
        runner.stop()
    assert strip_time(history) == run_local(cfg)[0]


@pytest.mark.ray
def test_a_dead_worker_loses_no_state(ray_session):
    """SCAFFOLD's control variates live in the ServerActor: a ClientActor killed between rounds and
    restarted by Ray is reset to every shard and goes on; nothing needs restoring from a checkpoint."""
    from fedsweep.experiment import ExperimentRunner

    cfg = pool_config(2, SCAFFOLD, clients=4, rounds=4)
    runner = ExperimentRunner(cfg)
    try:
        runner.start()
        rounds = runner.rounds()
        history = [next(rounds), next(rounds)]
        _kill_a_client_actor_between_calls(ray_session, runner, row=4)  # rows 0-3: the ServerActor's clients
        history += list(rounds)
        table = runner.client_table()
    finally:
        runner.stop()
    # Killed between calls, it is found restarted and empty (stale) by round 2's call: that part of
    # round 2 is dropped; the ServerActor's part and every state survive, and later rounds are whole.
    assert history[2]["clients_dropped"] == 2  # 3 sampled of 4: parts of 2 (ClientActor) and 1
    assert [h["clients_dropped"] for h in history[3:]] == [0, 0]
    # the two clients it trained in round 1 had their states there: sent again from the ServerActor's copy
    # (the round-1 states, not a checkpoint's) with the next call that needed them
    assert sum(h["clients_restored"] for h in history[1:]) == 2
    assert [r["client_id"] for r in table] == [0, 1, 2, 3]
    assert sum(r["times_trained"] for r in table) == sum(h["clients_answered"] for h in history[1:]) == 3 * 4 - 2


@pytest.mark.ray
def test_a_frozen_worker_past_the_timeout_is_left_out_and_its_late_reply_dropped(ray_session):
    """SIGSTOP the ClientActor over round 2 (round_timeout_s 1): its part of round 2 is dropped and those
    clients keep their states; resumed, it answers round 2's request late, the ServerActor drops that reply
    and reads round 3's own (sent with the states it holds), so rounds 3-4 are whole."""
    import os
    import signal

    from fedsweep.experiment import ExperimentRunner

    cfg = pool_config(2, SCAFFOLD, clients=4, rounds=4, resources={"round_timeout_s": 1.0})
    runner = ExperimentRunner(cfg)
    try:
        runner.start()
        worker = runner.clients_info[4]["pid"]  # rows 0-3: the ServerActor's clients
        rounds = runner.rounds()
        history = [next(rounds), next(rounds)]
        before = ray_session.get(runner.server.client_states.remote([0, 1, 2, 3]))
        os.kill(worker, signal.SIGSTOP)
        try:
            history.append(next(rounds))
            after = ray_session.get(runner.server.client_states.remote([0, 1, 2, 3]))
        finally:
            os.kill(worker, signal.SIGCONT)
        history += list(rounds)
        table = runner.client_table()
    finally:
        runner.stop()
    assert history[2]["clients_dropped"] == 2  # 3 sampled of 4: the ClientActor's part of 2
    assert [h["clients_dropped"] for h in history[3:]] == [0, 0]
    remote_part = Server.of(cfg, 64, 10).sample(2)[:2]
    for c in remote_part:  # not trained in round 2: the state it had after round 1
        assert (before[c] is None and after[c] is None) or all(np.array_equal(before[c][k], after[c][k]) for k in before[c])
    assert history[2]["clients_evaluated"] == 2  # its evaluation timed out too, asked twice
    assert sum(r["times_trained"] for r in table) == 3 * 4 - 2
    assert np.isfinite(history[-1]["global_loss"])


def test_worker_pool_settings_are_checked_before_any_cluster_work():
    def problems(**resources):
        raw = config_dict(data={"num_clients": 4})
        raw["resources"] = {**raw["resources"], **resources}
        with pytest.raises(ConfigError) as err:
            validate(raw)
        return str(err.value)

    assert "resources.clients_per_actor: 2 with client_workers=2" in problems(client_workers=2, clients_per_actor=2)
    assert "allowed: client_gpus 0 with client_workers >= 1" in problems(client_workers=2, client_gpus=0.5)
    assert "resources.client_workers: 5 is more workers than clients (data.num_clients=4); allowed: 0..4" in problems(client_workers=5)
    assert "resources.pool_channel" in problems(pool_channel="ray")  # the socket channel is gone: refused by name
    raw = config_dict(data={"num_clients": 4})
    raw["resources"] = {"server_cpus": 0.5, "client_cpus": 1.0, "client_workers": 2}
    cfg = validate(raw)
    assert cfg.resources.bundles(4) == [{"CPU": 1.5}, {"CPU": 1.0}]
    (msg,) = check_fits(cfg, 2.0, 0.0, None, "f.yaml")
    assert msg == ("f.yaml: resources.client_cpus: one trial needs server_cpus + 2 client workers × client_cpus = 0.5 + 2 × 1 = "
                   "2.5 CPUs, but the cluster has 2; allowed: client_cpus <= 0.75 (or fewer client_workers)")
    raw["resources"] = {"server_cpus": 0.5, "client_cpus": 0.5, "client_workers": 4}
    (msg,) = check_fits(validate(raw), 4.0, 0.0, 1000.0, "f.yaml")
    assert msg == ("f.yaml: resources.actor_memory_mb: one trial starts 5 processes × 300 MB = 1500 MB, more than "
                   "this machine's 1000 MB; allowed: resources.client_workers <= 2")


@pytest.mark.ray
def test_a_large_shared_payload_goes_to_the_object_store_once_per_round(ray_session):
    """Every ClientActor of a round gets the same object-store object for a large shared payload (put once);
    a small one rides in the calls; clients with payloads of their own get them inside the call."""
    from actors.server import INLINE_PAYLOAD_BYTES, RayCalls

    small = {"params": np.zeros(INLINE_PAYLOAD_BYTES // 4, np.float32)}
    large = {"params": np.zeros(INLINE_PAYLOAD_BYTES // 4 + 1, np.float32)}
    calls = RayCalls()
    assert calls.pack(dict.fromkeys([0, 1], small), [0, 1]) == ("shared", small, [0, 1])
    first = calls.pack(dict.fromkeys([0, 1, 2], large), [0, 1])
    again = calls.pack(dict.fromkeys([0, 1, 2], large), [2])
    assert isinstance(first[1], ray_session.ObjectRef) and again[1] is first[1]
    own = {0: {"params": small["params"]}, 1: {"params": small["params"] + 1}}
    assert calls.pack(own, [0, 1]) == ("each", own)
