"""ClientActor: a Ray actor hosting one client (or ``clients_per_actor`` packed clients), each with its shard,
its state across rounds and its model, on the actor's device."""

from __future__ import annotations

import os

import ray
import torch

from fedsweep.algorithms.base import ClientData, ClientMessage
from fedsweep.config import ExperimentConfig
from fedsweep.evaluation import ClientEval
from fedsweep.federation import Client, ClientSnapshot, Payload, train_clients


@ray.remote(num_cpus=0)
class ClientActor:
    """Wraps :class:`fedsweep.federation.Client` objects; resources are set by ``.options()`` from the trial's bundle.

    Packed clients train one after the other inside the actor, or as one stacked computation with
    ``resources.vectorize_clients``; parallelism across actors comes from Ray.
    """

    def __init__(self, shards: dict[int, ClientData], cfg: ExperimentConfig, num_features: int, num_classes: int):
        # One intra-op thread: an actor holds a fraction of a CPU, and many share the node.
        torch.set_num_threads(1)
        use_gpu = cfg.resources.client_gpus > 0 and torch.cuda.is_available()
        device = "cuda" if use_gpu else "cpu"
        self.clients = {i: Client(i, d, cfg, num_features, num_classes, device) for i, d in shards.items()}

    def train(self, payload: Payload, rnd: int, client_ids: list[int]) -> list[ClientMessage]:
        return train_clients([self.clients[i] for i in client_ids], payload, rnd)

    def evaluate(self, payload: Payload, rnd: int) -> list[ClientEval]:
        return [c.evaluate(payload, rnd) for c in self.clients.values()]

    def get_states(self, client_ids: list[int]) -> list[Payload | None]:
        return [self.clients[i].get_state() for i in client_ids]

    def snapshot(self) -> dict[int, ClientSnapshot]:
        return {i: c.snapshot() for i, c in self.clients.items()}

    def load(self, snapshots: dict[int, ClientSnapshot]) -> None:
        for i, snap in snapshots.items():
            self.clients[i].load(snap)

    def info(self) -> list[dict]:
        """Where each hosted client runs: pid, torch device, the GPUs Ray assigned and CUDA_VISIBLE_DEVICES."""
        common = {
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
        return [{"client_id": i, "device": str(c.device), **common} for i, c in self.clients.items()]
