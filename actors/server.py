"""ServerActor: builds the federated dataset, starts one ClientActor per client in the trial's placement
group, and runs rounds: sample ⌈r·n⌉ clients, one ``ray.put`` broadcast, aggregate, evaluate on the cadence."""

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
    """The client pool of :class:`fedsweep.federation.Server`, backed by ClientActors."""

    def __init__(self, actors: list):
        self.actors = actors

    def train(self, client_ids: list[int], payload: Payload, rnd: int) -> list[ClientMessage]:
        ref = ray.put(payload)  # one object per round, read by every sampled client
        return ray.get([self.actors[i].train.remote(ref, rnd) for i in client_ids])

    def evaluate(self, payload: Payload, rnd: int) -> list[ClientEval]:
        ref = ray.put(payload)
        return ray.get([a.evaluate.remote(ref, rnd) for a in self.actors])


@ray.remote(num_cpus=0)
class ServerActor:
    def __init__(self, cfg: ExperimentConfig, placement_group: PlacementGroup | None, first_client_bundle: int = 1):
        torch.set_num_threads(1)
        dataset = build_federated_dataset(cfg.data)
        self.cfg = cfg
        self.server = Server(cfg, dataset.num_features, dataset.num_classes)
        r = cfg.resources
        actors = []
        for i, shard in enumerate(dataset.clients):
            options: dict = {"num_cpus": r.client_cpus, "num_gpus": r.client_gpus}
            if placement_group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group, placement_group_bundle_index=first_client_bundle + i
                )
            actors.append(
                ClientActor.options(**options).remote(i, shard, cfg, dataset.num_features, dataset.num_classes)
            )
        self.pool = RayPool(actors)

    def clients_info(self) -> list[dict]:
        """Blocks until every client actor is constructed."""
        return ray.get([a.info.remote() for a in self.pool.actors])

    def step(self, rnd: int) -> dict[str, float]:
        return self.server.step(self.pool, rnd)

    def client_table(self) -> list[dict]:
        return [e.row() for e in self.server.last_evals]

    def global_params(self):
        return self.server.params.numpy()

    def client_states(self, client_ids: list[int]) -> list:
        return ray.get([self.pool.actors[i].get_state.remote() for i in client_ids])

    def shutdown(self) -> None:
        for a in self.pool.actors:
            ray.kill(a)
