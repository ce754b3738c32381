"""The real MNIST and CIFAR-10 files, and every paper split of the shipped protocol files on them.

Not in the default suite (unit tests never need the real data): run it with

    FEDSWEEP_DATA_DIR=../shared/data .venv/bin/python -m pytest -m real_data

It fails, naming the folder, when the files are not there: a check that was asked for is never skipped.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from fedsweep.data import ImageConfig, PerFedAvgPartition, build_federated_dataset, vision
from fedsweep.loading import load_sweep
from tests.conftest import MNIST_COUNTS, ROOT

pytestmark = pytest.mark.real_data

DATA = Path(os.environ.get("FEDSWEEP_DATA_DIR") or ROOT.parent / "shared" / "data").resolve()

# MD5s of torchvision's dataset classes (torchvision/datasets/mnist.py, cifar.py), as ../shared/data/README.md lists them.
MD5 = {
    "MNIST/raw/train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "MNIST/raw/train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "MNIST/raw/t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "MNIST/raw/t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    "cifar-10-batches-py/data_batch_1": "c99cafc152244af753f735de768cd75f",
    "cifar-10-batches-py/data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
    "cifar-10-batches-py/data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
    "cifar-10-batches-py/data_batch_4": "634d18415352ddfa80567beed471001a",
    "cifar-10-batches-py/data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
    "cifar-10-batches-py/test_batch": "40351d587109b95175f43aff81a1287e",
}

PROTOCOLS = ["perfedavg_table1_mnist", "perfedavg_table1_cifar10", "perfedavg_table1_cifar10_diff_hetero",
             "pfedme_table1_mnist", "pfedme_table1_mnist_authors_data",
             "pfedme_table1_mnist_ablation", "pfl_acid_cifar10", "cifar_grid"]


@pytest.fixture(scope="module", autouse=True)
def real_files():
    missing = [f for f in MD5 if not (DATA / f).is_file()]
    assert not missing, f"real-data check: {DATA} lacks {missing} (set FEDSWEEP_DATA_DIR to the folder of MNIST/ and cifar-10-batches-py/)"
    before = os.environ.get("FEDSWEEP_DATA_DIR")
    os.environ["FEDSWEEP_DATA_DIR"] = str(DATA)  # the protocol files name no root: they read this
    yield
    if before is None:
        del os.environ["FEDSWEEP_DATA_DIR"]
    else:
        os.environ["FEDSWEEP_DATA_DIR"] = before


@pytest.mark.parametrize("name", sorted(MD5))
def test_the_files_are_the_official_ones(name):
    assert hashlib.md5((DATA / name).read_bytes()).hexdigest() == MD5[name]


def test_class_counts_of_the_pools():
    _, y_tr, _, y_te = vision.load_uint8("mnist", DATA)
    assert np.bincount(y_tr).tolist() == MNIST_COUNTS["train"] and np.bincount(y_te).tolist() == MNIST_COUNTS["t10k"]
    x_tr, y_tr, x_te, y_te = vision.load_uint8("cifar10", DATA)
    assert x_tr.shape == (50000, 3072) and x_te.shape == (10000, 3072)
    assert np.bincount(y_tr).tolist() == [5000] * 10 and np.bincount(y_te).tolist() == [1000] * 10


def _data_configs(protocol: str) -> list[ImageConfig]:
    sweep = load_sweep(ROOT / "sweeps" / f"{protocol}.yaml", check_cluster=False)
    seen: dict[str, ImageConfig] = {}
    for t in sweep.trials:
        seen.setdefault(t.config.data.model_dump_json(), t.config.data)
    return list(seen.values())


def _counts(y) -> Counter:
    return Counter(int(v) for v in y.tolist())


def check_perfedavg(cfg: ImageConfig, clients) -> None:
    p: PerFedAvgPartition = cfg.partition
    pool = 60000 if cfg.dataset == "mnist" else 50000
    for part, a in (("train", p.images_per_class), ("test", p.images_per_class * 10000 // pool)):
        lows, highs = Counter(), Counter()
        for i, c in enumerate(clients):
            counts = _counts(c.y_train if part == "train" else c.y_test)
            if i < len(clients) // 2:  # n = 50: users 0-24 hold a of each of classes 0-4
                assert counts == {k: a for k in range(5)}, (part, i, counts)
                continue
            high = [k for k in counts if k >= 5]
            low = [k for k in counts if k < 5]
            assert len(high) == 1 and counts[high[0]] == 2 * a, (part, i, counts)
            if p.diff_hetero:
                assert not low, (part, i, counts)
            else:
                assert len(low) == 1 and counts[low[0]] == a // 2, (part, i, counts)
                lows[low[0]] += 1
            highs[high[0]] += 1
        assert highs == {k: 5 for k in range(5, 10)} and (p.diff_hetero or lows == {k: 5 for k in range(5)})


def check_pfedme_mnist(cfg: ImageConfig, clients) -> None:
    p = cfg.partition
    k = 2 if p.label_assignment == "blocks" else 1  # where user i's pair starts: 2i or i
    for i, c in enumerate(clients):
        labels = {(k * i) % 10, (k * i + 1) % 10}
        both = _counts(np.concatenate([c.y_train.numpy(), c.y_test.numpy()]))
        assert set(both) == labels, (i, both)
        total = sum(both.values())
        assert p.min_samples <= total <= p.max_samples
        assert c.num_test == round(total * cfg.test_fraction) or abs(c.num_test - total * cfg.test_fraction) <= 1


def check_acid(cfg: ImageConfig, clients) -> None:
    k = cfg.partition.classes_per_client
    per_class_train = 5000 * 10 // (cfg.num_clients * k)
    per_class_test = 1000 * 10 // (cfg.num_clients * k)
    for i, c in enumerate(clients):
        # a validation part (data.validation_fraction) is held out of the training images the split gave
        held = np.concatenate([c.y_train.numpy()] + ([c.y_val.numpy()] if c.num_val else []))
        tr, te = _counts(held), _counts(c.y_test)
        assert set(tr) == set(te) and len(tr) == k, (i, tr, te)
        assert set(tr.values()) == {per_class_train} and set(te.values()) == {per_class_test}, (i, tr, te)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_paper_split_of_the_protocol_files_on_the_real_files(protocol):
    configs = _data_configs(protocol)
    assert configs
    for cfg in configs:
        ds = build_federated_dataset(cfg)
        assert len(ds.clients) == cfg.num_clients
        {"perfedavg": check_perfedavg, "pfedme_mnist": check_pfedme_mnist, "acid": check_acid}[cfg.partition.name](cfg, ds.clients)
