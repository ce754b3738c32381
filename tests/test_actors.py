"""The actor path on a real local Ray instance: same numbers as the in-process reference, deterministic,
placed in its placement group, and FedAvg still equal to centralized gradient descent."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedsweep.engine import run_local
from fedsweep.experiment import ExperimentRunner, InProcessRunner, execute, round_spans, runs_in_process
from fedsweep.layout import auto_layout
from fedsweep.loading import validate
from tests.conftest import config_dict
from tests.test_federation import centralized_gd, gd_config

pytestmark = pytest.mark.ray

# The ServerActor and one ClientActor hosting the 3 clients: for tests whose subject (the server's stop rules, its
# pipelining, the placement group, the payload's way) does not depend on how many client processes there are.
ONE_CLIENT_ACTOR = {"clients_per_actor": 3}


def run_actors(cfg, after=lambda runner: None):
    """(history, final global vector, clients_info, client table) of ``cfg`` run on actors; ``after(runner)``
    looks at the actors once the rounds are done."""
    runner = ExperimentRunner(cfg)
    try:
        runner.start()
        history = list(runner.rounds())
        params = torch.tensor(__import__("ray").get(runner.server.global_params.remote()))
        after(runner)
        return history, params, runner.clients_info, runner.client_table()
    finally:
        runner.stop()


def test_a_local_instance_starts_its_dashboard_agent_on_a_free_port_when_52365_is_held():
    """Ray's agent binds 52365 unless told otherwise and retries it for 3.3 s when another local instance holds it
    (the suite's workers side by side, two sweeps at once); ``start_local_ray`` (``connect_ray``'s local instance)
    gives it a free port at once, and starts no autoscaler monitor (whose end took a second of every command's), no API
    server (without the dashboard it serves only usage stats), nor, with ``log_to_driver=False``, a log monitor (which
    publishes worker output to drivers)."""
    code = ("import ray; from fedsweep.experiment import start_local_ray; start_local_ray(num_cpus=1, log_to_driver=False); "
            "node = ray._private.worker.global_worker.node; "
            "assert not {'monitor', 'log_monitor', 'dashboard'} & set(node.all_processes), node.all_processes; "
            "assert ray._private.node.Node.start_api_server.__name__ == 'start_api_server'; "  # Ray's own, put back
            "print(node.dashboard_agent_listen_port, node.get_logs_dir_path())")
    with socket.socket() as held:
        try:
            held.bind(("", 52365))
            held.listen()
        except OSError:  # held already, by another instance's agent
            pass
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    port, logs = out.stdout.split()[-2:]
    assert int(port) not in (0, 52365)
    agent_log = (Path(logs) / "dashboard_agent.log").read_text()
    assert "Dashboard agent grpc address" in agent_log and "Failed to bind" not in agent_log


def strip_time(history):
    return [{k: v for k, v in h.items() if k != "wall_time_s"} for h in history]


def test_fedavg_on_actors_follows_centralized_gd(ray_session):
    cfg = gd_config({"name": "mlp", "hidden": [8]}, rounds=5)
    ref = centralized_gd(cfg, 5)
    runner = ExperimentRunner(cfg)
    try:
        runner.start()
        rounds = runner.rounds()
        next(rounds)  # round 0: evaluation only
        for rnd in range(1, 6):
            next(rounds)
            w = torch.tensor(ray_session.get(runner.server.global_params.remote()))
            assert (w - ref[rnd - 1]).abs().max() < 1e-5, rnd
    finally:
        runner.stop()


def test_actor_path_matches_in_process_and_repeats_exactly(ray_session):
    cfg = validate(config_dict(algorithm={"participation_rate": 0.6, "personalization_lr": 0.05}, rounds=4, eval_every=2))
    first, params1, info, table = run_actors(cfg)
    local, server = run_local(cfg)
    assert strip_time(first) == local  # actors only move tensors: identical to the in-process loop
    # a second run on fresh actors, its rounds pipelined (the next sent before reading one): the same numbers again
    assert strip_time(execute(cfg, logger=None)) == local
    assert torch.equal(params1, server.params)
    # One actor per client, each in its own process, on the CPU.
    assert [i["client_id"] for i in info] == [0, 1, 2]
    assert len({i["pid"] for i in info}) == 3 and {i["device"] for i in info} == {"cpu"}
    # The per-client table is the last evaluation, from data.
    assert [r["client_id"] for r in table] == [0, 1, 2]
    assert sum(r["personalized_correct"] for r in table) / sum(r["num_test"] for r in table) == pytest.approx(
        first[-1]["personalized_accuracy_weighted"]
    )
    assert sum(r["times_trained"] for r in table) == 4 * 2  # ceil(0.6 × 3) = 2 per round


def test_a_one_process_layout_runs_in_process_with_the_actor_paths_numbers(ray_session):
    """The layout chosen for a file without one (here: a worker pool of one, clients stacked) is one process:
    ``fedsweep run`` runs the ServerActor's class in its own process. Same numbers, clients and table as the
    ServerActor on Ray; the process's torch thread count comes back after the run."""
    raw = config_dict(algorithm={"participation_rate": 0.6}, rounds=5, eval_every=2)
    cfg = validate(auto_layout({**raw, "resources": {}}, cpus=2))
    assert cfg.resources.client_workers == 1 and cfg.resources.vectorize_clients and runs_in_process(cfg)
    on_ray, params, info, table = run_actors(cfg)
    threads = torch.get_num_threads()
    runner = InProcessRunner(cfg)
    history = execute(cfg, logger=None, runner=runner)
    assert torch.get_num_threads() == threads and runner.server is None
    assert strip_time(history) == strip_time(on_ray)
    here = InProcessRunner(cfg)
    try:
        here.start()
        assert strip_time(list(here.rounds(pipelined=True))) == strip_time(on_ray)
        assert here.client_table() == table and torch.equal(torch.tensor(here.server.global_params()), params)
        assert [(i["client_id"], i["device"]) for i in here.clients_info] == [(i["client_id"], i["device"]) for i in info]
        (row,) = here.placement()  # this process (its node: this test's Ray node; None where no Ray runs)
        assert row == {"process": "server", "node_id": ray_session.get_runtime_context().get_node_id(), "pid": os.getpid(),
                       "clients": [0, 1, 2], "channel": None}
    finally:
        here.stop()
    # Anything with a process to place, or a cluster to join, runs on Ray.
    for resources in ({"server_cpus": 0.2, "client_cpus": 0.1}, {"client_workers": 2, "client_cpus": 0.5},
                      {"client_workers": 1, "ray_address": "127.0.0.1:6379"}):
        assert not runs_in_process(validate(config_dict(resources={"_replace": True, **resources}))), resources


@pytest.mark.parametrize("vectorize", [False, True])
def test_packed_clients_give_the_same_numbers(ray_session, vectorize):
    """clients_per_actor = 2: 3 clients in 2 actor processes, numbers identical to the in-process loop
    (which stacks the same clients together when vectorized: r = 1, so clients 0 and 1 train together)."""
    raw = config_dict(algorithm={"participation_rate": 1.0, "personalization_lr": 0.05}, rounds=4, eval_every=2)
    raw["resources"].update(clients_per_actor=2, vectorize_clients=vectorize)
    cfg = validate(raw)
    packed, params, info, table = run_actors(cfg)
    local, server = run_local(cfg)
    assert strip_time(packed) == local
    assert torch.equal(params, server.params)
    pids = [i["pid"] for i in info]
    assert [i["client_id"] for i in info] == [0, 1, 2]
    assert pids[0] == pids[1] != pids[2]  # clients 0 and 1 share an actor, client 2 has its own
    assert [r["client_id"] for r in table] == [0, 1, 2]


def test_a_payload_rides_in_the_calls_when_small_and_is_put_once_when_large(ray_session):
    from actors.server import INLINE_PAYLOAD_BYTES, RayCalls

    small = {"params": np.zeros(INLINE_PAYLOAD_BYTES // 4, np.float32)}
    large = {"params": np.zeros(INLINE_PAYLOAD_BYTES // 4 + 1, np.float32)}
    assert RayCalls.broadcast(small) is small
    assert isinstance(RayCalls.broadcast(large), ray_session.ObjectRef)
    # MLP 64-400-10: 30,010 parameters, 120 KB a broadcast: through the object store, the same numbers.
    cfg = validate(config_dict(model={"hidden": [400]}, algorithm={"participation_rate": 0.6}, rounds=2, eval_every=2,
                               resources=ONE_CLIENT_ACTOR))
    history, params, _, _ = run_actors(cfg)
    local, server = run_local(cfg)
    assert strip_time(history) == local
    assert torch.equal(params, server.params)


def test_placement_group_is_released(ray_session):
    from ray.util import placement_group_table

    cfg = validate(config_dict(rounds=1, resources=ONE_CLIENT_ACTOR))
    before = {k for k, v in placement_group_table().items() if v["state"] != "REMOVED"}
    execute(cfg, logger=None)
    after = {k for k, v in placement_group_table().items() if v["state"] != "REMOVED"}
    assert after == before


def test_divergence_stops_the_run(ray_session):
    cfg = validate(config_dict(algorithm={"local_lr": 1e30, "local_steps": 5}, rounds=6, eval_every=2, resources=ONE_CLIENT_ACTOR))
    history = execute(cfg, logger=None)
    assert history[-1].get("diverged") == 1.0
    assert len(history) < 7


def test_the_round_sent_ahead_of_a_diverged_one_does_nothing(ray_session):
    """Pipelined, round r + 1 is already on its way when round r's metrics say it diverged: the ServerActor
    must not run it, so the clients' training counts in the last evaluation are those of round r."""
    cfg = validate(config_dict(algorithm={"local_lr": 1e30, "local_steps": 5, "participation_rate": 0.6}, rounds=6, eval_every=6,
                               resources=ONE_CLIENT_ACTOR))
    runner = ExperimentRunner(cfg)
    try:
        runner.start()
        history = list(runner.rounds(pipelined=True))
        table = runner.client_table()
    finally:
        runner.stop()
    diverged = len(history) - 1
    assert history[-1].get("diverged") == 1.0 and diverged < 6
    assert sum(r["times_trained"] for r in table) == diverged * 2  # ceil(0.6 × 3) = 2 a round


def test_pipelined_rounds_reach_the_server_actor_one_call_per_evaluation_interval():
    """Round 0, round 1 (so that a user sees it end), then each call up to the next evaluation or checkpoint
    round; a resumed run starts its calls at its first round; unpipelined, one call per round."""
    evaluations = {0, 10, 20, 25}
    assert round_spans(0, 25, evaluations | {5, 15}) == [(0, 0), (1, 1), (2, 5), (6, 10), (11, 15), (16, 20), (21, 25)]
    assert round_spans(7, 25, evaluations) == [(7, 7), (8, 10), (11, 20), (21, 25)]
    assert round_spans(0, 2, None) == [(0, 0), (1, 1), (2, 2)]


def test_pipelined_rounds_wait_for_a_checkpoint(ray_session):
    """The checkpoint of round 2 holds the state after round 2, not after round 3 (sent ahead otherwise)."""
    cfg = validate(config_dict(algorithm={"participation_rate": 0.6}, rounds=5, eval_every=5, resources=ONE_CLIENT_ACTOR))
    taken = []
    history = execute(cfg, None, checkpoint_every=2, on_checkpoint=lambda m, ckpt: taken.append(ckpt))
    assert [c["round"] for c in taken] == [2, 4]
    for ckpt in taken:
        _, server = run_local(validate({**cfg.model_dump(), "rounds": ckpt["round"]}))
        assert np.array_equal(ckpt["params"], server.params.numpy())
    assert strip_time(history) == run_local(cfg)[0]


@pytest.mark.parametrize(
    "algorithm, clients_per_actor",
    [
        ({"name": "scaffold", "local_lr": 0.1}, 1),
        ({"name": "scaffold", "local_lr": 0.1}, 3),
        ({"name": "pfldyn", "local_lr": 0.1, "regularization": 0.1, "transform": "maml", "personalization_lr": 0.05}, 1),
        ({"name": "feddeper", "local_lr": 0.1, "personalization_lr": 0.05}, 3),
    ],
)
def test_unsampled_clients_keep_their_state(ray_session, algorithm, clients_per_actor):
    """Client state (c_i, g_i or FedDeper's y_i) lives in the client actor and changes only in rounds the client is sampled,
    also when the actor hosts several clients and some of them are sampled."""
    from fedsweep.federation import Server

    cfg = validate(
        config_dict(
            algorithm={"_replace": True, **algorithm, "local_steps": 2, "batch_size": 8, "participation_rate": 0.5},
            data={"num_clients": 4, "partition": {"name": "iid"}},
            resources={"clients_per_actor": clients_per_actor},
            rounds=4,
            eval_every=4,
        )
    )
    reference = Server.of(cfg, 64, 10)
    runner = ExperimentRunner(cfg)
    try:
        runner.start()
        rounds = runner.rounds()
        next(rounds)
        states = lambda: ray_session.get(runner.server.client_states.remote([0, 1, 2, 3]))
        seen_unsampled = 0
        for rnd in range(1, 5):
            before = states()
            next(rounds)
            after = states()
            sampled = reference.sample(rnd)
            assert len(sampled) == 2
            for i in range(4):
                if i in sampled:
                    assert after[i] is not None and (before[i] is None or not all(np.array_equal(before[i][k], after[i][k]) for k in after[i]))
                else:
                    seen_unsampled += 1
                    assert (before[i] is None and after[i] is None) or all(np.array_equal(before[i][k], after[i][k]) for k in before[i])
        assert seen_unsampled == 8
    finally:
        runner.stop()


def _run_b_after_a(ray_session, a, b):
    """Run experiment ``a`` on fresh actors, then reset the same ServerActor to ``b``; the runner drives ``b``."""
    runner = ExperimentRunner(a)
    runner.start()
    list(runner.rounds())
    pids = {i["pid"] for i in runner.clients_info}
    ray_session.get(runner.server.reset.remote(b))
    runner.cfg = b
    return runner, pids


def _two_experiments():
    a = validate(config_dict(algorithm={"participation_rate": 0.6}, rounds=2, eval_every=2))
    b = validate(config_dict(
        seed=1,
        data={"partition": {"name": "label_skew", "classes_per_client": 3}},
        algorithm={"name": "scaffold", "local_lr": 0.05, "participation_rate": 0.6},
        rounds=4, eval_every=1,
    ))
    return a, b


def test_a_reset_server_runs_the_next_experiment_like_fresh_actors(ray_session):
    """Warm actors (a sweep's next trial of equal resources): the same numbers as fresh ones, no new process."""
    a, b = _two_experiments()
    runner, pids = _run_b_after_a(ray_session, a, b)
    try:
        history = list(runner.rounds())
        params = torch.tensor(ray_session.get(runner.server.global_params.remote()))
        info = ray_session.get(runner.server.clients_info.remote())
        table = runner.client_table()
    finally:
        runner.stop()
    local, server = run_local(b)
    assert strip_time(history) == local
    assert torch.equal(params, server.params)
    assert table == [e.row() for e in server.last_evals]  # b's shards (other partition) and b's states
    assert {i["pid"] for i in info} == pids


def _kill_a_client_actor_between_calls(ray_session, runner, row: int = 0) -> None:
    """SIGKILL the ClientActor of ``runner.clients_info[row]`` (client 0's by default) while no call runs,
    and wait until Ray has restarted it."""
    import os
    import signal

    victim = runner.clients_info[row]["pid"]
    os.kill(victim, signal.SIGKILL)  # between calls: no call sees it die
    deadline = time.time() + 60
    while time.time() < deadline:  # until Ray has restarted it (a new process answers)
        try:
            rows = ray_session.get(runner.server.clients_info.remote())  # a restarted actor has no rows (empty)
            if len(rows) <= row or rows[row]["pid"] != victim:
                return
        except ray_session.exceptions.RayError:  # down, or coming back
            pass
        time.sleep(0.2)
    raise AssertionError("the killed ClientActor was not restarted within 60 s")


def test_a_client_actor_restarted_after_a_reset_is_set_up_for_the_current_experiment(ray_session):
    """Ray restarts a dead ClientActor empty; its first call then fails as stale and the pool sets it up
    again for b, not a (an evaluation retries at once; a training call counts its clients as dropped that round)."""
    a, b = _two_experiments()
    runner, _ = _run_b_after_a(ray_session, a, b)
    try:
        rounds = runner.rounds()
        next(rounds)  # round 0 on every actor
        _kill_a_client_actor_between_calls(ray_session, runner)
        history = list(rounds)
        table = runner.client_table()
    finally:
        runner.stop()
    assert history[-1]["clients_dropped"] == 0 and history[-1]["clients_answered"] == history[-1]["clients_sampled"]

    def sizes(evals):
        return [(e.client_id, e.num_train, e.num_test) for e in evals]

    _, server_a = run_local(a)
    _, server_b = run_local(b)
    assert sizes(server_a.last_evals) != sizes(server_b.last_evals)  # the two partitions tell the shards apart
    # The final evaluation ran on b's shards on every actor, the restarted one included.
    assert [(r["client_id"], r["num_train"], r["num_test"]) for r in table] == sizes(server_b.last_evals)


def test_a_client_actor_restarted_in_its_first_experiment_gets_its_clients_latest_states_back(ray_session):
    """Dead between calls, a ClientActor comes back empty, so the pool notices it (its next call is stale) and
    sends its client's latest state (the pool's copy of round 1's, not a checkpoint's) with the next call that
    needs it, instead of going on with a fresh one."""
    _, b = _two_experiments()  # SCAFFOLD: every client keeps a control variate
    runner = ExperimentRunner(b)
    try:
        runner.start()
        rounds = runner.rounds()
        next(rounds), next(rounds)  # rounds 0 and 1 (clients 1 and 2 train in round 1)
        _kill_a_client_actor_between_calls(ray_session, runner, row=1)  # client 1's: its state lived there
        history = list(rounds)
    finally:
        runner.stop()
    assert sum(h["clients_restored"] for h in history) == 1  # client 1, one client per ClientActor
    unkilled = lambda h: [{k: v for k, v in m.items() if k not in ("wall_time_s", "clients_restored")} for m in h]
    assert unkilled(history) == unkilled(run_local(b)[0][2:])  # nothing lost: the numbers of a run without the kill


@pytest.mark.parametrize("resources", [{"clients_per_actor": 2}, {"client_workers": 2}])
def test_a_checkpoint_loaded_into_reset_actors_continues_with_the_same_numbers(ray_session, resources):
    """What a resumed trial does: actors holding fresh states (reset, as a new trial's) load round 2's
    checkpoint (SCAFFOLD: server and client control variates) and run rounds 3-4 with the numbers of a
    run never stopped. Client states live in the ClientActors, or in the ServerActor's worker pool."""
    cfg = validate(config_dict(
        data={"num_clients": 4},
        algorithm={"_replace": True, "name": "scaffold", "local_lr": 0.1, "local_steps": 2, "batch_size": 8,
                   "participation_rate": 0.5},
        resources=resources,
        rounds=4, eval_every=2,
    ))
    runner = ExperimentRunner(cfg)
    try:
        runner.start()
        rounds = runner.rounds()
        next(rounds), next(rounds), next(rounds)  # rounds 0-2
        checkpoint = runner.checkpoint(2)
        ray_session.get(runner.server.reset.remote(cfg))  # fresh states in the same processes
        start = runner.restore(checkpoint)
        history = list(runner.rounds(start))
        params = torch.tensor(ray_session.get(runner.server.global_params.remote()))
    finally:
        runner.stop()
    assert sum(state is not None for state, _ in checkpoint["clients"].values()) >= 2  # sampled by round 2
    local, server = run_local(cfg)
    assert start == 3 and strip_time(history) == local[3:]
    assert torch.equal(params, server.params)


def test_the_local_instances_network_ports_refuse_a_job_without_rays_token(ray_session):
    """Ray binds its agents' HTTP servers and its gRPC servers to the machine's address, not 127.0.0.1, whatever
    ``ray.init`` is told (``_node_ip_address`` moves none of them): what keeps a neighbour on the network from
    submitting a job to a local instance fedsweep starts is Ray's token authentication, on by default in Ray 2.60
    and never turned off here. A job posted to each listening agent without the token is refused."""
    import http.client
    import json
    import urllib.error
    import urllib.request

    import psutil

    agents = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "DashboardAgent" in p.name():
                agents += [c.laddr for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:  # a short-lived child (a worker Ray starts and stops) gone meanwhile
            continue
    host = socket.gethostbyname(socket.gethostname())
    answers = {}
    for addr in agents:
        request = urllib.request.Request(f"http://{host if addr.ip in ('0.0.0.0', '::') else addr.ip}:{addr.port}"
                                         "/api/job_agent/jobs/", data=json.dumps({"entrypoint": "echo x"}).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            answers[addr] = urllib.request.urlopen(request, timeout=5).status
        except urllib.error.HTTPError as e:
            answers[addr] = e.code
        except (http.client.HTTPException, OSError) as e:  # a gRPC port, which speaks no HTTP/1.1
            answers[addr] = type(e).__name__
    assert agents and 401 in answers.values(), answers  # the job agent: "Missing authentication token"
    assert not any(isinstance(code, int) and code < 400 for code in answers.values()), answers  # none took the job


@pytest.mark.parametrize("fault", [None, "clients_dropped", "clients_restored"])
def test_a_trial_that_lost_or_restored_clients_does_not_keep_its_actors_warm(fault):
    """Ray counts client_max_restarts over an actor's life: actors a fault restarted, kept for the next trial, would
    give it less than its own allowance. A trial whose rounds dropped or restored clients hands its actors back
    (the runner's stop without keep_warm); a clean one keeps them."""
    kept = []

    class Recording(InProcessRunner):
        def _call(self, method, *args):
            out = super()._call(method, *args)
            if method == "steps" and fault:
                for m in out:
                    m[fault] = 1.0 if m["round"] == 2 else 0.0
            return out

        def stop(self, keep_warm=False):
            kept.append(keep_warm)
            super().stop(keep_warm)

    cfg = validate(config_dict(rounds=3, eval_every=3))
    execute(cfg, None, runner=Recording(cfg))
    assert kept == [fault is None]
