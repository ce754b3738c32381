"""The conformance suite: every registered algorithm, driven by what it declares, with no hand list to edit.

A method registered with ``@register`` gets all of it: a checkpoint round trip bit for bit, unsampled (unplanned)
clients keep their states, stacked = one by one where it declares it can stack (and the config refuses stacking
where it cannot), its reduction to FedAvg where it declares one, transmissions equal to the floats of the payloads
and messages actually sent, and (on Ray) the same numbers in process and on actors.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedsweep import checkpoint as checkpoint_files
from fedsweep.algorithms import ALGORITHMS
from fedsweep.engine import Engine, run_local
from fedsweep.federation import compute_threads
from fedsweep.loading import validate
from fedsweep.storage import Storage
from tests.conftest import config_dict, stacked, with_resources

NAMES = sorted(ALGORITHMS)


def config(name: str, rounds: int = 4, norm: str = "none", **algorithm):
    """A tiny experiment every algorithm can run: 4 digits clients, half sampled each round, an MLP (with batch
    normalization: ``norm="batch"``)."""
    return validate(config_dict(
        data={"num_clients": 4},
        model={"name": "mlp", "hidden": [8], "norm": norm},
        algorithm={"_replace": True, "name": name, "local_steps": 2, "batch_size": 8, "participation_rate": 0.5, **algorithm},
        rounds=rounds, eval_every=2,
    ))


def stacks(name: str) -> bool:
    """Whether ``name`` declares that its clients can train as one stacked computation."""
    return ALGORITHMS[name](config(name).algorithm).can_vectorize()


def equal_states(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and a.keys() == b.keys()
                                         and all(np.array_equal(a[k], b[k]) for k in a))


def test_every_module_of_the_package_registers_what_it_defines():
    assert {"fedavg", "fedper", "fedamp", "local"} <= set(ALGORITHMS)
    for name, cls in ALGORITHMS.items():
        assert cls.name == name and cls.Params.model_fields["name"].default == name


def resumed_run(cfg, tmp_path) -> tuple[list[dict], Engine]:
    """Two rounds, a checkpoint through the storage, a fresh engine restored from it, the remaining rounds: the
    history (without wall times) and the restored engine."""
    with compute_threads():
        first = Engine(cfg)
        history = [m for r in range(3) for m in first.steps(r, r, 1)]
        storage = Storage(str(tmp_path))
        checkpoint_files.save_latest(first.checkpoint(2), storage, storage.path("trial"))
        saved, _ = checkpoint_files.load_latest(storage, storage.path("trial"))
        second = Engine(cfg)
        start = second.restore(saved)
        history += [m for r in range(start, cfg.rounds + 1) for m in second.steps(r, r, start)]
    for m in history:
        m.pop("wall_time_s")
    return history, second


@pytest.mark.parametrize("name", NAMES)
def test_a_checkpoint_round_trip_is_bit_for_bit(name, tmp_path):
    """Two rounds, a checkpoint through the storage, a fresh engine restored from it, two more rounds: the
    uninterrupted run's numbers and states exactly."""
    cfg = config(name)
    reference, server = run_local(cfg)
    history, second = resumed_run(cfg, tmp_path)
    assert history == reference
    assert torch.equal(second.server.params, server.params)
    with compute_threads():
        uninterrupted = Engine(cfg)
        for r in range(cfg.rounds + 1):
            uninterrupted.steps(r, r, 1)
    ids = list(range(4))
    assert all(equal_states(a, b) for a, b in zip(second.pool.states(ids), uninterrupted.pool.states(ids)))


@pytest.mark.parametrize("name", NAMES)
def test_clients_that_do_not_train_keep_their_state(name):
    with compute_threads():
        engine = Engine(config(name))
        server, pool = engine.server, engine.pool
        for rnd in range(1, 5):
            before = pool.snapshot()
            trained = set(server.algorithm.plan_round(server.sample(rnd), 4).train)
            server.train_round(pool, rnd)
            after = pool.snapshot()
            for c in range(4):
                if c not in trained:
                    assert after[c][1] == before[c][1] and equal_states(after[c][0], before[c][0]), (rnd, c)
                else:
                    assert after[c][1] == before[c][1] + 1


def exactly(history: list[dict]) -> str:
    """A history as text with every float's shortest exact repr (NaN equal to NaN): equal text, equal bits."""
    return json.dumps([{k: v for k, v in m.items() if k != "wall_time_s"} for m in history], sort_keys=True)


@pytest.mark.parametrize("name", NAMES)
def test_stacked_training_equals_one_by_one_where_declared(name):
    cfg = config(name)
    if not stacks(name):
        raw = cfg.model_dump()
        raw["resources"]["vectorize_clients"] = True
        with pytest.raises(Exception, match="vectorize_clients"):
            validate(raw)
        return
    (one, s1), (many, s2) = run_local(cfg), run_local(stacked(cfg))
    assert torch.allclose(s1.params, s2.params, atol=1e-5)
    for a, b in zip(one, many):
        assert a.keys() == b.keys()
        assert all(np.isclose(a[k], b[k], atol=1e-4, equal_nan=True) for k in a), a["round"]


@pytest.mark.parametrize("name", NAMES)
def test_the_same_seed_repeats_bit_for_bit_in_process(name):
    """Same seed, same config -> the same numbers: every round's metrics and the final global vector of two runs,
    one by one and (where declared) stacked. The Ray paths are checked against these runs below."""
    cfg = config(name)
    for c in [cfg, stacked(cfg)] if stacks(name) else [cfg]:
        (h1, s1), (h2, s2) = run_local(c), run_local(c)
        assert exactly(h1) == exactly(h2)
        assert torch.equal(s1.params, s2.params)


@pytest.mark.parametrize("name", NAMES)
def test_the_one_process_path_repeats_the_in_process_numbers(name):
    """The path of ``fedsweep run`` and of every trial whose layout is one process (``make demo``'s: the ServerActor's
    class in the calling process, a worker pool of one, no Ray; ``fedsweep.experiment.InProcessRunner``), stacked
    where the algorithm declares it (the automatic layout's choice for an MLP, but for the proto transform, which it
    leaves one by one) and one by one: twice each, every round's metrics and the global vector bit for bit those of
    ``run_local``."""
    from fedsweep.experiment import InProcessRunner, one_process

    for vectorize in [False, True] if stacks(name) else [False]:
        c = with_resources(config(name), server_cpus=0.2, client_cpus=0.8, client_workers=1, vectorize_clients=vectorize)
        assert one_process(c)
        local, server = run_local(c)
        for _ in range(2):
            runner = InProcessRunner(c)
            try:
                runner.start()
                assert exactly(list(runner.rounds(pipelined=True))) == exactly(local), (name, vectorize)
                assert np.array_equal(runner.server.global_params(), server.params.numpy()), (name, vectorize)
            finally:
                runner.stop()


@pytest.mark.parametrize("name", [n for n in NAMES if ALGORITHMS[n].fedavg_reduction is not None])
def test_the_declared_reduction_to_fedavg_holds(name):
    fedavg = config("fedavg", local_lr=0.1)
    reduced = config(name, local_lr=0.1, **ALGORITHMS[name].fedavg_reduction)
    (_, a), (_, b) = run_local(fedavg), run_local(reduced)
    assert (a.params - b.params).abs().max() < 1e-6


class Recording:
    """A pool that counts the floats of every payload it is given and of every message it returns."""

    def __init__(self, pool, aggregated):
        self.pool, self.aggregated = pool, aggregated
        self.down = self.up = 0

    def train(self, payloads, rnd):
        self.down += sum(int(np.asarray(v).size) for p in payloads.values() for v in p.values())
        replies = self.pool.train(payloads, rnd)
        self.up += sum(int(np.asarray(v).size) for m in replies if m.client_id in self.aggregated for v in m.payload.values())
        return replies


@pytest.mark.parametrize("name", NAMES)
def test_transmissions_are_the_floats_sent(name):
    with compute_threads():
        engine = Engine(config(name))
        server = engine.server
        down = up = 0
        for rnd in (1, 2, 3):
            recording = Recording(engine.pool, set(server.algorithm.plan_round(server.sample(rnd), 4).aggregate))
            server.train_round(recording, rnd)
            down, up = down + recording.down, up + recording.up
        m = server.transmissions()
    assert (m["floats_down"], m["floats_up"]) == (down, up)
    assert m["transmissions"] == pytest.approx((down + up) / server.model_floats)


@pytest.mark.parametrize("name", NAMES)
def test_global_metrics_exist_exactly_when_there_is_a_global_model(name):
    history, server = run_local(config(name, rounds=2))
    has_global = server.global_model() is not None
    assert ("global_accuracy" in history[-1]) == has_global == ("train_loss" in history[-1])
    assert "personalized_accuracy_mean" in history[-1]


@pytest.mark.ray
@pytest.mark.parametrize("layout", [{"clients_per_actor": 2}, {"clients_per_actor": 2, "vectorize_clients": True},
                                    {"client_workers": 2}], ids=["blocks", "blocks-stacked", "workers"])
def test_every_algorithm_gives_the_same_numbers_in_process_and_on_actors(ray_session, layout):
    """One ServerActor and two ClientActors, reset to each algorithm in turn (a sweep's warm actors), the clients in
    blocks of two (each always on its actor; one by one, or stacked by every algorithm that declares it can) or
    spread over a pool of two workers: every algorithm, run twice, gives the in-process run's history and global
    vector to the last bit; FedAvg and FedBN again on a model with batch normalization (statistics shared with the
    global model, or kept by each client)."""
    from fedsweep.experiment import ExperimentRunner

    def on_actors(cfg):
        return with_resources(cfg, **layout)

    names = [n for n in NAMES if not layout.get("vectorize_clients") or stacks(n)]
    models = [("fedavg", "batch"), ("fedbn", "batch")] if not layout.get("vectorize_clients") else []
    runner = ExperimentRunner(on_actors(config(NAMES[0])))
    try:
        runner.start()
        for name, norm in [(n, "none") for n in names] + models:
            cfg = on_actors(config(name, norm=norm))
            local, server = run_local(cfg)
            for _ in range(2):
                ray_session.get(runner.server.reset.remote(cfg))
                runner.cfg = cfg
                assert exactly(list(runner.rounds(pipelined=True))) == exactly(local), name
                assert np.array_equal(ray_session.get(runner.server.global_params.remote()), server.params.numpy()), name
    finally:
        runner.stop()


def test_stacked_training_takes_read_only_payloads_silently_with_the_same_numbers():
    """A payload that reaches a ClientActor through Ray's object store is a read-only array; stacking it must not
    make torch warn (it did, once per actor process, in every stacked trial's log) nor change a number."""
    import warnings

    from fedsweep.engine import local_federation
    from fedsweep.federation import train_group

    cfg = stacked(config("fedavg"))

    def trained(read_only: bool):
        server, pool = local_federation(cfg)
        ids = server.sample(1)
        payloads = server.payloads(ids)
        if read_only:
            for payload in payloads.values():
                for v in payload.values():
                    v.flags.writeable = False
        clients = [c for host in pool.hosts for cid, c in host.clients.items() if cid in ids]
        with compute_threads(), warnings.catch_warnings():
            warnings.simplefilter("error")
            return train_group(clients, payloads, 1, stacked=True)

    plain, frozen = trained(False), trained(True)
    assert len(plain) > 1 and all(np.array_equal(a.payload[k], b.payload[k]) for a, b in zip(plain, frozen) for k in a.payload)
