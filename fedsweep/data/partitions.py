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


def deal_classes(classes: np.ndarray, num_clients: int, classes_per_client: int, rng: np.random.Generator) -> list[list[int]]:
    """Each client's list of ``classes_per_client`` = k distinct classes, dealt from a stream of seeded
    permutations of the class list: a client takes the first k classes at the stream's front that it does not
    hold yet (a class it holds waits there for the next client), and the stream grows by a fresh permutation
    whenever it runs short. Every class is held by the same number of clients give or take one, and the lists
    vary from client to client (Acar et al.'s ACID: "a fixed sized class list to each device", "many devices
    where each of them have strictly different classes"). Until 2026-11-25 the classes were dealt round-robin
    over one permutation, which gives at most C / gcd(k, C) distinct lists (two lists for 5 of 10 classes)."""
    if classes_per_client > len(classes):
        raise ValueError(f"classes_per_client={classes_per_client} exceeds the {len(classes)} classes")
    stream: list[int] = []
    held = []
    for _ in range(num_clients):
        mine: list[int] = []
        while len(mine) < classes_per_client:
            at = next((i for i, c in enumerate(stream) if c not in mine), None)
            if at is None:
                stream += [int(c) for c in rng.permutation(classes)]
            else:
                mine.append(stream.pop(at))
        held.append(sorted(mine))
    return held


def _split_among_holders(labels: np.ndarray, held: list[list[int]], rng: np.random.Generator) -> list[np.ndarray]:
    """Each class's samples, shuffled and split evenly among the clients whose lists hold it (disjoint parts)."""
    parts: list[list[np.ndarray]] = [[] for _ in held]
    for c in np.unique(labels):
        holders = [i for i, mine in enumerate(held) if c in mine]
        members = rng.permutation(np.flatnonzero(labels == c))
        for i, chunk in zip(holders, np.array_split(members, len(holders)) if holders else []):
            parts[i].append(chunk)
    return [np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64) for p in parts]


def label_skew(
    labels: np.ndarray, num_clients: int, classes_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Each client holds exactly ``classes_per_client`` classes, dealt by :func:`deal_classes` (so every class
    is held by some client whenever n·k ≥ C); each class's samples are shuffled and split evenly among the
    clients that hold it."""
    return _split_among_holders(labels, deal_classes(np.unique(labels), num_clients, classes_per_client, rng), rng)


def train_test_split(indices: np.ndarray, test_fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A client's own random train/test split, with at least one sample on each side."""
    perm = rng.permutation(indices)
    n_test = min(max(1, round(test_fraction * len(perm))), len(perm) - 1)
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


def validation_split(labels: np.ndarray, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Positions (kept for training, held out for validation) of a client's training samples: a share
    ``fraction`` held out, at least one and never all, stratified by label (also the kept share of a pool that
    ``data.subsample`` cuts) (each label gives its share,
    the rounding remainders go to the labels with the largest fractional parts)."""
    n = len(labels)
    n_val = min(max(1, round(fraction * n)), n - 1)
    classes, counts = np.unique(labels, return_counts=True)
    exact = counts * n_val / n
    take = np.floor(exact).astype(np.int64)
    for c in np.argsort(-(exact - take), kind="stable")[: n_val - int(take.sum())]:
        take[c] += 1
    val = np.concatenate([rng.permutation(np.flatnonzero(labels == c))[:k] for c, k in zip(classes, take)])
    return np.setdiff1d(np.arange(n), val), np.sort(val)


# --- Splits of a dataset that comes with its own train and test pools (MNIST, CIFAR) -----------------
# Each returns one (train indices, test indices) pair per client, indices into the train and the test
# pool; a client's test part is drawn from the same classes, in the same way, as its train part.

Split = list[tuple[np.ndarray, np.ndarray]]


def _class_pools(labels: np.ndarray, rng: np.random.Generator) -> dict[int, list[int]]:
    """Shuffled indices of each class, consumed front to back by the draws (draws are without replacement)."""
    return {int(c): rng.permutation(np.flatnonzero(labels == c)).tolist() for c in np.unique(labels)}


def _draw(pools: dict[int, list[int]], cls: int, count: int, what: str, smaller: str) -> np.ndarray:
    """``count`` samples of class ``cls``; ``smaller`` names the settings that ask for fewer."""
    pool = pools.get(cls, [])
    if count > len(pool):
        raise ValueError(f"{what}: class {cls} has {len(pool)} samples left, {count} needed; allowed: fewer clients "
                         f"(num_clients) or {smaller}")
    taken, pools[cls] = pool[:count], pool[count:]
    return np.asarray(taken, dtype=np.int64)


def perfedavg(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    num_clients: int,
    a_train: int,
    a_test: int,
    diff_hetero: bool,
    rng: np.random.Generator,
) -> Split:
    """Per-FedAvg's split (Fallah et al. 2020, Sec. 5): the first ⌈n/2⌉ users hold ``a`` images of each
    of classes 0-4; each other user holds a/2 images of one class in 0-4 and 2a of one class in 5-9
    (``diff_hetero``: only the 2a). The paper wants "the distribution of images over all the users" different:
    user j of the second half takes low[j mod 5] and high[(j + ⌊j/5⌋) mod 5] of seeded permutations of 0-4 and
    5-9, so its 25 first users hold the 25 pairs, each class as often as the others (until 2026-11-25 the pair
    was (low[j mod 5], high[j mod 5]): 5 pairs). Test data is split the same way with ``a_test``.
    """
    half = (num_clients + 1) // 2
    low, high = rng.permutation(5), 5 + rng.permutation(5)
    recipes: list[list[tuple[int, float]]] = []  # (class, multiple of a)
    for i in range(num_clients):
        if i < half:
            recipes.append([(c, 1.0) for c in range(5)])
        else:
            j = i - half
            recipe = [(int(high[(j + j // 5) % 5]), 2.0)]
            if not diff_hetero:
                recipe.insert(0, (int(low[j % 5]), 0.5))
            recipes.append(recipe)
    out = []
    pools = {"train": _class_pools(train_labels, rng), "test": _class_pools(test_labels, rng)}
    for i, recipe in enumerate(recipes):
        pair = []
        for part, a in (("train", a_train), ("test", a_test)):
            idx = [_draw(pools[part], c, int(m * a), f"data.partition: the perfedavg split, user {i} of {num_clients}, "
                         f"{part} (a={a})", "fewer images per user (images_per_class, test_images_per_class)")
                   for c, m in recipe]
            pair.append(np.sort(np.concatenate(idx)))
        out.append((pair[0], pair[1]))
    return out


def acid(
    train_labels: np.ndarray, test_labels: np.ndarray, num_clients: int, classes_per_client: int, rng: np.random.Generator
) -> Split:
    """ACID (Acar et al. 2021): each device gets a list of ``classes_per_client`` classes
    (:func:`deal_classes`: varied lists, every class held by as many devices give or take one) and its train
    and test samples are drawn without replacement from those classes, disjoint across devices: each class's
    train and test pools are split evenly among its holders."""
    held = deal_classes(np.unique(np.concatenate([train_labels, test_labels])), num_clients, classes_per_client, rng)
    return list(zip(_split_among_holders(train_labels, held, rng), _split_among_holders(test_labels, held, rng)))


def label_permutations(num_clients: int, num_classes: int, rng: np.random.Generator) -> np.ndarray:
    """ALID's relabelling (Acar et al. 2021): row i is device i's permutation of the class indices;
    device i sees label ``perm[i, y]`` where the pool says ``y``."""
    return np.stack([rng.permutation(num_classes) for _ in range(num_clients)])


def pfedme_mnist(
    labels: np.ndarray,
    num_clients: int,
    labels_per_client: int,
    min_samples: int,
    max_samples: int,
    rng: np.random.Generator,
    label_assignment: str = "blocks",
    whole_dataset: bool = False,
) -> list[np.ndarray]:
    """pFedMe's MNIST split (Dinh et al. 2020, Sec. 5): over the pooled train and test images, user i
    holds ``labels_per_client`` = k consecutive labels and a total size drawn uniformly from
    [min_samples, max_samples], divided evenly between its labels. The caller splits each user 75/25
    into train and test (:func:`train_test_split`).

    Where user i's labels start (the paper does not say): ``blocks`` at (i·k) mod C, so that with k = 2
    the users form five disjoint pairs {0,1}, {2,3}, …; ``chain`` at i mod C, as the authors' generator
    (``data/Mnist/generate_niid_20users.py``) does: overlapping pairs {0,1}, {1,2}, …, {9,0}.

    ``whole_dataset`` (the paper: "we distribute the complete dataset to N = 20 clients", with sizes in
    [1165, 3834]): every image is dealt. The users of each label block share all of its images: their sizes are
    drawn as above, then scaled to the block's total within [min, max] (:func:`fit_sizes`), and each of the
    block's classes is split among them in proportion to those sizes, so that a user's size is its target
    give or take k − 1. Blocks only (the chain's blocks overlap).
    """
    classes = np.unique(labels)
    if labels_per_client > len(classes):
        raise ValueError(f"labels_per_client={labels_per_client} exceeds the {len(classes)} classes")
    pools = _class_pools(labels, rng)
    if whole_dataset:
        return _pfedme_whole(labels, classes, num_clients, labels_per_client, min_samples, max_samples, rng, pools)
    out = []
    for i in range(num_clients):
        size = int(rng.integers(min_samples, max_samples + 1))
        start = i * labels_per_client if label_assignment == "blocks" else i
        mine = [int(classes[(start + j) % len(classes)]) for j in range(labels_per_client)]
        counts = [len(c) for c in np.array_split(np.arange(size), labels_per_client)]
        out.append(np.sort(np.concatenate([_draw(pools, c, k, f"data.partition: the pfedme_mnist split, user {i}",
                                                          "smaller users (min_samples, max_samples)") for c, k in zip(mine, counts)])))
    return out


def fit_sizes(draws: np.ndarray, total: int, low: int, high: int) -> np.ndarray:
    """Integer sizes in [low, high] summing to ``total``, in the draws' proportions as far as the bounds allow:
    the draws are scaled to the total, those past a bound are set to it, the rest scaled again, until none is
    past; then rounded by largest remainders."""
    n = len(draws)
    if not n * low <= total <= n * high:
        raise ValueError(f"{n} users cannot hold {total} samples between {low} and {high} each")
    sizes, fixed = draws.astype(float), np.zeros(n, bool)
    while True:
        free = ~fixed
        sizes[free] = draws[free] * (total - sizes[fixed].sum()) / draws[free].sum()
        past = free & ((sizes > high) | (sizes < low))
        if not past.any():
            break
        sizes[past], fixed = np.clip(sizes[past], low, high), fixed | past
    return _largest_remainder(sizes, total)


def _largest_remainder(values: np.ndarray, total: int) -> np.ndarray:
    """Integers summing to ``total``: the floors, plus one for the largest fractional parts."""
    out = np.floor(values).astype(np.int64)
    out[np.argsort(-(values - out), kind="stable")[: total - int(out.sum())]] += 1
    return out


def _pfedme_whole(labels: np.ndarray, classes: np.ndarray, num_clients: int, k: int, low: int, high: int,
                  rng: np.random.Generator, pools: dict[int, list[int]]) -> list[np.ndarray]:
    """:func:`pfedme_mnist` with ``whole_dataset``: each label block's images shared by its users."""
    blocks = len(classes) // k
    if len(classes) % k or num_clients < blocks:
        raise ValueError(f"the whole dataset is dealt in disjoint blocks of labels_per_client={k} labels: it needs k to "
                         f"divide the {len(classes)} classes and at least {len(classes) // max(k, 1)} users; allowed: such "
                         "values, or whole_dataset: false")
    targets = np.array([int(rng.integers(low, high + 1)) for _ in range(num_clients)])
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for b in range(blocks):
        users = [i for i in range(num_clients) if i % blocks == b]
        mine = [int(c) for c in classes[b * k:(b + 1) * k]]
        total = sum(len(pools[c]) for c in mine)
        try:
            sizes = fit_sizes(targets[users], total, low, high)
        except ValueError as e:
            raise ValueError(f"data.partition: the pfedme_mnist split, labels {mine}: {e}; allowed: min_samples and "
                             "max_samples around (block's images / its users), or whole_dataset: false") from None
        for c in mine:
            counts = _largest_remainder(sizes * len(pools[c]) / total, len(pools[c]))
            for u, count in zip(users, counts):
                parts[u].append(_draw(pools, c, int(count), "data.partition: the pfedme_mnist split", "smaller users"))
    return [np.sort(np.concatenate(p)) for p in parts]


def dirichlet_proportions(num_classes: int, num_clients: int, concentration: float, rng: np.random.Generator) -> np.ndarray:
    """Row c: the share of class c's samples given to each client, drawn from Dir(concentration · 1_n)."""
    return rng.dirichlet(np.full(num_clients, concentration), size=num_classes)


def dirichlet(labels: np.ndarray, num_clients: int, concentration: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Label-distribution skew: each class's shuffled samples are cut among the clients in the proportions of a
    Dirichlet draw over the clients (the per-class scheme of PFLlib, pFL-Bench and NIID-Bench; Hsu et al. 2019 draw
    each client's mix over the classes instead); small ``concentration`` = few classes per client. No redraw: a
    client may get very few samples (fewer than 2 is refused when the split is built)."""
    classes = np.unique(labels)
    props = dirichlet_proportions(len(classes), num_clients, concentration, rng)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, p in zip(classes, props):
        members = rng.permutation(np.flatnonzero(labels == c))
        cuts = np.round(np.cumsum(p)[:-1] * len(members)).astype(int)
        for i, chunk in enumerate(np.split(members, cuts)):
            parts[i].append(chunk)
    return [np.sort(np.concatenate(p)) for p in parts]


def shards(labels: np.ndarray, num_clients: int, shards_per_client: int, rng: np.random.Generator) -> list[np.ndarray]:
    """The pathological split of McMahan et al. 2017: samples sorted by label (ties in seeded order) are
    cut into n·s equal shards, and each client receives s shards chosen at random."""
    order = np.lexsort((rng.permutation(len(labels)), labels))
    cut = np.array_split(order, num_clients * shards_per_client)
    dealt = rng.permutation(len(cut)).reshape(num_clients, shards_per_client)
    return [np.sort(np.concatenate([cut[s] for s in row])) for row in dealt]
