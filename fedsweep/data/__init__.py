"""Federated datasets: the embedded defaults (Synthetic(ᾱ, β̄) and scikit-learn's digits) and their splits."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Literal

import numpy as np
import torch
from pydantic import Field, model_validator

from fedsweep.algorithms.base import ClientData
from fedsweep.data import partitions, synthetic
from fedsweep.schema import StrictModel, aliases


class IIDPartition(StrictModel):
    """Shuffled samples dealt evenly."""

    name: Literal["iid"] = "iid"


class LabelSkewPartition(StrictModel):
    """Each client holds exactly ``classes_per_client`` classes."""

    name: Literal["label_skew"] = "label_skew"
    classes_per_client: int = Field(2, ge=1)


PartitionConfig = Annotated[IIDPartition | LabelSkewPartition, Field(discriminator="name")]


class SyntheticConfig(StrictModel):
    """FedProx's Synthetic(ᾱ, β̄); each device is its own distribution, so no partition is applied."""

    dataset: Literal["synthetic"] = "synthetic"
    num_clients: int = Field(20, ge=1)
    model_heterogeneity: float = Field(0.5, ge=0, validation_alias=aliases("model_heterogeneity", "alpha"), description="ᾱ")
    data_heterogeneity: float = Field(0.5, ge=0, validation_alias=aliases("data_heterogeneity", "beta"), description="β̄")
    num_features: int = Field(60, ge=1)
    num_classes: int = Field(10, ge=2)
    min_samples_per_client: int = Field(50, ge=2)
    max_samples_per_client: int | None = Field(None, ge=2)
    test_fraction: float = Field(0.25, gt=0, lt=1)
    seed: int = Field(0, ge=0, description="Seed of the data itself; fixed across the experiment's seeds.")

    @model_validator(mode="after")
    def _sizes(self):
        if self.max_samples_per_client is not None and self.max_samples_per_client < self.min_samples_per_client:
            raise ValueError(
                f"max_samples_per_client ({self.max_samples_per_client}) must be >= "
                f"min_samples_per_client ({self.min_samples_per_client})"
            )
        return self


DIGITS_FEATURES, DIGITS_CLASSES = 64, 10


class DigitsConfig(StrictModel):
    """scikit-learn's bundled 8×8 digits (1797 images, 10 classes), split by ``partition``."""

    dataset: Literal["digits"] = "digits"
    num_clients: int = Field(10, ge=1)
    partition: PartitionConfig = Field(default_factory=LabelSkewPartition)
    test_fraction: float = Field(0.25, gt=0, lt=1)
    seed: int = Field(0, ge=0, description="Seed of the split; fixed across the experiment's seeds.")

    @model_validator(mode="after")
    def _feasible(self):
        if isinstance(self.partition, LabelSkewPartition) and self.partition.classes_per_client > DIGITS_CLASSES:
            raise ValueError(
                f"partition.classes_per_client={self.partition.classes_per_client} exceeds the "
                f"{DIGITS_CLASSES} classes of digits (allowed: 1..{DIGITS_CLASSES})"
            )
        smallest = min(len(p) for p in _split_pooled(self, _digits()[1]))
        if smallest < 2:
            raise ValueError(
                f"num_clients={self.num_clients} leaves a client with {smallest} sample(s) of digits' 1797; "
                "every client needs at least 2 (one train, one test): use fewer clients"
            )
        return self


DataConfig = Annotated[SyntheticConfig | DigitsConfig, Field(discriminator="dataset")]


@dataclass
class FederatedDataset:
    clients: list[ClientData]
    num_features: int
    num_classes: int


@lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)


def _split_pooled(cfg: DigitsConfig, labels: np.ndarray) -> list[np.ndarray]:
    rng = np.random.default_rng([cfg.seed, 1])
    if isinstance(cfg.partition, LabelSkewPartition):
        return partitions.label_skew(labels, cfg.num_clients, cfg.partition.classes_per_client, rng)
    return partitions.iid(labels, cfg.num_clients, rng)


def _client(x: np.ndarray, y: np.ndarray, train: np.ndarray, test: np.ndarray) -> ClientData:
    t = torch.from_numpy
    return ClientData(t(x[train]), t(y[train]), t(x[test]), t(y[test]))


def build_federated_dataset(cfg: SyntheticConfig | DigitsConfig) -> FederatedDataset:
    """Deterministic in ``cfg`` (its own ``seed``): the same config gives the same shards."""
    split_rng = np.random.default_rng([cfg.seed, 2])
    if isinstance(cfg, SyntheticConfig):
        devices = synthetic.generate(
            cfg.num_clients,
            cfg.model_heterogeneity,
            cfg.data_heterogeneity,
            cfg.num_features,
            cfg.num_classes,
            cfg.min_samples_per_client,
            cfg.max_samples_per_client,
            np.random.default_rng([cfg.seed, 1]),
        )
        clients = []
        for x, y in devices:
            train, test = partitions.train_test_split(np.arange(len(y)), cfg.test_fraction, split_rng)
            clients.append(_client(x, y, train, test))
        return FederatedDataset(clients, cfg.num_features, cfg.num_classes)
    x, y = _digits()
    clients = []
    for idx in _split_pooled(cfg, y):
        train, test = partitions.train_test_split(idx, cfg.test_fraction, split_rng)
        clients.append(_client(x, y, train, test))
    return FederatedDataset(clients, DIGITS_FEATURES, DIGITS_CLASSES)
