"""ServerActor: builds the federated dataset, starts the ClientActors (one per client, or ``clients_per_actor``
clients each) in the trial's placement group, and runs rounds: sample ⌈r·n⌉ clients, one ``ray.put``
broadcast, aggregate, evaluate on the cadence."""

from __future__ import annotations

import ray
import torch
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.client import ClientActor
from fedsweep.algorithms.base import ClientMessage
from fedsweep.config import ExperimentConfig
from fedsweep.data import build_federated_dataset
from fedsweep.evaluation import ClientEval
from fedsweep.federation import Payload, Server


class RayPool:
    """The client pool of :class:`fedsweep.federation.Server`, backed by ClientActors.

    ``hosts[a]`` lists the client ids actor ``a`` holds. A round makes one call per actor that
    holds a sampled client; replies come back in the order of ``client_ids``, so aggregation
    sums in the same order as in-process (identical numbers, whatever the packing).
    """

    def __init__(self, actors: list, hosts: list[list[int]]):
        self.actors = actors
        self.actor_of = {c: a for a, ids in enumerate(hosts) for c in ids}

    def _by_actor(self, client_ids: list[int]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for c in client_ids:
            groups.setdefault(self.actor_of[c], []).append(c)
        return groups

    def train(self, client_ids: list[int], payload: Payload, rnd: int) -> list[ClientMessage]:
        ref = ray.put(payload)  # one object per round, read by every actor
        groups = self._by_actor(client_ids)
        replies = ray.get([self.actors[a].train.remote(ref, rnd, ids) for a, ids in groups.items()])
        by_client = {m.client_id: m for msgs in replies for m in msgs}
        return [by_client[c] for c in client_ids]

    def evaluate(self, payload: Payload, rnd: int) -> list[ClientEval]:
        ref = ray.put(payload)
        return [e for evals in ray.get([a.evaluate.remote(ref, rnd) for a in self.actors]) for e in evals]

    def states(self, client_ids: list[int]) -> list:
        groups = self._by_actor(client_ids)
        replies = ray.get([self.actors[a].get_states.remote(ids) for a, ids in groups.items()])
        by_client = {c: st for ids, sts in zip(groups.values(), replies) for c, st in zip(ids, sts)}
        return [by_client[c] for c in client_ids]


@ray.remote(num_cpus=0)
class ServerActor:
    def __init__(self, cfg: ExperimentConfig, placement_group: PlacementGroup | None, first_client_bundle: int = 1):
        torch.set_num_threads(1)
        dataset = build_federated_dataset(cfg.data)
        self.cfg = cfg
        self.server = Server(cfg, dataset.num_features, dataset.num_classes)
        r = cfg.resources
        actors, hosts = [], []
        for a in range(r.num_client_actors(cfg.num_clients)):
            ids = r.clients_of_actor(a, cfg.num_clients)
            options: dict = {"num_cpus": r.client_cpus, "num_gpus": r.client_gpus}
            if placement_group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group, placement_group_bundle_index=first_client_bundle + a
                )
            shards = {i: dataset.clients[i] for i in ids}
            actors.append(ClientActor.options(**options).remote(shards, cfg, dataset.num_features, dataset.num_classes))
            hosts.append(ids)
        self.pool = RayPool(actors, hosts)

    def clients_info(self) -> list[dict]:
        """Blocks until every client actor is constructed."""
        return [i for infos in ray.get([a.info.remote() for a in self.pool.actors]) for i in infos]

    def step(self, rnd: int) -> dict[str, float]:
        return self.server.step(self.pool, rnd)

    def client_table(self) -> list[dict]:
        return [e.row() for e in self.server.last_evals]

    def global_params(self):
        return self.server.params.numpy()

    def client_states(self, client_ids: list[int]) -> list:
        return self.pool.states(client_ids)

    def shutdown(self) -> None:
        for a in self.pool.actors:
            ray.kill(a)
