"""Models, and a functional view of a model as one flat parameter vector."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, PositiveInt
from torch import nn

from fedsweep.schema import StrictModel

ACTIVATIONS = {"relu": nn.ReLU, "elu": nn.ELU, "tanh": nn.Tanh}


class MLRConfig(StrictModel):
    """Multinomial logistic regression: one linear layer followed by softmax."""

    name: Literal["mlr"] = "mlr"


class MLPConfig(StrictModel):
    """Fully connected network with ``hidden`` layer widths."""

    name: Literal["mlp"] = "mlp"
    hidden: list[PositiveInt] = Field(default_factory=lambda: [20], min_length=1)
    activation: Literal["relu", "elu", "tanh"] = "relu"


class CNNConfig(StrictModel):
    """Two 5×5 convolutions, each followed by ReLU and 2×2 max-pooling, then fully connected layers
    (``hidden``) and the output layer: the CIFAR CNN of the PFL paper (Acar et al. 2021) and of
    McMahan et al. 2017 with the defaults. Inputs are flattened images; their shape is inferred."""

    name: Literal["cnn"] = "cnn"
    channels: list[PositiveInt] = Field(default_factory=lambda: [64, 64], min_length=2, max_length=2)
    hidden: list[PositiveInt] = Field(default_factory=lambda: [384, 192], min_length=1)
    kernel_size: PositiveInt = 5


ModelConfig = MLRConfig | MLPConfig | CNNConfig


def image_shape(num_features: int) -> tuple[int, int, int]:
    """(channels, side, side) of a flattened square image with 1 or 3 channels."""
    for c in (1, 3):
        side = round((num_features / c) ** 0.5)
        if num_features % c == 0 and side * side * c == num_features:
            return c, side, side
    raise ValueError(f"model.name=cnn needs square images with 1 or 3 channels; the inputs have {num_features} features")


def _cnn(cfg: CNNConfig, num_features: int, num_classes: int) -> nn.Sequential:
    c, side, _ = image_shape(num_features)
    layers: list[nn.Module] = [nn.Unflatten(1, (c, side, side))]
    for out in cfg.channels:
        layers += [nn.Conv2d(c, out, cfg.kernel_size), nn.ReLU(), nn.MaxPool2d(2)]
        side = (side - cfg.kernel_size + 1) // 2
        c = out
        if side < 1:
            raise ValueError(f"model.kernel_size={cfg.kernel_size} is too large for {image_shape(num_features)} images")
    layers.append(nn.Flatten())
    width = c * side * side
    for h in cfg.hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def build_model(cfg: ModelConfig, num_features: int, num_classes: int) -> nn.Module:
    if cfg.name == "mlr":
        return nn.Linear(num_features, num_classes)
    if cfg.name == "cnn":
        return _cnn(cfg, num_features, num_classes)
    layers: list[nn.Module] = []
    width = num_features
    for h in cfg.hidden:
        layers += [nn.Linear(width, h), ACTIVATIONS[cfg.activation]()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def parameter_count(cfg: ModelConfig, num_features: int, num_classes: int) -> int:
    """The model's number of parameters, without allocating them (built on PyTorch's meta device); raises
    ValueError where the inputs do not fit the model."""
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(cfg, num_features, num_classes).parameters())


class FlatModel:
    """Calls a module with its parameters given as one flat vector.

    The vector's slices are viewed as the module's parameter shapes and passed to
    :func:`torch.func.functional_call`, so gradients (and Hessian-vector products)
    are taken with respect to the flat vector directly.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.names = [n for n, _ in module.named_parameters()]
        self.shapes = [p.shape for _, p in module.named_parameters()]
        self.numels = [p.numel() for _, p in module.named_parameters()]
        self.numel = sum(self.numels)
        linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
        self.num_classes = linears[-1].out_features
        # The representation r_w(x): everything before the last layer (the input itself for MLR).
        self._body = module[:-1] if isinstance(module, nn.Sequential) and len(module) > 1 else None
        self._head_prefix = f"{len(module) - 1}." if self._body is not None else None

    def to(self, device: torch.device | str) -> FlatModel:
        self.module.to(device)
        return self

    def initial_vector(self, seed: int) -> torch.Tensor:
        """The module's default initialisation under ``torch.manual_seed(seed)``, flattened."""
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            for m in self.module.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        finally:
            torch.random.set_rng_state(gen_state)
        return torch.nn.utils.parameters_to_vector(self.module.parameters()).detach().clone()

    def unflatten(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for name, shape, n in zip(self.names, self.shapes, self.numels):
            out[name] = vector[offset : offset + n].view(shape)
            offset += n
        return out

    def features(self, vector: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """r_w(x), the model's input to its last layer."""
        if self._body is None:
            return x
        params = {k: v for k, v in self.unflatten(vector).items() if not k.startswith(self._head_prefix)}
        return torch.func.functional_call(self._body, params, (x,))

    def __call__(self, vector: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self.module, self.unflatten(vector), (x,))
