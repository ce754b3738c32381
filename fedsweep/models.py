"""Models, and a functional view of a model as one flat parameter vector."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, PositiveInt
from torch import nn

from fedsweep.conv_kernels import native_convolutions
from fedsweep.schema import FieldError, StrictModel

ACTIVATIONS = {"relu": nn.ReLU, "elu": nn.ELU, "tanh": nn.Tanh}


Norm = Literal["none", "batch"]
NORM_HELP = ("'batch': batch normalization after each hidden layer and convolution (before its activation), its running statistics "
             "part of the model's state (FedBN keeps them and the layers' weights local); 'none': no normalization.")


class MLRConfig(StrictModel):
    """Multinomial logistic regression: one linear layer followed by softmax."""

    name: Literal["mlr"] = "mlr"


class MLPConfig(StrictModel):
    """Fully connected network with ``hidden`` layer widths."""

    name: Literal["mlp"] = "mlp"
    hidden: list[PositiveInt] = Field(default_factory=lambda: [20], min_length=1)
    activation: Literal["relu", "elu", "tanh"] = "relu"
    norm: Norm = Field("none", description=NORM_HELP)


class CNNConfig(StrictModel):
    """Two 5×5 convolutions, each followed by ReLU and 2×2 max-pooling, then fully connected layers
    (``hidden``) and the output layer: the CIFAR CNN of the PFL paper (Acar et al. 2021) and of
    McMahan et al. 2017 with the defaults. ``pool: last`` pools once, after the last convolution:
    with ``channels: [32, 64]``, ``kernel_size: 3`` and ``hidden: [128]``, pfl-research's ``simple_cnn``
    without its dropout. Inputs are flattened images; their shape is inferred."""

    name: Literal["cnn"] = "cnn"
    channels: list[PositiveInt] = Field(default_factory=lambda: [64, 64], min_length=2, max_length=2)
    hidden: list[PositiveInt] = Field(default_factory=lambda: [384, 192], min_length=1)
    kernel_size: PositiveInt = 5
    pool: Literal["each", "last"] = Field("each", description="2×2 max-pooling after each convolution ('each'), or once "
                                          "after the last ('last')")
    norm: Norm = Field("none", description=NORM_HELP)


ModelConfig = MLRConfig | MLPConfig | CNNConfig


def image_shape(num_features: int) -> tuple[int, int, int]:
    """(channels, side, side) of a flattened square image with 1 or 3 channels."""
    for c in (1, 3):
        side = round((num_features / c) ** 0.5)
        if num_features % c == 0 and side * side * c == num_features:
            return c, side, side
    raise FieldError("model.name", f"cnn needs square images with 1 or 3 channels; the inputs have {num_features} features")


class MaxPool2(nn.MaxPool2d):
    """2×2 max-pooling, stride 2 (``nn.MaxPool2d(2)``). Where autograd records nothing (an evaluation, a method's
    scoring under ``torch.no_grad``) it takes elementwise maxima, of each window's two rows and then of its two
    columns: PyTorch's CPU kernel also computes the index of every window's maximum, one window at a time, and took
    6-11× as long (batches of 20, 600 and 4,096 images of LeNet-5's two layers, one thread). A maximum rounds
    nothing, so the values are the kernel's, NaN included; only where a window holds both -0.0 and +0.0 may the sign
    of that zero differ, which no product, sum, ReLU or softmax after it turns into a number other than a zero.
    Training keeps the kernel (its indices route the gradient), so every step's numbers stay the same, and so does
    a GPU (its kernel not measured against this). Forward-mode AD under ``no_grad`` (``torch.func.jvp``) would take the
    elementwise path, whose tangent at a tie is the tied inputs' mean: nothing in fedsweep uses it."""

    def __init__(self) -> None:
        super().__init__(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.device.type != "cpu":
            return super().forward(x)
        h, w = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2
        rows = torch.maximum(x[..., 0:h:2, :w], x[..., 1:h:2, :w])  # each window's two rows, then its two columns
        return torch.maximum(rows[..., 0::2], rows[..., 1::2])


def _cnn(cfg: CNNConfig, num_features: int, num_classes: int) -> nn.Sequential:
    c, side, _ = image_shape(num_features)
    layers: list[nn.Module] = [nn.Unflatten(1, (c, side, side))]
    for i, out in enumerate(cfg.channels):
        pool = cfg.pool == "each" or i == len(cfg.channels) - 1
        layers += [nn.Conv2d(c, out, cfg.kernel_size), *([nn.BatchNorm2d(out)] if cfg.norm == "batch" else []),
                   nn.ReLU(), *([MaxPool2()] if pool else [])]
        side = (side - cfg.kernel_size + 1) // (2 if pool else 1)
        c = out
        if side < 1:
            raise FieldError("model.kernel_size", f"{cfg.kernel_size} is too large for {image_shape(num_features)} images")
    layers.append(nn.Flatten())
    width = c * side * side
    for h in cfg.hidden:
        layers += [nn.Linear(width, h), *([nn.BatchNorm1d(h)] if cfg.norm == "batch" else []), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def build_model(cfg: ModelConfig, num_features: int, num_classes: int) -> nn.Module:
    if cfg.name == "mlr":
        return nn.Linear(num_features, num_classes)
    if cfg.name == "cnn":
        if native_convolutions():  # $FEDSWEEP_CONV, applied in the process that builds (and so computes) a CNN
            torch.backends.mkldnn.enabled = False
        return _cnn(cfg, num_features, num_classes)
    layers: list[nn.Module] = []
    width = num_features
    for h in cfg.hidden:
        layers += [nn.Linear(width, h), *([nn.BatchNorm1d(h)] if cfg.norm == "batch" else []), ACTIVATIONS[cfg.activation]()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


#: :func:`parameter_count`'s answers, per (model section, inputs, classes), in this process.
_COUNTS: dict[tuple[str, int, int], int] = {}


def parameter_count(cfg: ModelConfig, num_features: int, num_classes: int) -> int:
    """The model's number of parameters, without allocating them (built on PyTorch's meta device, once per model
    section and input shape in a process: a CNN's build took 3 ms, 90% of validating a config, and a benchmark
    file validates 600); raises ValueError where the inputs do not fit the model."""
    key = (cfg.model_dump_json(), num_features, num_classes)
    if key not in _COUNTS:
        with torch.device("meta"):
            _COUNTS[key] = sum(p.numel() for p in build_model(cfg, num_features, num_classes).parameters())
    return _COUNTS[key]


#: :meth:`FlatModel.initial_vector`'s vectors, per (architecture, seed), in this process.
_INITIAL: dict[tuple[str, int], torch.Tensor] = {}

#: Module types whose parameters form the ``norm`` group of a :class:`ParamLayout` (FedBN keeps them local).
NORM_LAYERS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm)


class ParamLayout:
    """Where each named parameter lies in the flat vector, and named groups of them.

    ``slices[name]`` is the parameter's slice of the vector; a group is a tuple of parameter names. The default
    groups: ``head`` (the parameters of the last layer: the classifier), ``body`` (the rest: the representation
    r_w(x)) and ``norm`` (the parameters of normalization layers; empty for models without any).
    :meth:`regroup` builds another split from layer names (prefixes of parameter names).

    Every method works on the last dimension, so a stacked matrix of client rows (:mod:`.algorithms.stacked`)
    is handled as one vector; a group whose parameters are contiguous in the vector (``head`` and ``body`` are)
    is read as a view, without a copy.
    """

    def __init__(self, names: list[str], numels: list[int], groups: dict[str, tuple[str, ...]]):
        self.names = tuple(names)
        self.numel = sum(numels)
        offsets = [0]
        for n in numels:
            offsets.append(offsets[-1] + n)
        self.slices = {name: slice(a, b) for name, a, b in zip(names, offsets, offsets[1:])}
        unknown = sorted({n for g in groups.values() for n in g} - set(names))
        if unknown:
            raise ValueError(f"unknown parameters {unknown}; allowed: {list(names)}")
        self.groups = {k: tuple(n for n in names if n in set(v)) for k, v in groups.items()}
        self._index: dict[str, torch.Tensor | slice] = {}

    def regroup(self, **layers: list[str]) -> ParamLayout:
        """This layout with groups given by layer names: a parameter belongs to group ``g`` when its name is
        ``layers[g]``'s entry or starts with it followed by a dot (``"2"`` holds ``"2.weight"`` and ``"2.bias"``)."""
        groups = dict(self.groups)
        if "head" in layers and "body" not in layers:  # the body is what the head is not
            head = {n for n in self.names if any(n == p or n.startswith(p + ".") for p in layers["head"])}
            groups["body"] = tuple(n for n in self.names if n not in head)
        for group, prefixes in layers.items():
            groups[group] = tuple(n for n in self.names if any(n == p or n.startswith(p + ".") for p in prefixes))
            unmatched = [p for p in prefixes if not any(n == p or n.startswith(p + ".") for n in self.names)]
            if unmatched:
                raise ValueError(f"layers {unmatched} name no parameter; allowed: {list(self.names)}")
        numels = [self.slices[n].stop - self.slices[n].start for n in self.names]
        return ParamLayout(list(self.names), numels, groups)

    def index(self, group: str) -> torch.Tensor | slice:
        """The group's positions in the vector: a slice when they are contiguous (or the group is empty), else
        an index tensor."""
        if group not in self._index:
            parts = [self.slices[n] for n in self.groups[group]]
            if not parts:
                self._index[group] = slice(0, 0)
            elif all(a.stop == b.start for a, b in itertools.pairwise(parts)):
                self._index[group] = slice(parts[0].start, parts[-1].stop)
            else:
                self._index[group] = torch.cat([torch.arange(p.start, p.stop) for p in parts])
        return self._index[group]

    def size(self, group: str) -> int:
        return sum(self.slices[n].stop - self.slices[n].start for n in self.groups[group])

    def select(self, vector: torch.Tensor, group: str) -> torch.Tensor:
        """The group's entries of ``vector`` (its last dimension): a view when contiguous."""
        idx = self.index(group)
        return vector[..., idx] if isinstance(idx, slice) else vector.index_select(-1, idx.to(vector.device))

    def join(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The vector whose groups' entries are ``parts`` (groups that together cover every parameter once)."""
        first = next(iter(parts.values()))
        out = first.new_empty((*first.shape[:-1], self.numel))
        for group, values in parts.items():
            idx = self.index(group)
            out[..., idx if isinstance(idx, slice) else idx.to(out.device)] = values
        return out

    def merge(self, vector: torch.Tensor, group: str, values: torch.Tensor) -> torch.Tensor:
        """A copy of ``vector`` whose ``group`` entries are ``values`` (as :meth:`select` returns them)."""
        out = vector.clone()
        idx = self.index(group)
        out[..., idx if isinstance(idx, slice) else idx.to(vector.device)] = values
        return out


def default_layout(module: nn.Module) -> ParamLayout:
    """``head``: the last layer's parameters; ``body``: the others; ``norm``: those of normalization layers."""
    named = list(module.named_parameters())
    names = [n for n, _ in named]
    owners = {f"{m}.{p}" if m else p: mod for m, mod in module.named_modules() for p, _ in mod.named_parameters(recurse=False)}
    last = names[-1].rsplit(".", 1)[0] if "." in names[-1] else ""
    head = tuple(n for n in names if (n.rsplit(".", 1)[0] if "." in n else "") == last)
    groups = {
        "head": head,
        "body": tuple(n for n in names if n not in head),
        "norm": tuple(n for n in names if isinstance(owners[n], NORM_LAYERS)),
    }
    return ParamLayout(names, [p.numel() for _, p in named], groups)


class FlatModel:
    """Calls a module with its parameters given as one flat vector.

    The vector's slices are viewed as the module's parameter shapes and passed to
    :func:`torch.func.functional_call`, so gradients (and Hessian-vector products)
    are taken with respect to the flat vector directly. A plain model (MLR, an MLP without normalization) is
    applied layer by layer on the same views instead (:meth:`_plain`, :meth:`rows`): the same numbers bit for bit.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.names = [n for n, _ in module.named_parameters()]
        self.shapes = [p.shape for _, p in module.named_parameters()]
        self.numels = [p.numel() for _, p in module.named_parameters()]
        self.numel = sum(self.numels)
        linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
        self.num_classes = linears[-1].out_features
        #: The named parameters' places in the flat vector, grouped (``body``, ``head``, ``norm``).
        self.layout = default_layout(module)
        # The representation r_w(x): everything before the last layer (the input itself for MLR).
        self._body = module[:-1] if isinstance(module, nn.Sequential) and len(module) > 1 else None
        #: The layers of a model made of linear layers and activations only (MLR, an MLP without normalization), in
        #: order, else None: such a model is applied layer by layer on views of the vector (:meth:`_plain`).
        self._layers = _plain_layers(module)
        # Normalization statistics (batch norm's running mean and variance), one flat vector beside the parameters:
        # batch statistics are used and folded into them while ``training``; they are used otherwise.
        float_buffers = [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
        self._stat_names = [n for n, _ in float_buffers]
        self._stat_shapes = [b.shape for _, b in float_buffers]
        self._counters = {n: b for n, b in module.named_buffers() if not b.is_floating_point()}  # unused: momentum is set
        self.stats: torch.Tensor | None = self.initial_stats()
        self.training = False

    def initial_stats(self) -> torch.Tensor | None:
        """The statistics of a fresh model (mean 0, variance 1), flattened; None for a model without any."""
        if not self._stat_names:
            return None
        fresh = dict(self.module.named_buffers())
        return torch.cat([torch.zeros_like(fresh[n]).flatten() if n.endswith("running_mean")
                          else torch.ones_like(fresh[n]).flatten() for n in self._stat_names])

    @contextmanager
    def train_mode(self) -> Iterator[None]:
        """Calls in the block normalize with batch statistics and fold them into :attr:`stats` (local training)."""
        self.training = True
        try:
            yield
        finally:
            self.training = False

    def to(self, device: torch.device | str) -> FlatModel:
        self.module.to(device)
        if self.stats is not None:
            self.stats = self.stats.to(device)
        return self

    def initial_vector(self, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The module's default initialisation drawn by the CPU generator seeded with ``seed``, flattened, on the
        CPU, whatever device the module is on (a CUDA generator draws other numbers from the same seed: clients on
        a GPU would start from another model than the server). Drawn once per process, architecture and seed on an
        empty CPU copy of the module (the global generator's state restored after), then copied to ``device``."""
        key = (repr(self.module), seed)
        if key not in _INITIAL:
            module = copy.deepcopy(self.module).to_empty(device="cpu")
            state = torch.random.get_rng_state()
            torch.default_generator.manual_seed(seed)
            try:
                for m in module.modules():
                    if hasattr(m, "reset_parameters"):
                        m.reset_parameters()
            finally:
                torch.random.set_rng_state(state)
            if len(_INITIAL) >= 8:  # a long-lived process (warm actors) meets a few architectures and seeds
                _INITIAL.pop(next(iter(_INITIAL)))
            _INITIAL[key] = torch.nn.utils.parameters_to_vector(module.parameters()).detach()
        return _INITIAL[key].to(device, copy=True)

    def unflatten(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        # one split, not a slice per parameter: the gradient flows back as one concatenation, where each slice's
        # backward writes a zero vector of the whole length (1.45x a step of a 1.6M-parameter CNN on the CPU)
        # a matrix of stacked rows [C, P] gives each parameter with a leading C (:meth:`rows`)
        lead = vector.shape[:-1]
        return {name: part.view(*lead, *shape) for name, shape, part in zip(self.names, self.shapes, vector.split(self.numels, dim=-1))}

    def _tensors(self, vector: torch.Tensor, keep=None) -> dict[str, torch.Tensor]:
        """Parameters (views of ``vector``) and statistics (views of :attr:`stats`, updated in place while
        training) by name, those ``keep`` accepts."""
        out = self.unflatten(vector)
        if self.stats is not None:
            offset = 0
            for name, shape in zip(self._stat_names, self._stat_shapes):
                n = shape.numel()
                out[name] = self.stats[offset : offset + n].view(shape)
                offset += n
            out |= {n: c.clone() for n, c in self._counters.items()}
        return out if keep is None else {k: v for k, v in out.items() if keep(k)}

    def _apply(self, module: nn.Module, tensors: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if self.stats is not None:
            module.train(self.training)
        return torch.func.functional_call(module, tensors, (x,))

    def _plain(self, vector: torch.Tensor, x: torch.Tensor, layers: list[tuple[str, nn.Module]]) -> torch.Tensor:
        """``layers`` applied to ``x`` with their parameters' views of ``vector``: the calls each layer's ``forward``
        makes (``F.linear`` with the same views; the activation module itself), so the values and gradients are bit
        for bit :func:`torch.func.functional_call`'s, under :func:`torch.func.vmap` too, without its swapping of the
        module's parameters in and out at every call (about a third of a small MLP's training step on the CPU)."""
        params = self.unflatten(vector)
        for name, layer in layers:
            if isinstance(layer, nn.Linear):
                prefix = f"{name}." if name else ""
                x = F.linear(x, params[prefix + "weight"], params.get(prefix + "bias"))
            else:
                x = layer(x)
        return x

    @property
    def plain(self) -> list[tuple[str, nn.Module]] | None:
        """The (name, layer) pairs of a plain model (linear layers and stateless activations) in order, else None."""
        return self._layers

    def features(self, vector: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """r_w(x), the model's input to its last layer."""
        if self._body is None:
            return x
        if self._layers is not None:
            return self._plain(vector, x, self._layers[:-1])
        head = set(self.layout.groups["head"])
        return self._apply(self._body, self._tensors(vector, lambda k: k not in head), x)

    def rows(self, matrix: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The model of each row of ``matrix`` [C, P] on its own inputs ``x`` [C, B, …]: ``vmap(self)(matrix, x)``.
        A plain model (:meth:`_plain`) runs as the batched products that vmap's rule for ``F.linear`` computes
        (``matmul`` of the inputs with the transposed weights, then the bias), bit for bit vmap's values and
        gradients without its per-call wrapping (tested, ``tests/test_stacked.py``)."""
        if self._layers is None or x.dim() != 3:  # [C, B, features] only: matmul would broadcast other shapes
            return torch.func.vmap(self)(matrix, x)
        params = self.unflatten(matrix)
        for name, layer in self._layers:
            if isinstance(layer, nn.Linear):
                prefix = f"{name}." if name else ""
                x = torch.matmul(x, params[prefix + "weight"].transpose(1, 2))
                if (bias := params.get(prefix + "bias")) is not None:
                    x = x + bias.unsqueeze(1)
            else:
                x = layer(x)
        return x

    def __call__(self, vector: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self._layers is not None:
            return self._plain(vector, x, self._layers)
        return self._apply(self.module, self._tensors(vector), x)


#: Activation modules whose call depends on its input alone (no parameters, no buffers).
_STATELESS = tuple(ACTIVATIONS.values())


def _plain_layers(module: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """(name, layer) of a linear layer or a sequence of linear layers and stateless activations, else None."""
    if type(module) is nn.Linear:  # not a subclass or a parametrized layer, whose parameters are named otherwise
        return [("", module)]
    if type(module) is not nn.Sequential or any(True for _ in module.buffers()):
        return None
    layers = list(module._modules.items())  # every entry, a module used twice included (named_children lists it once)
    if not layers or any(type(m) is not nn.Linear and type(m) not in _STATELESS for _, m in layers):
        return None
    return layers
