"""Per-client scores and their summary over clients, computed from the data of every client."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch


@dataclass
class ClientEval:
    """Sums over one client's data, so that any mean over clients or samples can be formed exactly."""

    client_id: int
    num_train: int
    num_test: int
    personalized_correct: int
    personalized_loss_sum: float
    global_correct: int
    global_loss_sum: float
    train_loss_sum: float
    times_trained: int = 0

    @property
    def personalized_accuracy(self) -> float:
        return self.personalized_correct / self.num_test

    @property
    def global_accuracy(self) -> float:
        return self.global_correct / self.num_test

    def row(self) -> dict:
        d = asdict(self)
        d["personalized_accuracy"] = self.personalized_accuracy
        d["global_accuracy"] = self.global_accuracy
        return d


@torch.no_grad()
def score(predict: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor, chunk: int = 4096) -> tuple[int, float]:
    """(number correct, summed cross-entropy) of the class scores ``predict(x)`` on (x, y)."""
    correct, loss = 0, 0.0
    for i in range(0, y.shape[0], chunk):
        logits = predict(x[i : i + chunk])
        yy = y[i : i + chunk]
        correct += int((logits.argmax(dim=1) == yy).sum())
        loss += float(torch.nn.functional.cross_entropy(logits, yy, reduction="sum"))
    return correct, loss


def summarize(evals: list[ClientEval]) -> dict[str, float]:
    """Metrics of one evaluation round.

    ``*_mean``: unweighted mean over clients; ``*_weighted``: weighted by each
    client's test-sample count (= accuracy on the union of the test sets);
    worst / best / p10: minimum, maximum and 10th percentile of the per-client
    personalized accuracies; ``global_*``: the global model on the union of the
    test sets; ``train_loss``: the global model on the union of the training sets.
    """
    acc = np.array([e.personalized_accuracy for e in evals])
    loss = np.array([e.personalized_loss_sum / e.num_test for e in evals])
    n_test = np.array([e.num_test for e in evals], dtype=np.float64)
    n_train = sum(e.num_train for e in evals)
    total_test = n_test.sum()
    return {
        "personalized_accuracy_mean": float(acc.mean()),
        "personalized_accuracy_weighted": float(sum(e.personalized_correct for e in evals) / total_test),
        "personalized_accuracy_worst": float(acc.min()),
        "personalized_accuracy_best": float(acc.max()),
        "personalized_accuracy_p10": float(np.percentile(acc, 10)),
        "personalized_loss_mean": float(loss.mean()),
        "personalized_loss_weighted": float(sum(e.personalized_loss_sum for e in evals) / total_test),
        "global_accuracy": float(sum(e.global_correct for e in evals) / total_test),
        "global_loss": float(sum(e.global_loss_sum for e in evals) / total_test),
        "train_loss": float(sum(e.train_loss_sum for e in evals) / n_train),
    }
