"""Federated datasets: the embedded defaults (Synthetic(ᾱ, β̄) and scikit-learn's digits), MNIST,
Fashion-MNIST and CIFAR-10/100 from local files, and the named splits of the papers."""

from __future__ import annotations

import gzip
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
from pydantic import Field, model_validator

from fedsweep.client_data import ClientData
from fedsweep.data import partitions, synthetic, vision
from fedsweep.schema import FieldError, StrictModel, aliases

#: Clients one experiment may have (every client is a shard, a state and a share of an actor; above this
#: the plan itself - splits, bundles - would exhaust the driver's memory before any check could speak).
MAX_CLIENTS = 100_000
#: Samples in each dataset's pool (train + test), known before its files are read: an image dataset's are its
#: official files' counts, which the files are checked against (:data:`vision.FORMATS`).
POOL_SIZES = {"digits": 1797, **{name: sum(counts.values()) for name, (_, _, counts) in vision.FORMATS.items()}}
#: What to change when a split leaves a client with fewer than 2 samples, by partition.
_SMALLER_SPLIT_FIX = {
    "iid": "fewer clients (num_clients)",
    "label_skew": "fewer clients (num_clients), or more classes per client (partition.classes_per_client)",
    "dirichlet": "a larger partition.concentration, or fewer clients (num_clients)",
    "shards": "fewer clients (num_clients), or fewer partition.shards_per_client",
    "pfedme_mnist": "fewer clients (num_clients)",
}


#: ``data.seed``: a seed, or "run" (the run's own seed: :meth:`fedsweep.config.ExperimentConfig.run_data`).
DataSeed = Annotated[int, Field(ge=0)] | Literal["run"]
#: ``data.validation_fraction`` of every dataset: what :func:`build_federated_dataset` holds out.
ValidationFraction = Annotated[float, Field(
    ge=0, lt=1,
    description="Share of each client's training data held out as its validation part (stratified by label, "
    "seeded by the data seed), scored as val_* metrics at every evaluation; 0 = none.",
)]


def _pool_too_small(dataset: str, num_clients: int, share: float = 1.0) -> FieldError | None:
    pool = round(POOL_SIZES[dataset] * share)
    if num_clients > pool // 2:
        return FieldError("num_clients", f"{num_clients}: {dataset} has {pool} samples{f' at subsample {share}' if share < 1 else ''} and every client needs at least 2 "
                                         f"(one train, one test); allowed: 1..{pool // 2}")
    return None


#: The field a split too fine for its dataset is fixed by first (the message names the others).
_SPLIT_FIELD = {"dirichlet": "partition.concentration", "shards": "partition.shards_per_client"}


def empty_client_problem(partition: str, dataset: str, client: int, samples: int) -> FieldError:
    return FieldError(_SPLIT_FIELD.get(partition, "num_clients"),
                      f"the {partition} split of {dataset} leaves client {client} with {samples} sample(s); every "
                      f"client needs at least 2 (one train, one test); allowed: {_SMALLER_SPLIT_FIX.get(partition, 'fewer clients')}")


class IIDPartition(StrictModel):
    """Shuffled samples dealt evenly."""

    name: Literal["iid"] = "iid"


class LabelSkewPartition(StrictModel):
    """Each client holds exactly ``classes_per_client`` classes."""

    name: Literal["label_skew"] = "label_skew"
    classes_per_client: int = Field(2, ge=1)


class DirichletPartition(StrictModel):
    """Each class divided among the clients in Dir(concentration) proportions drawn over the clients (PFLlib's and
    pFL-Bench's scheme)."""

    name: Literal["dirichlet"] = "dirichlet"
    concentration: float = Field(0.5, gt=0, description="Dirichlet concentration; small = few classes per client")


class ShardsPartition(StrictModel):
    """McMahan et al.'s pathological split: label-sorted shards, ``shards_per_client`` each."""

    name: Literal["shards"] = "shards"
    shards_per_client: int = Field(2, ge=1)


class PerFedAvgPartition(StrictModel):
    """Per-FedAvg's split: half the users ``a`` images of each of classes 0-4, the others a/2 of one class
    in 0-4 and 2a of one in 5-9 (``diff_hetero``: without the a/2); the test pool split the same way."""

    name: Literal["perfedavg"] = "perfedavg"
    images_per_class: int = Field(196, ge=2, validation_alias=aliases("images_per_class", "a"), description="a")
    test_images_per_class: int | None = Field(
        None, ge=2, description="a for the test pool; null = a × (test pool size / train pool size), rounded down"
    )
    diff_hetero: bool = False


class PFedMeMNISTPartition(StrictModel):
    """pFedMe's MNIST split: ``labels_per_client`` labels per user, sizes uniform in [min, max], pooled
    train and test images, then the user's own train/test split."""

    name: Literal["pfedme_mnist"] = "pfedme_mnist"
    labels_per_client: int = Field(2, ge=1)
    min_samples: int = Field(1165, ge=2)
    max_samples: int = Field(3834, ge=2)
    label_assignment: Literal["blocks", "chain"] = Field(
        "blocks",
        description="Where user i's k labels start: 'blocks' at i·k (k = 2: disjoint pairs {0,1}, {2,3}, …), "
        "'chain' at i (overlapping pairs {0,1}, {1,2}, …, as the authors' generator does)",
    )
    whole_dataset: bool = Field(
        False,
        description="Deal every image (the paper's 'complete dataset'): each label block's users share all its images, "
        "their sizes drawn in [min, max] and scaled to it. Blocks only. false: each size drawn alone (about 49,000 of "
        "MNIST's 70,000 images for 20 users in [1165, 3834]).",
    )


class ACIDPartition(StrictModel):
    """ACID (Acar et al. 2021): ``classes_per_client`` classes per device, train and test drawn from them."""

    name: Literal["acid"] = "acid"
    classes_per_client: int = Field(5, ge=1)


class ALIDPartition(StrictModel):
    """ALID: ACID, then each device permutes its label indices."""

    name: Literal["alid"] = "alid"
    classes_per_client: int = Field(5, ge=1)


PartitionConfig = Annotated[
    IIDPartition | LabelSkewPartition | DirichletPartition | ShardsPartition, Field(discriminator="name")
]
ImagePartitionConfig = Annotated[
    IIDPartition
    | LabelSkewPartition
    | DirichletPartition
    | ShardsPartition
    | PerFedAvgPartition
    | PFedMeMNISTPartition
    | ACIDPartition
    | ALIDPartition,
    Field(discriminator="name"),
]


class SyntheticConfig(StrictModel):
    """FedProx's Synthetic(ᾱ, β̄); each device is its own distribution, so no partition is applied."""

    dataset: Literal["synthetic"] = "synthetic"
    num_clients: int = Field(20, ge=1, le=MAX_CLIENTS)
    model_heterogeneity: float = Field(0.5, ge=0, validation_alias=aliases("model_heterogeneity", "alpha"), description="ᾱ")
    data_heterogeneity: float = Field(0.5, ge=0, validation_alias=aliases("data_heterogeneity", "beta"), description="β̄")
    num_features: int = Field(60, ge=1)
    num_classes: int = Field(10, ge=2)
    min_samples_per_client: int = Field(50, ge=2)
    max_samples_per_client: int | None = Field(None, ge=2)
    size_multiplier: int = Field(
        1, ge=1, description="Device size = (⌊LogNormal(4, 2)⌋ + min_samples_per_client) × this; pFedMe's generator uses 5."
    )
    test_fraction: float = Field(0.25, gt=0, lt=1)
    validation_fraction: ValidationFraction = 0.0
    seed: DataSeed = Field(0, description="Seed of the data itself: fixed across the experiment's seeds, or 'run': each "
                           "run's own seed (the data drawn again per seed; the setting stays one).")

    @model_validator(mode="after")
    def _sizes(self):
        if self.max_samples_per_client is not None and self.max_samples_per_client < self.min_samples_per_client:
            raise FieldError(
                "max_samples_per_client", f"{self.max_samples_per_client} must be >= "
                f"min_samples_per_client ({self.min_samples_per_client})"
            )
        return self


DIGITS_FEATURES, DIGITS_CLASSES = 64, 10


class DigitsConfig(StrictModel):
    """scikit-learn's bundled 8×8 digits (1797 images, 10 classes), split by ``partition``."""

    dataset: Literal["digits"] = "digits"
    num_clients: int = Field(10, ge=1, le=MAX_CLIENTS)
    partition: PartitionConfig = Field(default_factory=LabelSkewPartition)
    test_fraction: float = Field(0.25, gt=0, lt=1)
    validation_fraction: ValidationFraction = 0.0
    seed: DataSeed = Field(0, description="Seed of the split: fixed across the experiment's seeds, or 'run': each run's "
                           "own seed (the split drawn again per seed; the setting stays one).")

    @model_validator(mode="after")
    def _feasible(self):
        if isinstance(self.partition, LabelSkewPartition) and self.partition.classes_per_client > DIGITS_CLASSES:
            raise FieldError(
                "partition.classes_per_client", f"{self.partition.classes_per_client} exceeds the "
                f"{DIGITS_CLASSES} classes of digits (allowed: 1..{DIGITS_CLASSES})"
            )
        if problem := _pool_too_small("digits", self.num_clients):
            raise problem
        if self.seed == "run":  # the split depends on the run's seed: checked with it (ExperimentConfig.run_data)
            return self
        sizes = [len(p) for p in _split_pooled(self, _digits()[1])]
        if min(sizes) < 2:
            raise empty_client_problem(self.partition.name, "digits", sizes.index(min(sizes)), min(sizes))
        return self


class ImageConfig(StrictModel):
    """MNIST, Fashion-MNIST, CIFAR-10 or CIFAR-100 read from ``root`` (torchvision's layout; Fashion-MNIST
    also from Debian's ``dataset-fashion-mnist``), split by ``partition``.

    ``perfedavg``, ``acid`` and ``alid`` split the official train and test pools; the other splits
    pool both and give each client its own ``test_fraction`` (pFedMe's 75/25).
    """

    dataset: Literal["mnist", "fashion_mnist", "cifar10", "cifar100"]
    root: str | None = Field(None, description="Folder holding the files; null = $FEDSWEEP_DATA_DIR, else ./data")
    download: bool = Field(False, description="Fetch missing files with torchvision (vision extra, internet)")
    num_clients: int = Field(50, ge=1, le=MAX_CLIENTS)
    partition: ImagePartitionConfig = Field(default_factory=IIDPartition)
    test_fraction: float = Field(0.25, gt=0, lt=1)
    validation_fraction: ValidationFraction = 0.0
    seed: DataSeed = Field(0, description="Seed of the split: fixed across the experiment's seeds, or 'run': each run's "
                           "own seed (the split drawn again per seed; the setting stays one).")
    subsample: float = Field(
        1.0, gt=0, le=1,
        description="Share of the pooled images kept, the same share of every class (drawn with the split's seed), "
        "before the split: 1 keeps all; less is a stated cut of a protocol (e.g. a benchmark cell cut to a CPU). "
        "Only for the splits of the pooled images (iid, dirichlet, label_skew, shards, pfedme_mnist).",
    )
    input_scaling: Literal["unit_interval", "standardized"] = Field(
        "unit_interval",
        description="Pixels as x/255 ('unit_interval'), or per pixel (x − μ)/(σ + 0.001) with μ, σ over all "
        "the dataset's images, train and test, in 0..255 units ('standardized', as pFedMe's MNIST generator)",
    )

    @model_validator(mode="after")
    def _feasible(self):
        p = self.partition
        if isinstance(p, PFedMeMNISTPartition) and p.max_samples < p.min_samples:
            raise FieldError("partition.max_samples", f"{p.max_samples} must be >= partition.min_samples ({p.min_samples})")
        if isinstance(p, PFedMeMNISTPartition) and p.whole_dataset and p.label_assignment != "blocks":
            raise FieldError("partition.whole_dataset", "true needs label_assignment: blocks (the chain's label pairs "
                                                        "overlap, so no block's images belong to its users alone)")
        classes = num_classes(self)
        field = "classes_per_client" if hasattr(p, "classes_per_client") else "labels_per_client"
        k = getattr(p, field, 1)
        if k > classes:
            raise FieldError(f"partition.{field}", f"{k} exceeds the {classes} classes of {self.dataset} (allowed: 1..{classes})")
        if isinstance(p, PerFedAvgPartition) and classes != 10:
            raise FieldError("partition.name", "perfedavg needs classes 0-9 (mnist, fashion_mnist or cifar10)")
        if self.subsample < 1 and isinstance(p, (PerFedAvgPartition, ACIDPartition, ALIDPartition)):
            raise FieldError("subsample", f"{self.subsample} with partition {p.name}, which draws its own per-class counts "
                                          "from the official train and test pools; allowed: 1, or a pooled split "
                                          "(iid, dirichlet, label_skew, shards, pfedme_mnist)")
        if problem := _pool_too_small(self.dataset, self.num_clients, self.subsample):
            raise problem
        return self


DataConfig = Annotated[SyntheticConfig | DigitsConfig | ImageConfig, Field(discriminator="dataset")]


def input_features(cfg: SyntheticConfig | DigitsConfig | ImageConfig) -> int:
    """Input size of a dataset, known from its config alone (images are flattened)."""
    if isinstance(cfg, SyntheticConfig):
        return cfg.num_features
    if isinstance(cfg, DigitsConfig):
        return DIGITS_FEATURES
    return math.prod(vision.FORMATS[cfg.dataset][0])


def num_classes(cfg: SyntheticConfig | DigitsConfig | ImageConfig) -> int:
    """Number of classes of a dataset, known from its config alone."""
    if isinstance(cfg, SyntheticConfig):
        return cfg.num_classes
    if isinstance(cfg, DigitsConfig):
        return DIGITS_CLASSES
    return vision.FORMATS[cfg.dataset][1]


@dataclass
class FederatedDataset:
    clients: list[ClientData]
    num_features: int
    num_classes: int


@lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits (1,797 images of 8×8 pixels, values 0-16), read from the file scikit-learn ships, as
    its ``load_digits`` reads it, without importing scikit-learn: that import (scipy with it) cost every process
    that builds a digits dataset about 2 s of CPU — each trial's actors, each check of a config."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise ImportError("the digits dataset is scikit-learn's: pip install scikit-learn")
    with gzip.open(Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz", mode="rt", encoding="utf-8") as f:
        table = np.loadtxt(f, delimiter=",")
    x, y = (table[:, :-1] / 16.0).astype(np.float32), table[:, -1].astype(np.int64)
    x.flags.writeable = y.flags.writeable = False  # cached: shared by every caller in the process
    return x, y


def _split_pooled(cfg: DigitsConfig | ImageConfig, labels: np.ndarray) -> list[np.ndarray]:
    """A split of one pool of samples (each client then makes its own train/test split)."""
    rng = np.random.default_rng([cfg.seed, 1])
    p, n = cfg.partition, cfg.num_clients
    if isinstance(p, LabelSkewPartition):
        return partitions.label_skew(labels, n, p.classes_per_client, rng)
    if isinstance(p, DirichletPartition):
        return partitions.dirichlet(labels, n, p.concentration, rng)
    if isinstance(p, ShardsPartition):
        return partitions.shards(labels, n, p.shards_per_client, rng)
    if isinstance(p, PFedMeMNISTPartition):
        return partitions.pfedme_mnist(labels, n, p.labels_per_client, p.min_samples, p.max_samples, rng, p.label_assignment,
                                       p.whole_dataset)
    return partitions.iid(labels, n, rng)


@lru_cache(maxsize=2)
def _images(name: str, root: str, download: bool):
    """uint8 images, decoded once per node (:func:`vision.load_uint8`); each shard is made float on its own."""
    return vision.load_uint8(name, Path(root), download)


@lru_cache(maxsize=2)
def _pixel_statistics(name: str, root: str, download: bool) -> tuple[np.ndarray, np.ndarray]:
    x_tr, _, x_te, _ = _images(name, root, download)
    return vision.pixel_statistics(x_tr, x_te)


def _input_scaling(cfg: ImageConfig, root: str) -> Callable[[np.ndarray], np.ndarray]:
    """uint8 images -> float32 model inputs, as ``cfg.input_scaling`` says."""
    if cfg.input_scaling == "unit_interval":
        return vision.to_float
    mean, std = _pixel_statistics(cfg.dataset, root, cfg.download)
    return lambda images: vision.standardize(images, mean, std)


def _image_clients(cfg: ImageConfig, inputs: bool = True) -> tuple[list[ClientData], int, int]:
    root = str(vision.data_root(cfg.root))
    x_tr, y_tr, x_te, y_te = _images(cfg.dataset, root, cfg.download)
    features = x_tr.shape[1]
    if inputs:
        scale = _input_scaling(cfg, root)
    else:  # zero-width images: the same split, without copying and converting the pixels
        x_tr, x_te, scale = x_tr[:, :0], x_te[:, :0], np.asarray
    classes = num_classes(cfg)
    p, n = cfg.partition, cfg.num_clients
    rng = np.random.default_rng([cfg.seed, 1])
    if isinstance(p, (PerFedAvgPartition, ACIDPartition, ALIDPartition)):
        if isinstance(p, PerFedAvgPartition):
            a_test = p.test_images_per_class or max(2, p.images_per_class * len(y_te) // len(y_tr))
            split = partitions.perfedavg(y_tr, y_te, n, p.images_per_class, a_test, p.diff_hetero, rng)
        else:
            split = partitions.acid(y_tr, y_te, n, p.classes_per_client, rng)
        perms = partitions.label_permutations(n, classes, rng) if isinstance(p, ALIDPartition) else None
        clients = []
        for i, (tr, te) in enumerate(split):
            relabel = (lambda y, perm=perms[i]: perm[y]) if perms is not None else (lambda y: y)
            t = torch.from_numpy
            clients.append(ClientData(t(scale(x_tr[tr])), t(relabel(y_tr[tr])), t(scale(x_te[te])), t(relabel(y_te[te]))))
        return clients, features, classes
    x, y = np.concatenate([x_tr, x_te]), np.concatenate([y_tr, y_te])
    if cfg.subsample < 1:
        keep = partitions.validation_split(y, cfg.subsample, np.random.default_rng([cfg.seed, 3]))[1]  # stratified
        x, y = x[keep], y[keep]
    split_rng = np.random.default_rng([cfg.seed, 2])
    clients = []
    for i, idx in enumerate(_split_pooled(cfg, y)):
        if len(idx) < 2:
            raise ValueError(f"data.{empty_client_problem(p.name, cfg.dataset, i, len(idx))}")
        train, test = partitions.train_test_split(idx, cfg.test_fraction, split_rng)
        clients.append(_client(x, y, train, test, scale))
    return clients, features, classes


def _client(x: np.ndarray, y: np.ndarray, train: np.ndarray, test: np.ndarray,
            scale: Callable[[np.ndarray], np.ndarray] = np.asarray) -> ClientData:
    """One client's shard; uint8 images become float inputs here (``scale``), shard by shard."""
    t = torch.from_numpy
    return ClientData(t(scale(x[train])), t(y[train]), t(scale(x[test])), t(y[test]))


def build_federated_dataset(cfg: SyntheticConfig | DigitsConfig | ImageConfig, inputs: bool = True) -> FederatedDataset:
    """Deterministic in ``cfg`` (its own ``seed``): the same config gives the same shards; with
    ``validation_fraction`` each client's validation part is then held out of its training part. ``inputs=False``
    (what the checks of a sweep need): image datasets' shards with their labels and sizes and zero-width inputs,
    the same split without the pixels (1.5 s of a 16-trial MNIST sweep's start went to converting them)."""
    ds = _build(cfg, inputs)
    if cfg.validation_fraction > 0:
        # the stream [seed, 3], also the subsample's (see _build; different lengths, so their draws do not line up):
        # the shards are those of fraction 0
        rng = np.random.default_rng([cfg.seed, 3])
        ds.clients = [_hold_out(c, i, cfg.validation_fraction, rng) for i, c in enumerate(ds.clients)]
    return ds


#: The last dataset this process built or was handed (:func:`keep_built`, :func:`built_or_build`), by its config.
_BUILT: dict = {}


def keep_built(cfg: SyntheticConfig | DigitsConfig | ImageConfig, dataset: FederatedDataset) -> None:
    """Keep the dataset the checks of a one-experiment command built, so that its run does not build it again."""
    _BUILT.clear()
    _BUILT[cfg] = dataset


def built_or_build(cfg: SyntheticConfig | DigitsConfig | ImageConfig) -> FederatedDataset:
    """The dataset this process last built for ``cfg`` (its checks', or an earlier run's), else a new one, kept
    for the next call. A dataset depends on ``cfg`` alone and no run changes it, so the trials of a sweep that a
    Tune process runs one after another share one build when their data sections are the same (only seeds or
    hyperparameters vary): 20% of the CPU of a 200-round MNIST trial went to building it again (issue 35). At
    most one dataset is kept: the one the process's current or last run holds."""
    dataset = _BUILT.get(cfg)
    if dataset is None:
        _BUILT.clear()  # the earlier one freed before the new one is built
        dataset = _BUILT[cfg] = build_federated_dataset(cfg)
    return dataset


def _hold_out(c: ClientData, index: int, fraction: float, rng: np.random.Generator) -> ClientData:
    if c.num_train < 2:
        raise ValueError(f"data.validation_fraction: client {index} has {c.num_train} training sample(s), too few to hold "
                         "any out (it needs 2: one to train on, one to validate); allowed: 0, or fewer clients")
    keep, val = partitions.validation_split(c.y_train.numpy(), fraction, rng)
    keep_t, val_t = torch.from_numpy(keep), torch.from_numpy(val)
    return ClientData(c.x_train[keep_t], c.y_train[keep_t], c.x_test, c.y_test, c.x_train[val_t], c.y_train[val_t])


def _build(cfg: SyntheticConfig | DigitsConfig | ImageConfig, inputs: bool = True) -> FederatedDataset:
    if isinstance(cfg, ImageConfig):
        return FederatedDataset(*_image_clients(cfg, inputs))
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
            cfg.size_multiplier,
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
