"""One FedAvg run under Apple's pfl-research simulator, on shards and a plan exported by ``pfl_peer.py``
(``export_plan``; ``pfl_cifar.py`` uses it too).

Runs in pfl's own virtual environment (it imports numpy, torch and pfl only, not fedsweep):

    python benchmarks/pfl_run.py EXPORT_DIR --seed S --local-lr LR --rounds R [--threads N]

What it does is pfl's documented path for a PyTorch model: a ``PyTorchModel`` (local ``torch.optim.SGD``,
central ``SGD`` at learning rate 1, i.e. the weighted average of the local models), ``FederatedAveraging``, a
``SimulatedBackend`` over a ``FederatedDataset``, a weighting postprocessor and a ``CentralEvaluationCallback``
every ``--eval-every`` rounds on the union of the clients' test sets. To do the same arithmetic as fedsweep,
three inputs come from the export instead of pfl's own randomness: the initial parameters, the clients each
round samples (the user sampler walks the exported plan) and each sampled client's τ minibatches (its dataset
for that round holds exactly those samples in order, and pfl's local loop takes them as τ batches); each
update is weighted by the client's number of training samples, as fedsweep's ``aggregation: weighted``.

The model is the export's ``model.json`` (fedsweep's mlp or cnn, built layer for layer as fedsweep builds it).
Prints one JSON line: seconds spent importing, in ``algorithm.run`` (the rounds and pfl's evaluations) and in
the whole process until then, the median time of a round from the second on (pfl's own rounds, no evaluation;
``benchmarks/pfl_cifar.py`` reads it), the device and its peak memory, and the final global model's accuracy
and loss on the union of the test sets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

T0 = time.perf_counter()

import numpy as np
import torch
from pfl.aggregate.simulate import SimulatedBackend
from pfl.aggregate.weighting import WeightingStrategy
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.callback.central_evaluation import CentralEvaluationCallback
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.metrics import Metrics, Weighted
from pfl.model.pytorch import PyTorchModel

IMPORTED = time.perf_counter()


class Model(torch.nn.Sequential):
    """fedsweep's model of ``model.json`` (``mlp``: Linear, ReLU, ..., Linear; ``cnn``: fedsweep's ``_cnn``, the same
    layers in the same order, so the exported flat vector fits) with the two methods pfl's ``PyTorchModel`` calls."""

    def __init__(self, spec: dict):
        layers: list[torch.nn.Module] = []
        width = spec["inputs"]
        if spec["name"] == "cnn":
            c, side, _ = spec["image"]
            layers.append(torch.nn.Unflatten(1, (c, side, side)))
            for i, out in enumerate(spec["channels"]):
                pool = spec.get("pool", "each") == "each" or i == len(spec["channels"]) - 1
                layers += [torch.nn.Conv2d(c, out, spec["kernel_size"]), torch.nn.ReLU(), *([torch.nn.MaxPool2d(2)] if pool else [])]
                side, c = (side - spec["kernel_size"] + 1) // (2 if pool else 1), out
            layers.append(torch.nn.Flatten())
            width = c * side * side
        elif spec["name"] != "mlp" or spec.get("activation", "relu") != "relu":
            raise SystemExit(f"pfl_run.py builds fedsweep's relu mlp and cnn, not {spec}")
        if spec.get("norm", "none") != "none":
            raise SystemExit("pfl_run.py builds models without normalization layers")
        for h in spec["hidden"]:
            layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
            width = h
        super().__init__(*layers, torch.nn.Linear(width, spec["classes"]))

    def loss(self, x, y, eval=False):
        self.eval() if eval else self.train()
        return torch.nn.functional.cross_entropy(self(x), y)

    @torch.no_grad()
    def metrics(self, x, y, eval=True):
        self.eval() if eval else self.train()
        logits = self(x)
        n = len(y)
        return {"accuracy": Weighted(float((logits.argmax(1) == y).sum()), n),
                "loss": Weighted(float(torch.nn.functional.cross_entropy(logits, y, reduction="sum")), n)}


class Clock(TrainingProcessCallback):
    """The time at the end of each central iteration (after the callbacks listed before it)."""

    def __init__(self):
        self.times: list[float] = []

    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return False, Metrics()


class WeightByTrainSize(WeightingStrategy):
    """p_i ∝ n_i, the client's whole training set (its round dataset holds only the τ·B samples it trains on)."""

    def __init__(self, sizes: np.ndarray):
        self.sizes = sizes

    def postprocess_one_user(self, *, stats, user_context):
        stats.reweight(int(self.sizes[user_context.user_id[1]]))
        return stats, Metrics()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("export")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--local-lr", type=float, required=True)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    shards = np.load(f"{args.export}/shards.npz")
    plan = np.load(f"{args.export}/plan_seed{args.seed}.npz")
    offsets = np.concatenate([[0], np.cumsum(shards["n_train"])])
    x_train, y_train = torch.from_numpy(shards["x_train"]), torch.from_numpy(shards["y_train"])
    sampled, batches = plan["sampled"], plan["batches"]  # (R, k), (R, k, τ·B) indices into the client's shard
    rounds, k = sampled.shape[0], sampled.shape[1]
    assert args.rounds <= rounds, f"the export has a plan for {rounds} rounds"
    local_steps = int(plan["local_steps"])
    batch_size = batches.shape[2] // local_steps

    order = iter([(t, int(c)) for t in range(args.rounds) for c in sampled[t]])
    where = {(t, int(c)): j for t in range(args.rounds) for j, c in enumerate(sampled[t])}

    def make_dataset(user_id):
        t, c = user_id
        idx = torch.from_numpy(batches[t, where[user_id]]) + int(offsets[c])
        return Dataset(raw_data=[x_train[idx], y_train[idx]], user_id=user_id)

    module = Model(json.loads(Path(f"{args.export}/model.json").read_text()))
    torch.nn.utils.vector_to_parameters(torch.from_numpy(plan["initial"]), module.parameters())
    model = PyTorchModel(model=module, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0))
    test = Dataset(raw_data=[torch.from_numpy(shards["x_test"]), torch.from_numpy(shards["y_test"])])
    backend = SimulatedBackend(training_data=FederatedDataset(make_dataset, lambda: next(order)), val_data=None,
                               postprocessors=[WeightByTrainSize(shards["n_train"])])
    eval_params = NNEvalHyperParams(local_batch_size=None)

    clock = Clock()
    t1 = time.perf_counter()
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=args.rounds, evaluation_frequency=args.eval_every,
                                           train_cohort_size=k, val_cohort_size=0),
        backend=backend, model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=args.local_lr, local_num_epochs=None,
                                              local_num_steps=local_steps, local_batch_size=batch_size),
        model_eval_params=eval_params,
        callbacks=[CentralEvaluationCallback(test, model_eval_params=eval_params, frequency=args.eval_every), clock])
    t2 = time.perf_counter()
    with torch.no_grad():
        module.eval()
        x_test, y_test = (t.to(next(module.parameters()).device) for t in test.raw_data)
        logits = module(x_test)
        correct = int((logits.argmax(1) == y_test).sum())
        loss = float(torch.nn.functional.cross_entropy(logits, y_test))
    steps = [b - a for a, b in zip(clock.times, clock.times[1:])]  # rounds 2.., each its training alone
    print(json.dumps({"import_s": IMPORTED - T0, "run_s": t2 - t1, "process_s": t2 - T0,
                      "round_s_median": statistics.median(steps) if steps else None,
                      "device": str(next(module.parameters()).device),
                      "max_memory_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
                      "final_global_accuracy": correct / len(y_test), "final_global_loss": loss}))


if __name__ == "__main__":
    main()
