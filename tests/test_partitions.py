"""Each named split: its defining property, and the same seed giving the same split."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from fedsweep.data import partitions as P

TRAIN = np.repeat(np.arange(10), 600)
TEST = np.repeat(np.arange(10), 200)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def same(a, b) -> bool:
    flat = lambda s: [x for item in s for x in (item if isinstance(item, tuple) else (item,))]
    return all(np.array_equal(x, y) for x, y in zip(flat(a), flat(b)))


def disjoint(parts: list[np.ndarray]) -> bool:
    flat = np.concatenate(parts)
    return len(flat) == len(np.unique(flat))


@pytest.mark.parametrize("diff_hetero", [False, True])
def test_perfedavg_class_counts_per_user(diff_hetero):
    a, a_test = 20, 6
    split = P.perfedavg(TRAIN, TEST, 50, a, a_test, diff_hetero, rng())
    lows, highs = [], []
    for i, (tr, te) in enumerate(split):
        for idx, labels, k in ((tr, TRAIN, a), (te, TEST, a_test)):
            counts = Counter(labels[idx].tolist())
            if i < 25:  # a images of each of classes 0-4
                assert counts == {c: k for c in range(5)}
            else:  # a/2 of one class in 0-4 (unless diff_hetero) and 2a of one class in 5-9
                low = [c for c in counts if c < 5]
                high = [c for c in counts if c >= 5]
                assert len(high) == 1 and counts[high[0]] == 2 * k
                if diff_hetero:
                    assert low == []
                else:
                    assert len(low) == 1 and counts[low[0]] == k // 2
        if i >= 25:
            # the test part has the same classes as the train part
            assert set(TRAIN[tr]) == set(TEST[te])
            highs.append(int(max(TRAIN[tr])))
            lows += [int(c) for c in set(TRAIN[tr]) if c < 5]
    assert disjoint([tr for tr, _ in split]) and disjoint([te for _, te in split])
    assert Counter(highs) == {c: 5 for c in range(5, 10)}  # the single classes are dealt evenly
    assert not lows if diff_hetero else Counter(lows) == {c: 5 for c in range(5)}
    if not diff_hetero:  # "the distribution of images over all the users are different": the 25 pairs, each once
        pairs = {tuple(sorted(set(TRAIN[tr].tolist()))) for tr, _ in split[25:]}
        assert pairs == {(lo, hi) for lo in range(5) for hi in range(5, 10)}
    assert same(split, P.perfedavg(TRAIN, TEST, 50, a, a_test, diff_hetero, rng()))
    assert not same(split, P.perfedavg(TRAIN, TEST, 50, a, a_test, diff_hetero, rng(1)))


def test_perfedavg_names_the_class_that_runs_out():
    with pytest.raises(ValueError, match=r"perfedavg split, user \d+ of 50, train \(a=100\): class \d has \d+ samples left, 100 needed; allowed: fewer clients"):
        P.perfedavg(TRAIN, TEST, 50, 100, 6, False, rng())


def test_pfedme_mnist_two_labels_per_user_and_sizes_in_range():
    pooled = np.concatenate([TRAIN, TEST])
    parts = P.pfedme_mnist(pooled, 20, 2, 150, 300, rng())
    assert len(parts) == 20
    for i, p in enumerate(parts):
        labels = pooled[p]
        assert sorted(set(labels.tolist())) == sorted({(2 * i) % 10, (2 * i + 1) % 10})  # exactly 2 labels
        assert 150 <= len(p) <= 300
        counts = Counter(labels.tolist())
        assert abs(counts[(2 * i) % 10] - counts[(2 * i + 1) % 10]) <= 1
    assert disjoint(parts)
    assert same(parts, P.pfedme_mnist(pooled, 20, 2, 150, 300, rng()))
    assert not same(parts, P.pfedme_mnist(pooled, 20, 2, 150, 300, rng(1)))


def test_pfedme_mnist_chain_gives_user_i_labels_i_and_i_plus_1_as_the_authors_generator_does():
    pooled = np.concatenate([TRAIN, TEST])
    parts = P.pfedme_mnist(pooled, 20, 2, 150, 300, rng(), "chain")
    for i, p in enumerate(parts):
        assert sorted(set(pooled[p].tolist())) == sorted({i % 10, (i + 1) % 10})
        assert 150 <= len(p) <= 300
    holders = Counter(c for p in parts for c in set(pooled[p].tolist()))
    assert holders == {c: 4 for c in range(10)}  # each label shared by four users, two partners
    assert disjoint(parts)


@pytest.mark.parametrize("n, k, classes, at_least", [(100, 5, 10, 60), (100, 3, 10, 50), (100, 7, 10, 50),
                                                      (100, 5, 100, 100), (20, 2, 10, 15)])
def test_class_lists_vary_and_every_class_has_as_many_holders(n, k, classes, at_least):
    """The ACID and label_skew lists (issue 37): the round-robin over one permutation they replace gave
    C / gcd(k, C) lists (2 for 5 of 10, 10 for 3 of 10, 5 for 2 of 10); each list k distinct classes, and
    each class held by n·k / C clients give or take one."""
    held = P.deal_classes(np.arange(classes), n, k, rng())
    assert all(len(set(h)) == k for h in held)
    assert len({tuple(h) for h in held}) >= at_least
    holders = np.bincount(np.concatenate(held), minlength=classes)
    assert holders.max() - holders.min() <= 1 and holders.sum() == n * k
    assert held == P.deal_classes(np.arange(classes), n, k, rng()) != P.deal_classes(np.arange(classes), n, k, rng(1))


def test_label_skew_deals_the_varied_lists_and_splits_each_class_among_its_holders():
    labels = np.repeat(np.arange(10), 40)
    parts = P.label_skew(labels, 20, 2, rng())
    lists = [tuple(sorted(set(labels[p].tolist()))) for p in parts]
    assert all(len(c) == 2 for c in lists) and len(set(lists)) >= 15  # 5 before: {perm[2i], perm[2i+1]}
    assert disjoint(parts) and sum(len(p) for p in parts) == len(labels)
    assert all(len(p) == 20 for p in parts)  # each class held by 4 clients: 40 / 4 = 10 of each of 2 classes


def test_acid_draws_without_replacement_from_each_devices_classes():
    split = P.acid(TRAIN, TEST, 100, 5, rng())
    for tr, te in split:
        assert len(set(TRAIN[tr])) == 5 and set(TEST[te]) == set(TRAIN[tr])
        assert len(tr) == 60 and len(te) == 20  # 600 / 50 holders × 5 classes; 200 / 50 × 5
    assert disjoint([tr for tr, _ in split]) and disjoint([te for _, te in split])
    assert sum(len(tr) for tr, _ in split) == len(TRAIN)  # every sample used once
    assert len({tuple(sorted(set(TRAIN[tr].tolist()))) for tr, _ in split}) >= 60  # not the two lists of old
    assert same(split, P.acid(TRAIN, TEST, 100, 5, rng()))
    assert not same(split, P.acid(TRAIN, TEST, 100, 5, rng(1)))


def test_alid_is_a_permutation_per_device():
    perms = P.label_permutations(100, 10, rng())
    assert perms.shape == (100, 10)
    assert all(sorted(p.tolist()) == list(range(10)) for p in perms)
    assert len({tuple(p) for p in perms}) > 90  # devices relabel differently
    assert np.array_equal(perms, P.label_permutations(100, 10, rng()))


def test_dirichlet_proportions_sum_to_one_and_shape_the_split():
    props = P.dirichlet_proportions(10, 8, 0.3, rng())
    assert props.shape == (10, 8) and np.allclose(props.sum(axis=1), 1.0) and (props >= 0).all()
    parts = P.dirichlet(TRAIN, 8, 0.3, rng())
    assert disjoint(parts) and sum(map(len, parts)) == len(TRAIN)
    # realised counts follow the drawn proportions (same rng stream: proportions are drawn first)
    for c in range(10):
        counts = np.array([np.sum(TRAIN[p] == c) for p in parts])
        assert np.abs(counts - props[c] * 600).max() <= 1
    # smaller concentration, more skew: fewer classes that make up 95% of a client
    def classes_per_client(conc):
        ps = P.dirichlet(TRAIN, 8, conc, rng(3))
        return np.mean([np.sum(np.sort(np.bincount(TRAIN[p], minlength=10))[::-1].cumsum() < 0.95 * len(p)) + 1 for p in ps])
    assert classes_per_client(0.1) < classes_per_client(100.0)
    assert same(parts, P.dirichlet(TRAIN, 8, 0.3, rng()))


def test_shards_are_equal_label_sorted_blocks():
    parts = P.shards(TRAIN, 10, 2, rng())  # 20 shards of 300: each shard is half of one class
    assert disjoint(parts)
    for p in parts:
        assert len(p) == 600
        labels = Counter(TRAIN[p].tolist())
        assert len(labels) <= 2 and all(v % 300 == 0 for v in labels.values())
    assert same(parts, P.shards(TRAIN, 10, 2, rng()))
    assert not same(parts, P.shards(TRAIN, 10, 2, rng(1)))


def test_data_seed_run_draws_the_split_again_for_each_run_seed_and_keeps_one_setting():
    """``data.seed: run`` (issue 37's ablation: the split re-drawn per seed): each run builds its data with its own
    seed, as ``data.seed: <that seed>`` would; the setting (what the table groups seeds by) stays one."""
    import numpy as np

    from fedsweep.data import build_federated_dataset
    from fedsweep.loading import validate
    from tests.conftest import config_dict

    def counts(cfg):
        return [np.bincount(c.y_train.numpy(), minlength=10).tolist() for c in build_federated_dataset(cfg.run_data()).clients]

    data = {"dataset": "digits", "num_clients": 4, "partition": {"name": "dirichlet", "concentration": 0.5}}
    runs = [validate(config_dict(seed=s, data={**data, "seed": "run"})) for s in (0, 1)]
    fixed = [validate(config_dict(seed=s, data={**data, "seed": s})) for s in (0, 1)]
    assert runs[0].setting_key() == runs[1].setting_key() and fixed[0].setting_key() != fixed[1].setting_key()
    assert [counts(c) for c in runs] == [counts(c) for c in fixed] and counts(runs[0]) != counts(runs[1])
    assert validate(config_dict(seed=1, data=data)).run_data().seed == 0  # a fixed seed stays what it is


def test_fit_sizes_keeps_the_bounds_and_the_total():
    import numpy as np

    from fedsweep.data.partitions import fit_sizes

    draws = np.array([1200, 3800, 2500, 3000])
    sizes = fit_sizes(draws, 11_000, 1165, 3834)
    assert sizes.sum() == 11_000 and sizes.min() >= 1165 and sizes.max() <= 3834
    assert sizes[1] == 3834  # scaled past the top, so set to it; the others share the rest in their proportions
    free = sizes[[0, 2, 3]] / draws[[0, 2, 3]]
    assert free.max() - free.min() < 0.01
    assert list(fit_sizes(np.array([1, 1]), 10, 0, 10)) == [5, 5]
    with pytest.raises(ValueError, match="cannot hold 100 samples"):
        fit_sizes(draws, 100, 1165, 3834)


def test_pfedme_mnist_whole_dataset_deals_every_image_within_the_paper_s_sizes():
    """Seed 004, Sec. 5.1: 'we distribute the complete dataset to N = 20 clients', sizes in [1165, 3834], 2 labels
    each. With MNIST's class sizes (6,313-7,877), each label pair's 4 users share all of its images."""
    import numpy as np

    from fedsweep.data.partitions import pfedme_mnist

    counts = [6903, 7877, 6990, 7141, 6824, 6313, 6876, 7293, 6825, 6958]  # MNIST's 70,000, train and test pooled
    labels = np.repeat(np.arange(10), counts)
    parts = pfedme_mnist(labels, 20, 2, 1165, 3834, np.random.default_rng(0), "blocks", whole_dataset=True)
    every = np.concatenate(parts)
    assert len(every) == 70_000 and len(np.unique(every)) == 70_000  # every image, once
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 1165 - 1 and sizes.max() <= 3834 + 1  # a user's size: its target give or take k − 1
    for i, p in enumerate(parts):
        assert set(labels[p]) == {2 * (i % 5), 2 * (i % 5) + 1}
    drawn_alone = pfedme_mnist(labels, 20, 2, 1165, 3834, np.random.default_rng(0), "blocks")
    assert sum(len(p) for p in drawn_alone) < 60_000  # what the split without it uses


def test_whole_dataset_needs_disjoint_label_blocks():
    from fedsweep.config import ConfigError
    from fedsweep.loading import validate
    from tests.conftest import config_dict

    partition = {"name": "pfedme_mnist", "whole_dataset": True, "label_assignment": "chain"}
    with pytest.raises(ConfigError, match="data.partition.whole_dataset: true needs label_assignment: blocks"):
        validate(config_dict(data={"_replace": True, "dataset": "mnist", "num_clients": 20, "partition": partition}))
