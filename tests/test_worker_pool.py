"""A worker pool (``resources.client_workers``): the ServerActor and W - 1 ClientActors share each round's
clients; the same numbers as the in-process loop, states kept by the ServerActor, validation before any Ray call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsweep.config import ConfigError, check_fits, validate
from fedsweep.federation import Client, Server, local_federation, run_local, train_from_snapshots
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


def test_training_from_snapshots_is_the_clients_own_training():
    """The plain-PyTorch step of a worker: load the sent state, train, return the new one; the same
    message and state as a client that kept its state itself."""
    cfg = pool_config(1, SCAFFOLD)
    server, pool = local_federation(cfg)
    kept = pool.clients[2]
    worker = {2: Client(2, kept.data, cfg, 64, 10)}
    payload = server.payload()
    held = (None, 0)
    for rnd in (1, 2, 3):
        expected = kept.train(payload, rnd)
        (message,), states = train_from_snapshots(worker, {2: held}, payload, rnd)
        held = states[2]
        assert message.client_id == 2 and message.stats == expected.stats
        assert all(np.array_equal(message.payload[k], expected.payload[k]) for k in expected.payload)
        assert held[1] == kept.times_trained == rnd
        assert all(np.array_equal(held[0][k], v.numpy()) for k, v in kept.state.items())


def served_by_sockets(ray_session, runner) -> list[int]:
    """Per ClientActor of ``runner``: requests it answered through its socket."""
    return ray_session.get([a.channel_served.remote() for a in runner.client_actors])


@pytest.mark.ray
@pytest.mark.parametrize("workers, algorithm, channel", [(1, None, "socket"), (3, PFEDME, "socket"), (2, SCAFFOLD, "ray")])
def test_a_worker_pool_gives_the_numbers_of_the_in_process_loop(ray_session, workers, algorithm, channel):
    """The same numbers whether the round's parts travel through the ClientActors' sockets or as Ray calls;
    with sockets every train and evaluate call of the pool goes through them."""
    cfg = pool_config(workers, algorithm, resources={"pool_channel": channel})
    served: list[int] = []
    history, params, info, table = run_actors(cfg, after=lambda runner: served.extend(served_by_sockets(ray_session, runner)))
    local, server = run_local(cfg)
    assert strip_time(history) == local
    assert torch.equal(params, server.params)
    assert table == [e.row() for e in server.last_evals]
    # W processes hold every client each, the ServerActor's rows first.
    pids = [i["pid"] for i in info]
    assert len(info) == 5 * workers and len(set(pids)) == workers
    assert [i["client_id"] for i in info] == list(range(5)) * workers
    assert len(set(pids[:5])) == 1
    # 4 rounds of training and 3 evaluations (rounds 0, 2, 4), one request each to each ClientActor
    assert served == ([4 + 3] * (workers - 1) if channel == "socket" else [0] * (workers - 1))


@pytest.mark.ray
def test_the_server_keeps_the_states_and_unsampled_clients_keep_theirs(ray_session):
    from ray.util.placement_group import placement_group_table

    from fedsweep.experiment import ExperimentRunner
    from fedsweep.federation import Server

    cfg = pool_config(2, SCAFFOLD, clients=4, rounds=4)
    reference = Server(cfg, 64, 10)
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
        served = served_by_sockets(ray_session, runner)
        table = runner.client_table()
    finally:
        runner.stop()
    # Killed between calls, it is found restarted and empty (stale) by round 2's call: that part of
    # round 2 is dropped; the ServerActor's part and every state survive, and later rounds are whole.
    assert history[2]["clients_dropped"] == 2  # 3 sampled of 4: parts of 2 (ClientActor) and 1
    assert [h["clients_dropped"] for h in history[3:]] == [0, 0]
    assert sum(h["clients_restored"] for h in history[1:]) == 0
    # the restarted process was set up and connected again: its socket served the evaluations of rounds 2
    # and 4 and the training of rounds 3 and 4
    assert served == [4]
    assert [r["client_id"] for r in table] == [0, 1, 2, 3]
    assert sum(r["times_trained"] for r in table) == sum(h["clients_answered"] for h in history[1:]) == 3 * 4 - 2


@pytest.mark.ray
def test_a_frozen_worker_past_the_timeout_is_left_out_and_its_late_reply_dropped(ray_session):
    """SIGSTOP the ClientActor over round 2 (round_timeout_s 1): its part of round 2 is dropped and those
    clients keep their states; resumed, it answers round 2's request late, the ServerActor drops that reply
    and reads round 3's own, so rounds 3-4 are whole. All through the socket."""
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
        served = served_by_sockets(ray_session, runner)
        table = runner.client_table()
    finally:
        runner.stop()
    assert history[2]["clients_dropped"] == 2  # 3 sampled of 4: the ClientActor's part of 2
    assert [h["clients_dropped"] for h in history[3:]] == [0, 0]
    remote_part = Server(cfg, 64, 10).sample(2)[:2]
    for c in remote_part:  # not trained in round 2: the state it had after round 1
        assert (before[c] is None and after[c] is None) or all(np.array_equal(before[c][k], after[c][k]) for k in before[c])
    assert history[2]["clients_evaluated"] == 2  # its evaluation timed out too, asked twice
    # answered, late or not: training in rounds 1-4, evaluation at rounds 0, 2 (twice) and 4
    assert served == [4 + 4]
    assert sum(r["times_trained"] for r in table) == 3 * 4 - 2
    assert np.isfinite(history[-1]["global_loss"])


@pytest.mark.ray
def test_a_client_actors_socket_serves_only_the_round_calls(ray_session):
    from actors.channel import Link
    from actors.client import CHANNEL_CALLS, ClientActor

    actor = ClientActor.remote()
    _, address, authkey = ray_session.get(actor.open_channel.remote())
    link = Link(address, authkey)
    try:
        with pytest.raises(ValueError, match="'snapshot' is not served on the socket; allowed: "
                                              r"\['evaluate_states', 'train_states'\]"):
            link.submit("snapshot", 0).result()
        assert CHANNEL_CALLS == {"train_states", "evaluate_states"}
    finally:
        link.close()
        ray_session.kill(actor)


def test_worker_pool_settings_are_checked_before_any_cluster_work():
    def problems(**resources):
        raw = config_dict(data={"num_clients": 4})
        raw["resources"] = {**raw["resources"], **resources}
        with pytest.raises(ConfigError) as err:
            validate(raw)
        return str(err.value)

    assert "client_workers=2 with clients_per_actor=2" in problems(client_workers=2, clients_per_actor=2)
    assert "allowed: client_gpus 0 with client_workers >= 1" in problems(client_workers=2, client_gpus=0.5)
    assert "resources.client_workers=5 is more workers than clients (data.num_clients=4); allowed: 0..4" in problems(client_workers=5)
    assert "resources.pool_channel: Input should be 'socket' or 'ray' (got 'pipe')" in problems(pool_channel="pipe")
    raw = config_dict(data={"num_clients": 4})
    raw["resources"] = {"server_cpus": 0.5, "client_cpus": 1.0, "client_workers": 2}
    cfg = validate(raw)
    assert cfg.resources.bundles(4) == [{"CPU": 1.5}, {"CPU": 1.0}]
    (msg,) = check_fits(cfg, 2.0, 0.0, None, "f.yaml")
    assert msg == ("f.yaml: resources: one trial needs server_cpus + 2 client workers × client_cpus = 0.5 + 2 × 1 = "
                   "2.5 CPUs, but the cluster has 2; allowed: client_cpus <= 0.75 (or fewer client_workers)")
    raw["resources"] = {"server_cpus": 0.5, "client_cpus": 0.5, "client_workers": 4}
    (msg,) = check_fits(validate(raw), 4.0, 0.0, 1000.0, "f.yaml")
    assert msg == ("f.yaml: resources.actor_memory_mb: one trial starts 5 processes × 300 MB = 1500 MB, more than "
                   "this machine's 1000 MB; allowed: resources.client_workers <= 2")


@pytest.mark.ray
def test_a_large_payload_goes_to_the_object_store_only_for_ray_calls(ray_session):
    """A large payload is put once per round, and only when some ClientActor is called through Ray: a pool of
    one, or a ClientActor with a socket (which gets the payload itself), puts nothing in the object store."""
    from actors.channel import Endpoint, Link
    from actors.server import INLINE_PAYLOAD_BYTES, WorkerPool

    large = {"params": np.zeros(INLINE_PAYLOAD_BYTES // 4 + 1, np.float32)}
    alone = WorkerPool({}, [], [])
    assert alone.train([], large, 1) == [] and alone._shared is None
    through_ray = WorkerPool({}, [object()], [()])
    ref = through_ray._for_ray(large)
    assert isinstance(ref, ray_session.ObjectRef) and through_ray._for_ray(large) is ref  # once per payload
    endpoint = Endpoint(lambda method, args: type(args[0]["params"]).__name__)
    through_socket = WorkerPool({}, [object()], [()], channel="socket")
    through_socket.links[0] = Link(endpoint.address, endpoint.authkey)
    try:
        assert through_socket._call(0, "train_states", large, 1).result() == "ndarray"
        assert through_socket._shared is None
    finally:
        through_socket.close()
        endpoint.close()
