"""MNIST and CIFAR loaders on tiny files that the tests write in the real on-disk formats (IDX, gzipped or
not; CIFAR's pickled "python version" batches with byte-string keys), read through the real code path."""

from __future__ import annotations

import gzip
import math
import os
import pickle
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from fedsweep.config import ConfigError
from fedsweep.data import ImageConfig, build_federated_dataset, vision
from fedsweep.engine import run_local
from fedsweep.loading import validate
from fedsweep.schema import FieldError
from tests.conftest import config_dict


def write_idx(path, array: np.ndarray, gz: bool) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / vision.SUBSET_MARKER).touch()  # a few images per class, not the official files' counts
    if gz:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(raw))
    else:
        path.write_bytes(raw)


def make_mnist(root, per_class_train=12, per_class_test=4, seed=0, folder="MNIST/raw"):
    rng = np.random.default_rng(seed)
    out = {}
    for split, per, gz in (("train", per_class_train, True), ("t10k", per_class_test, False)):
        y = np.repeat(np.arange(10), per).astype(np.uint8)
        x = rng.integers(0, 256, size=(len(y), 28, 28), dtype=np.uint8)
        write_idx(root / folder / f"{split}-images-idx3-ubyte", x, gz)
        write_idx(root / folder / f"{split}-labels-idx1-ubyte", y, gz)
        out[split] = (x, y)
    return out


def write_cifar_batch(path, x: np.ndarray, labels: list[int], label_key: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / vision.SUBSET_MARKER).touch()
    batch = {b"batch_label": b"test batch", label_key: labels, b"data": x, b"filenames": [b"f"] * len(labels)}
    path.write_bytes(pickle.dumps(batch, protocol=2))


def make_cifar10(root, per_batch=20, seed=0):
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        y = [int(v) for v in np.tile(np.arange(10), per_batch // 10)]
        x = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        write_cifar_batch(root / "cifar-10-batches-py" / name, x, y, b"labels")
        xs.append(x)
        ys.append(y)
    return np.concatenate(xs[:5]), np.concatenate(ys[:5]), xs[5], np.array(ys[5])


def test_idx_reader_plain_and_gzipped(tmp_path):
    data = make_mnist(tmp_path)
    raw = tmp_path / "MNIST/raw"
    assert np.array_equal(vision.read_idx(raw / "train-images-idx3-ubyte.gz"), data["train"][0])
    assert np.array_equal(vision.read_idx(raw / "t10k-labels-idx1-ubyte"), data["t10k"][1])
    (tmp_path / "bad").write_bytes(b"\x12\x34\x08\x01junk")
    with pytest.raises(ValueError, match="not an IDX file"):
        vision.read_idx(tmp_path / "bad")


def test_mnist_loads_through_the_dataset_config(tmp_path):
    data = make_mnist(tmp_path)
    x_tr, y_tr, x_te, y_te = vision.load("mnist", tmp_path)
    assert x_tr.shape == (120, 784) and x_te.shape == (40, 784) and x_tr.dtype == np.float32
    assert np.allclose(x_tr, data["train"][0].reshape(120, -1) / 255.0)
    assert np.array_equal(y_tr, data["train"][1]) and np.array_equal(y_te, data["t10k"][1])
    cfg = ImageConfig(dataset="mnist", root=str(tmp_path), num_clients=5, partition={"name": "acid", "classes_per_client": 2})
    ds = build_federated_dataset(cfg)
    assert (ds.num_features, ds.num_classes, len(ds.clients)) == (784, 10, 5)
    for c in ds.clients:
        assert len(set(c.y_train.tolist())) == 2 and set(c.y_test.tolist()) == set(c.y_train.tolist())
        # every image is one of the written images, scaled to [0, 1]
        assert float(c.x_train.max()) <= 1.0 and c.x_train.shape[1] == 784


def test_standardized_inputs_are_pixelwise_over_all_images_as_pfedmes_generator_computes_them(tmp_path):
    data = make_mnist(tmp_path)
    pool = np.concatenate([data["train"][0], data["t10k"][0]]).reshape(160, -1).astype(np.float64)
    mu, sigma = pool.mean(0), pool.std(0)
    expected = {row.tobytes() for row in ((pool - mu) / (sigma + 0.001)).astype(np.float32)}
    cfg = ImageConfig(dataset="mnist", root=str(tmp_path), num_clients=4, input_scaling="standardized",
                      partition={"name": "pfedme_mnist", "min_samples": 10, "max_samples": 14, "label_assignment": "chain"})
    rows = [row for c in build_federated_dataset(cfg).clients for x in (c.x_train, c.x_test) for row in x.numpy()]
    assert len(rows) >= 40 and all(row.tobytes() in expected for row in rows)
    unit = ImageConfig(**{**cfg.model_dump(), "input_scaling": "unit_interval"})
    assert all(float(c.x_train.min()) >= 0 and float(c.x_train.max()) <= 1 for c in build_federated_dataset(unit).clients)


def test_perfedavg_split_on_mnist_files(tmp_path):
    make_mnist(tmp_path, per_class_train=40, per_class_test=12)
    cfg = ImageConfig(dataset="mnist", root=str(tmp_path), num_clients=4,
                      partition={"name": "perfedavg", "a": 4, "test_images_per_class": 2})
    ds = build_federated_dataset(cfg)
    for i, c in enumerate(ds.clients):
        counts = torch.bincount(c.y_train, minlength=10)
        if i < 2:
            assert counts[:5].tolist() == [4] * 5 and counts[5:].sum() == 0
            assert torch.bincount(c.y_test, minlength=10)[:5].tolist() == [2] * 5
        else:
            assert sorted(counts[counts > 0].tolist()) == [2, 8]


def test_cifar10_batches_and_alid_relabelling(tmp_path):
    x_tr, y_tr, x_te, y_te = make_cifar10(tmp_path)
    a, b, c, d = vision.load("cifar10", tmp_path)
    assert a.shape == (100, 3072) and np.allclose(a, x_tr / 255.0) and np.array_equal(b, y_tr)
    assert np.allclose(c, x_te / 255.0) and np.array_equal(d, y_te)
    acid = build_federated_dataset(ImageConfig(dataset="cifar10", root=str(tmp_path), num_clients=4,
                                               partition={"name": "acid", "classes_per_client": 5}, seed=3))
    alid = build_federated_dataset(ImageConfig(dataset="cifar10", root=str(tmp_path), num_clients=4,
                                               partition={"name": "alid", "classes_per_client": 5}, seed=3))
    relabelled = 0
    for p, q in zip(acid.clients, alid.clients):
        assert torch.equal(p.x_train, q.x_train) and torch.equal(p.x_test, q.x_test)  # same samples
        # one permutation per device, applied to its train and test labels alike
        mapping = {}
        for y0, y1 in zip(torch.cat([p.y_train, p.y_test]).tolist(), torch.cat([q.y_train, q.y_test]).tolist()):
            assert mapping.setdefault(y0, y1) == y1
        assert len(set(mapping.values())) == len(mapping)
        relabelled += any(k != v for k, v in mapping.items())
    assert relabelled >= 3


def test_cifar100_fine_labels(tmp_path):
    rng = np.random.default_rng(0)
    for name, n in (("train", 200), ("test", 100)):
        write_cifar_batch(tmp_path / "cifar-100-python" / name, rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                          [i % 100 for i in range(n)], b"fine_labels")
    ds = build_federated_dataset(ImageConfig(dataset="cifar100", root=str(tmp_path), num_clients=3))
    assert (ds.num_classes, ds.num_features) == (100, 3072)
    assert sum(c.num_train + c.num_test for c in ds.clients) == 300


def test_missing_files_name_the_expected_files(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSWEEP_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError) as e:
        build_federated_dataset(ImageConfig(dataset="cifar10"))
    msg = str(e.value)
    assert f"cifar10 files not found under {tmp_path}" in msg
    assert "cifar-10-batches-py/data_batch_1" in msg and "cifar-10-batches-py/test_batch" in msg
    assert "FEDSWEEP_DATA_DIR" in msg


def test_a_pickle_that_names_anything_but_arrays_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    (folder / "train").write_bytes(pickle.dumps({b"data": Evil()}, protocol=2))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load posix.system"):
        vision.read_cifar_batch(folder / "train")


def test_cnn_trains_on_the_cifar_files(tmp_path):
    make_cifar10(tmp_path)
    raw = config_dict(
        data={"_replace": True, "dataset": "cifar10", "root": str(tmp_path), "num_clients": 4,
              "partition": {"name": "acid", "classes_per_client": 3}},
        model={"_replace": True, "name": "cnn", "channels": [4, 4], "hidden": [16]},
        algorithm={"local_steps": 2, "batch_size": 8},
        rounds=2,
        eval_every=1,
    )
    history, server = run_local(validate(raw))
    assert len(history) == 3 and torch.isfinite(server.params).all()
    assert 0.0 <= history[-1]["personalized_accuracy_mean"] <= 1.0


def test_subsample_keeps_each_class_share_of_the_pool_before_the_split(tmp_path):
    data = make_mnist(tmp_path, per_class_train=30, per_class_test=10)  # 40 images of each class
    pool = np.concatenate([data["train"][0], data["t10k"][0]]).reshape(400, -1)
    whole = ImageConfig(dataset="mnist", root=str(tmp_path), num_clients=4, partition={"name": "dirichlet", "concentration": 0.5})
    cut = ImageConfig(**{**whole.model_dump(), "subsample": 0.25})

    def images(cfg):
        ds = build_federated_dataset(cfg)
        x = torch.cat([t for c in ds.clients for t in (c.x_train, c.x_test)])
        y = torch.cat([t for c in ds.clients for t in (c.y_train, c.y_test)])
        return (x * 255).round().to(torch.uint8).numpy(), y.numpy()

    x, y = images(cut)
    assert len(y) == 100 and np.bincount(y).tolist() == [10] * 10  # 0.25 of every class's 40
    rows = {r.tobytes() for r in pool}
    assert len({r.tobytes() for r in x}) == 100 and all(r.tobytes() in rows for r in x)  # distinct images of the pool
    x2, y2 = images(cut)
    assert np.array_equal(x, x2) and np.array_equal(y, y2)  # the same share on every build (the split's seed)
    assert len(images(whole)[1]) == 400
    other = ImageConfig(**{**cut.model_dump(), "seed": 1})
    assert {r.tobytes() for r in images(other)[0]} != {r.tobytes() for r in x}


def test_subsample_is_refused_where_the_split_draws_its_own_counts_or_leaves_too_few_images():
    with pytest.raises(ConfigError, match=r"data\.subsample: 0\.5 with partition acid, which draws its own per-class counts"):
        validate(config_dict(data={"_replace": True, "dataset": "cifar10", "subsample": 0.5, "partition": {"name": "acid"}}))
    with pytest.raises(ConfigError, match=r"data\.num_clients: 400: mnist has 700 samples at subsample 0\.01 .* allowed: 1\.\.350"):
        validate(config_dict(data={"_replace": True, "dataset": "mnist", "subsample": 0.01, "num_clients": 400}))
    with pytest.raises(ConfigError, match=r"data\.subsample"):
        validate(config_dict(data={"_replace": True, "dataset": "mnist", "subsample": 0}))


def test_image_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="exceeds the 10 classes of cifar10"):
        validate(config_dict(data={"_replace": True, "dataset": "cifar10", "partition": {"name": "acid", "classes_per_client": 11}}))
    with pytest.raises(ConfigError, match="perfedavg needs classes 0-9"):
        validate(config_dict(data={"_replace": True, "dataset": "cifar100", "partition": {"name": "perfedavg"}}))
    with pytest.raises(ConfigError, match=r"data\.partition\.name"):
        validate(config_dict(data={"_replace": True, "dataset": "mnist", "partition": {"name": "bogus"}}))
    for _ in range(2):  # a process keeps models.parameter_count's answers, never its refusals
        with pytest.raises(ConfigError, match="model.kernel_size: 5 is too large"):
            validate(config_dict(model={"_replace": True, "name": "cnn"}))


def test_a_cnn_pooled_after_its_last_convolution_is_pfl_researchs_simple_cnn_without_dropout():
    """pfl-research's ``simple_cnn`` (benchmarks/model/pytorch/cnn.py there): 3×3 convolutions of 32 and 64
    channels, each with ReLU, one 2×2 max-pool, a dense layer of 128, the output; 1,626,442 parameters on CIFAR-10.
    ``pool: each`` (the default) stays out of a setting's key: the runs made before the field keep theirs."""
    from fedsweep.models import CNNConfig, build_model, parameter_count

    cfg = CNNConfig(channels=[32, 64], kernel_size=3, hidden=[128], pool="last")
    model = build_model(cfg, 3 * 32 * 32, 10)
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert shapes == [(32, 3, 3, 3), (32,), (64, 32, 3, 3), (64,), (128, 14 * 14 * 64), (128,), (10, 128), (10,)]
    assert parameter_count(cfg, 3 * 32 * 32, 10) == 1_626_442
    assert parameter_count(cfg, 3 * 32 * 32, 10) == 1_626_442 and parameter_count(cfg, 3 * 32 * 32, 100) == 1_638_052  # kept per inputs
    assert model(torch.zeros(2, 3 * 32 * 32)).shape == (2, 10)
    assert sum(isinstance(m, torch.nn.MaxPool2d) for m in model) == 1
    each = build_model(CNNConfig(channels=[32, 64], kernel_size=3, hidden=[128]), 3 * 32 * 32, 10)
    assert sum(isinstance(m, torch.nn.MaxPool2d) for m in each) == 2 and each[-3].in_features == 6 * 6 * 64
    base = config_dict(model={"_replace": True, "name": "cnn", "kernel_size": 3}, data={"_replace": True, "dataset": "cifar10"})
    keys = {pool: validate({**base, "model": {**base["model"], **({"pool": pool} if pool else {})}}).setting_key()
            for pool in (None, "each", "last")}
    assert keys[None] == keys["each"] != keys["last"]
    with pytest.raises(ConfigError, match=r"model\.pool"):
        validate({**base, "model": {**base["model"], "pool": "middle"}})


def test_a_cnns_max_pooling_without_autograd_gives_the_kernels_numbers():
    """``models.MaxPool2``: where autograd records nothing (evaluations) it pools with elementwise maxima (of each
    window's two rows, then of its two columns), PyTorch's kernel otherwise. Its values are the kernel's on windows
    with ties, -0.0, NaN, -inf and odd sides, in float32 and float64; with autograd its output and gradient are the
    kernel's; a whole CNN's logits, one model or stacked rows (``FlatModel.rows``, vmap), are those of the same CNN
    with ``nn.MaxPool2d``, bit for bit."""
    import copy

    import torch.nn.functional as F

    from fedsweep.models import CNNConfig, FlatModel, MaxPool2, build_model

    def same(a, b):  # equal values (-0.0 == 0.0: the one difference a maximum may make), NaN where NaN
        return a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))

    pool = MaxPool2()
    for seed in range(60):
        g = torch.Generator().manual_seed(seed)
        shape = (1 + seed % 4, 1 + seed % 3, 2 + seed % 9, 2 + (seed * 7) % 10)
        x = torch.randint(-3, 3, shape, generator=g, dtype=torch.float64 if seed % 2 else torch.float32)
        x[x == -3], x[x == -2], x[x == 2] = -0.0, -math.inf, math.nan
        with torch.no_grad():
            assert same(pool(x), F.max_pool2d(x, 2)), shape
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_a, out_b = pool(a), F.max_pool2d(b, 2)
        upstream = torch.randn(out_a.shape, generator=g, dtype=x.dtype)
        out_a.backward(upstream), out_b.backward(upstream)
        assert same(out_a, out_b) and same(a.grad, b.grad), shape

    cnn = build_model(CNNConfig(channels=[6, 16], hidden=[120, 84]), 28 * 28, 10)
    kernel = copy.deepcopy(cnn)
    for i, m in enumerate(kernel):
        if isinstance(m, MaxPool2):
            kernel[i] = torch.nn.MaxPool2d(2)
    assert sum(isinstance(m, MaxPool2) for m in cnn) == 2 and not any(isinstance(m, MaxPool2) for m in kernel)
    g = torch.Generator().manual_seed(0)
    images = torch.rand(40, 28 * 28, generator=g) * (torch.rand(40, 28 * 28, generator=g) > 0.7)  # zero backgrounds: ties
    flat, flat_kernel = FlatModel(cnn), FlatModel(kernel)
    rows = torch.stack([flat.initial_vector(s) for s in range(3)])
    with torch.no_grad():
        for w in rows:
            assert torch.equal(flat(w, images), flat_kernel(w, images))
        stacked = images[:39].view(3, 13, 28 * 28)  # each row its own inputs
        assert torch.equal(flat.rows(rows, stacked), flat_kernel.rows(rows, stacked))


# ------------------------------------------------------------------ decoded once per node


def _cache_entries(name):
    return sorted(vision.cache_dir().glob(f"{name}-*"))


def test_a_dataset_is_decoded_once_per_node_and_later_processes_map_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSWEEP_CACHE_DIR", str(tmp_path / "cache"))
    data = make_mnist(tmp_path / "root")
    first = vision.load_uint8("mnist", tmp_path / "root")
    assert first[0].dtype == np.uint8 and np.array_equal(first[0], data["train"][0].reshape(120, -1))
    [entry] = _cache_entries("mnist")
    assert sorted(p.name for p in entry.iterdir()) == ["x_test.npy", "x_train.npy", "y_test.npy", "y_train.npy"]
    # another process on the node: decoding is made to fail there, so it can only have read the cache
    code = (
        "import sys, numpy as np; from pathlib import Path; from fedsweep.data import vision\n"
        "vision._decode = lambda *a: sys.exit('decoded again')\n"
        "arrays = vision.load_uint8('mnist', Path(sys.argv[1]))\n"
        "assert all(isinstance(a, np.memmap) for a in arrays)\n"
        "np.save(sys.argv[2], arrays[0][:7])\n"
    )
    env = {**os.environ, "FEDSWEEP_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "root"), str(tmp_path / "seen.npy")],
                         env=env, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert np.array_equal(np.load(tmp_path / "seen.npy"), first[0][:7])
    # the float shards are the same whether the images came from the files or from the cache
    assert np.array_equal(vision.load("mnist", tmp_path / "root")[0], first[0].astype(np.float32) / 255.0)


def test_a_changed_source_file_gets_a_new_cache_entry_and_no_cache_still_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSWEEP_CACHE_DIR", str(tmp_path / "cache"))
    make_mnist(tmp_path / "root")
    vision.load_uint8("mnist", tmp_path / "root")
    data = make_mnist(tmp_path / "root", per_class_train=13, seed=1)  # same paths, new content
    x_tr, y_tr, _, _ = vision.load_uint8("mnist", tmp_path / "root")
    assert len(_cache_entries("mnist")) == 2 and np.array_equal(x_tr, data["train"][0].reshape(130, -1))
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("FEDSWEEP_CACHE_DIR", str(blocked / "cache"))
    x_tr2, y_tr2, _, _ = vision.load_uint8("mnist", tmp_path / "root")  # cannot cache: decodes, says nothing
    assert np.array_equal(x_tr2, x_tr) and np.array_equal(y_tr2, y_tr)


# ------------------------------------------------------------------ Fashion-MNIST


def test_fashion_mnist_from_the_data_root_or_the_debian_package_folder(tmp_path, monkeypatch):
    data = make_mnist(tmp_path / "root", per_class_train=40, per_class_test=12, folder="FashionMNIST/raw", seed=5)
    cfg = ImageConfig(dataset="fashion_mnist", root=str(tmp_path / "root"), num_clients=4,
                      partition={"name": "perfedavg", "a": 4, "test_images_per_class": 2})
    ds = build_federated_dataset(cfg)
    assert (ds.num_features, ds.num_classes, len(ds.clients)) == (784, 10, 4)
    assert np.array_equal(vision.load_uint8("fashion_mnist", tmp_path / "root")[1], data["train"][1])
    # Debian's dataset-fashion-mnist puts the four files in one flat folder
    debian = tmp_path / "usr-share-datasets-fashion-mnist"
    make_mnist(debian, per_class_train=40, per_class_test=12, folder=".", seed=5)
    monkeypatch.setitem(vision.SYSTEM_FOLDERS, "fashion_mnist", [debian])
    empty = tmp_path / "empty-root"
    empty.mkdir()
    assert vision.dataset_folder("fashion_mnist", empty) == debian
    assert np.array_equal(vision.load_uint8("fashion_mnist", empty)[0], vision.load_uint8("fashion_mnist", tmp_path / "root")[0])
    monkeypatch.setitem(vision.SYSTEM_FOLDERS, "fashion_mnist", [tmp_path / "absent"])
    with pytest.raises(FileNotFoundError) as e:
        vision.load_uint8("fashion_mnist", empty)
    assert "FashionMNIST/raw/train-images-idx3-ubyte" in str(e.value) and str(tmp_path / "absent") in str(e.value)


def test_subsample_at_its_default_leaves_a_settings_key_as_it_was_before_the_field():
    import hashlib
    import json

    cfg = validate(config_dict(data={"_replace": True, "dataset": "mnist", "num_clients": 4}))
    d = cfg.model_dump(mode="json", exclude={"seed", "name", "resources", "tracking"})
    assert d["data"].pop("subsample") == 1.0
    before = hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]  # the key without the field
    assert cfg.setting_key() == before  # so `fedsweep bench --resume` keeps the results recorded before it
    cut = validate(config_dict(data={"_replace": True, "dataset": "mnist", "num_clients": 4, "subsample": 0.1}))
    assert cut.setting_key() != before


def test_pixels_become_float32_in_the_unit_interval_as_the_plain_division_gives_them():
    from fedsweep.data.vision import to_float

    images = np.arange(256, dtype=np.uint8).reshape(16, 16)
    out = to_float(images)
    assert out.dtype == np.float32 and out.shape == images.shape
    assert np.array_equal(out, np.asarray(images, dtype=np.float32) / 255.0)  # every pixel value, bit for bit
    assert out[0, 0] == 0.0 and out[-1, -1] == 1.0 and images[-1, -1] == 255  # the input is left as it was


@pytest.mark.parametrize("partition", [
    {"name": "iid"}, {"name": "label_skew", "classes_per_client": 2}, {"name": "dirichlet", "concentration": 0.3},
    {"name": "shards", "shards_per_client": 2}, {"name": "perfedavg", "a": 4, "test_images_per_class": 2},
    {"name": "pfedme_mnist", "min_samples": 10, "max_samples": 14, "label_assignment": "chain"},
    {"name": "acid", "classes_per_client": 2}, {"name": "alid", "classes_per_client": 2}], ids=lambda p: p["name"])
def test_the_checks_labels_only_build_is_the_full_builds_split(tmp_path, partition):
    """What a sweep's checks build (``inputs=False``: zero-width images, the pixels neither copied nor converted)
    has every shard's labels, sizes and validation part of the dataset its trials build, and fails as that does."""
    make_mnist(tmp_path, per_class_train=40, per_class_test=12)
    cfg = ImageConfig(dataset="mnist", root=str(tmp_path), num_clients=4, partition=partition, validation_fraction=0.2)
    full, labels = build_federated_dataset(cfg), build_federated_dataset(cfg, inputs=False)
    assert (labels.num_features, labels.num_classes) == (full.num_features, full.num_classes) == (784, 10)
    for a, b in zip(full.clients, labels.clients, strict=True):
        for ya, yb in ((a.y_train, b.y_train), (a.y_test, b.y_test), (a.y_val, b.y_val)):
            assert torch.equal(ya, yb)
        assert b.x_train.shape == (a.num_train, 0) and b.x_test.shape == (a.num_test, 0)
    too_many = ImageConfig(**{**cfg.model_dump(), "num_clients": 400})
    errors = []
    for inputs in (True, False):
        with pytest.raises((ValueError, FieldError)) as e:
            build_federated_dataset(too_many, inputs=inputs)
        errors.append(str(e.value))
    assert errors[0] == errors[1]
