"""ClientActor: one Ray actor per client, holding its shard, its state across rounds and its device."""

from __future__ import annotations

import os

import ray
import torch

from fedsweep.algorithms.base import ClientData, ClientMessage
from fedsweep.config import ExperimentConfig
from fedsweep.evaluation import ClientEval
from fedsweep.federation import Client, Payload


@ray.remote(num_cpus=0)
class ClientActor:
    """Wraps :class:`fedsweep.federation.Client`; resources are set by ``.options()`` from the trial's bundle."""

    def __init__(self, client_id: int, data: ClientData, cfg: ExperimentConfig, num_features: int, num_classes: int):
        # One intra-op thread: an actor holds a fraction of a CPU, and many share the node.
        torch.set_num_threads(1)
        use_gpu = cfg.resources.client_gpus > 0 and torch.cuda.is_available()
        self.client = Client(client_id, data, cfg, num_features, num_classes, "cuda" if use_gpu else "cpu")

    def train(self, payload: Payload, rnd: int) -> ClientMessage:
        return self.client.train(payload, rnd)

    def evaluate(self, payload: Payload, rnd: int) -> ClientEval:
        return self.client.evaluate(payload, rnd)

    def get_state(self) -> Payload | None:
        return self.client.get_state()

    def info(self) -> dict:
        """Where this client runs: pid, torch device, the GPUs Ray assigned and CUDA_VISIBLE_DEVICES."""
        return {
            "client_id": self.client.client_id,
            "pid": os.getpid(),
            "device": str(self.client.device),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
