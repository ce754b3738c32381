"""FedProx's Synthetic(ᾱ, β̄) (Li et al., 2020, Sec. 5.1), as used by pFedMe.

For device k:
    u_k ~ N(0, ᾱ), B_k ~ N(0, β̄)
    W_k ∈ R^{C×d} with entries ~ N(u_k, 1), b_k ∈ R^C ~ N(u_k, 1)
    v_k ∈ R^d with entries ~ N(B_k, 1)
    x ~ N(v_k, Σ), Σ diagonal with Σ_jj = j^{-1.2}
    y = argmax softmax(W_k x + b_k)

ᾱ controls how much the local models differ, β̄ how much the local inputs differ.
Device sizes follow a power law: (⌊LogNormal(4, 2)⌋ + ``min_samples``) × ``size_multiplier`` (optionally
capped). FedProx uses multiplier 1; pFedMe's generator multiplies by 5, which gives the size range its
paper states for Synthetic(0.5, 0.5), [250, 25810].
"""

from __future__ import annotations

import numpy as np


def client_sizes(
    num_clients: int, rng: np.random.Generator, min_samples: int, max_samples: int | None, size_multiplier: int = 1
) -> np.ndarray:
    sizes = (rng.lognormal(4.0, 2.0, num_clients).astype(np.int64) + min_samples) * size_multiplier
    if max_samples is not None:
        sizes = np.minimum(sizes, max_samples)
    return sizes


def generate(
    num_clients: int,
    model_heterogeneity: float,
    data_heterogeneity: float,
    num_features: int,
    num_classes: int,
    min_samples: int,
    max_samples: int | None,
    rng: np.random.Generator,
    size_multiplier: int = 1,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """One (x, y) pair per device, float32 features and int64 labels."""
    sizes = client_sizes(num_clients, rng, min_samples, max_samples, size_multiplier)
    u = rng.normal(0.0, model_heterogeneity, num_clients)
    b_mean = rng.normal(0.0, data_heterogeneity, num_clients)
    std = np.power(np.arange(1, num_features + 1, dtype=np.float64), -1.2) ** 0.5
    out = []
    for k in range(num_clients):
        w = rng.normal(u[k], 1.0, (num_classes, num_features))
        b = rng.normal(u[k], 1.0, num_classes)
        v = rng.normal(b_mean[k], 1.0, num_features)
        x = v + std * rng.standard_normal((sizes[k], num_features))
        y = np.argmax(x @ w.T + b, axis=1)  # argmax of softmax = argmax of logits
        out.append((x.astype(np.float32), y.astype(np.int64)))
    return out
