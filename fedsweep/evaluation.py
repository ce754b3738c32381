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
    #: the global model's sums; None for an algorithm without a global model (its global metrics are absent)
    global_correct: int | None
    global_loss_sum: float | None
    train_loss_sum: float | None
    times_trained: int = 0
    # the same sums on the client's validation part (none unless data.validation_fraction > 0)
    num_val: int = 0
    personalized_val_correct: int = 0
    personalized_val_loss_sum: float = 0.0
    global_val_correct: int | None = 0
    global_val_loss_sum: float | None = 0.0

    @property
    def personalized_accuracy(self) -> float:
        return self.personalized_correct / self.num_test

    @property
    def global_accuracy(self) -> float | None:
        return None if self.global_correct is None else self.global_correct / self.num_test

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


#: Prefix of the metrics computed on the clients' validation parts instead of their test parts.
VAL = "val_"


def _scores(n: list[int], correct: list[int], loss_sum: list[float], global_correct: list[int | None],
            global_loss_sum: list[float | None]) -> dict[str, float]:
    acc = np.array(correct) / np.array(n, dtype=np.float64)
    total = float(sum(n))
    out = {
        "personalized_accuracy_mean": float(acc.mean()),
        "personalized_accuracy_weighted": float(sum(correct) / total),
        "personalized_accuracy_worst": float(acc.min()),
        "personalized_accuracy_best": float(acc.max()),
        "personalized_accuracy_p10": float(np.percentile(acc, 10)),
        "personalized_loss_mean": float((np.array(loss_sum) / np.array(n, dtype=np.float64)).mean()),
        "personalized_loss_weighted": float(sum(loss_sum) / total),
    }
    if None not in global_correct:
        out.update(global_accuracy=float(sum(global_correct) / total), global_loss=float(sum(global_loss_sum) / total))
    return out


def summarize(evals: list[ClientEval]) -> dict[str, float]:
    """Metrics of one evaluation round.

    ``*_mean``: unweighted mean over clients; ``*_weighted``: weighted by each
    client's test-sample count (= accuracy on the union of the test sets);
    worst / best / p10: minimum, maximum and 10th percentile of the per-client
    personalized accuracies; ``global_*``: the global model on the union of the
    test sets; ``train_loss``: the global model on the union of the training sets (both absent for an
    algorithm without a global model). With validation parts, ``val_*``: the same scores on them instead of
    the test sets.
    """
    out = _scores([e.num_test for e in evals], [e.personalized_correct for e in evals],
                  [e.personalized_loss_sum for e in evals], [e.global_correct for e in evals],
                  [e.global_loss_sum for e in evals])
    if all(e.train_loss_sum is not None for e in evals):
        out["train_loss"] = float(sum(e.train_loss_sum for e in evals) / sum(e.num_train for e in evals))
    if all(e.num_val > 0 for e in evals):
        val = _scores([e.num_val for e in evals], [e.personalized_val_correct for e in evals],
                      [e.personalized_val_loss_sum for e in evals], [e.global_val_correct for e in evals],
                      [e.global_val_loss_sum for e in evals])
        out.update({VAL + k: v for k, v in val.items()})
    return out
