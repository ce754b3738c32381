"""The embedded datasets and splits: defining properties and determinism."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsweep.data import DigitsConfig, SyntheticConfig, build_federated_dataset, partitions
from fedsweep.loading import validate
from tests.conftest import ROOT, config_dict


def test_synthetic_shapes_sizes_and_split():
    cfg = SyntheticConfig(num_clients=12, min_samples_per_client=50, max_samples_per_client=300, seed=3)
    ds = build_federated_dataset(cfg)
    assert (ds.num_features, ds.num_classes) == (60, 10)
    assert len(ds.clients) == 12
    for c in ds.clients:
        n = c.num_train + c.num_test
        assert 50 <= n <= 300
        assert c.x_train.shape[1] == 60 and c.x_train.dtype == torch.float32
        assert abs(c.num_test - round(0.25 * n)) <= 1
        assert int(c.y_train.min()) >= 0 and int(c.y_train.max()) < 10


def test_synthetic_sizes_follow_a_power_law():
    sizes = np.array(
        [c.num_train + c.num_test for c in build_federated_dataset(SyntheticConfig(num_clients=200, seed=1)).clients]
    )
    assert sizes.min() >= 50
    # LogNormal(4, 2) + 50: heavy right tail, the mean far above the median.
    assert sizes.mean() > 2 * np.median(sizes)


def test_synthetic_size_multiplier_scales_the_power_law_as_pfedmes_generator_does():
    def sizes(**kw):
        ds = build_federated_dataset(SyntheticConfig(num_clients=100, seed=0, **kw))
        return np.array([c.num_train + c.num_test for c in ds.clients])

    base = sizes()
    assert np.array_equal(sizes(size_multiplier=5), 5 * base)  # same draw, every size times 5
    # pFedMe's Synthetic(0.5, 0.5): sizes in [250, 25810] (its Sec. 5.1), the bounds as the protocol file sets them
    capped = sizes(size_multiplier=5, max_samples_per_client=25810)
    assert capped.min() == 250 and capped.max() == 25810
    assert np.array_equal(capped, np.minimum(5 * base, 25810))
    with pytest.raises(ValueError, match="size_multiplier"):
        SyntheticConfig(size_multiplier=0)


def test_synthetic_is_deterministic_per_seed():
    a = build_federated_dataset(SyntheticConfig(num_clients=5, seed=7))
    b = build_federated_dataset(SyntheticConfig(num_clients=5, seed=7))
    c = build_federated_dataset(SyntheticConfig(num_clients=5, seed=8))
    assert all(torch.equal(x.x_train, y.x_train) and torch.equal(x.y_test, y.y_test) for x, y in zip(a.clients, b.clients))
    assert not torch.equal(a.clients[0].x_train[:5], c.clients[0].x_train[:5])


def test_synthetic_heterogeneity_changes_the_label_distributions():
    def label_spread(alpha_beta: float) -> float:
        cfg = SyntheticConfig(num_clients=30, model_heterogeneity=alpha_beta, data_heterogeneity=alpha_beta, max_samples_per_client=400)
        hists = [torch.bincount(c.y_train, minlength=10).float() for c in build_federated_dataset(cfg).clients]
        dists = torch.stack([h / h.sum() for h in hists])
        return float((dists - dists.mean(0)).abs().sum(1).mean())

    assert label_spread(0.0) < label_spread(1.0)


def test_label_skew_gives_each_client_exactly_k_classes():
    labels = np.repeat(np.arange(10), 50)
    parts = partitions.label_skew(labels, num_clients=7, classes_per_client=3, rng=np.random.default_rng(0))
    for p in parts:
        assert len(np.unique(labels[p])) == 3
    flat = np.concatenate(parts)
    assert len(flat) == len(np.unique(flat))  # disjoint
    assert len(flat) == len(labels)  # 7 × 3 ≥ 10: every class is held, every sample used


def test_iid_partition_is_disjoint_and_complete():
    labels = np.arange(103) % 10
    parts = partitions.iid(labels, 4, np.random.default_rng(0))
    flat = np.concatenate(parts)
    assert sorted(flat.tolist()) == list(range(103))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_train_test_split_is_disjoint_and_non_empty():
    idx = np.arange(10, 20)
    train, test = partitions.train_test_split(idx, 0.25, np.random.default_rng(0))
    assert set(train).isdisjoint(test) and set(train) | set(test) == set(idx)
    assert len(test) == 2 or len(test) == 3
    train, test = partitions.train_test_split(np.array([4, 5]), 0.9, np.random.default_rng(0))
    assert len(train) == 1 and len(test) == 1


@pytest.mark.parametrize("partition", [{"name": "iid"}, {"name": "label_skew", "classes_per_client": 2}])
def test_digits_split_deterministic_and_disjoint(partition):
    cfg = validate(config_dict(data={"num_clients": 6, "partition": partition})).data
    a, b = build_federated_dataset(cfg), build_federated_dataset(cfg)
    assert (a.num_features, a.num_classes) == (64, 10)
    assert all(torch.equal(x.x_train, y.x_train) for x, y in zip(a.clients, b.clients))
    total = sum(c.num_train + c.num_test for c in a.clients)
    assert total == 1797  # every image used exactly once (6 × 2 ≥ 10 classes, or iid)
    if partition["name"] == "label_skew":
        for c in a.clients:
            assert len(torch.unique(torch.cat([c.y_train, c.y_test]))) == 2


def test_digits_are_scikit_learns_exactly_and_read_without_importing_it():
    """fedsweep reads the file scikit-learn ships (its import cost every actor ~2 s of CPU): the same arrays as
    ``load_digits`` gives, scaled to [0, 1] as before, and no scikit-learn module loaded to build a dataset."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    from fedsweep.data import _digits

    x, y = _digits()
    d = load_digits()
    assert x.dtype == np.float32 and y.dtype == np.int64 and x.shape == (1797, 64)
    assert np.array_equal(x, (d.data / 16.0).astype(np.float32)) and np.array_equal(y, d.target)
    code = ("import sys; from fedsweep.data import build_federated_dataset, DigitsConfig; "
            "build_federated_dataset(DigitsConfig()); print(sorted(m for m in sys.modules if m.startswith('sklearn')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"


def test_digits_config_default_partition_is_label_skew():
    assert DigitsConfig().partition.name == "label_skew"
