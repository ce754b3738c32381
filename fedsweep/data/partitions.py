"""Seeded splits of a pooled labelled dataset across clients.

Each function takes the label array and a ``numpy.random.Generator`` and
returns one array of sample indices per client; the indices of different
clients are disjoint.
"""

from __future__ import annotations

import numpy as np


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Uniformly shuffled samples dealt into ``num_clients`` near-equal parts."""
    return [np.sort(p) for p in np.array_split(rng.permutation(len(labels)), num_clients)]


def label_skew(
    labels: np.ndarray, num_clients: int, classes_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Each client holds exactly ``classes_per_client`` classes.

    Classes are dealt round-robin over a seeded permutation of the class list
    (client i gets classes perm[(i·k + j) mod C], j < k), so every class is held
    by some client whenever n·k ≥ C; each class's samples are shuffled and split
    evenly among the clients that hold it.
    """
    classes = np.unique(labels)
    if classes_per_client > len(classes):
        raise ValueError(f"classes_per_client={classes_per_client} exceeds the {len(classes)} classes")
    order = rng.permutation(classes)
    held = [[order[(i * classes_per_client + j) % len(classes)] for j in range(classes_per_client)] for i in range(num_clients)]
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in classes:
        holders = [i for i in range(num_clients) if c in held[i]]
        if not holders:
            continue
        members = rng.permutation(np.flatnonzero(labels == c))
        for i, chunk in zip(holders, np.array_split(members, len(holders))):
            parts[i].append(chunk)
    return [np.sort(np.concatenate(p)) for p in parts]


def train_test_split(indices: np.ndarray, test_fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A client's own random train/test split, with at least one sample on each side."""
    perm = rng.permutation(indices)
    n_test = min(max(1, int(round(test_fraction * len(perm)))), len(perm) - 1)
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])
