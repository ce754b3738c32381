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


ModelConfig = MLRConfig | MLPConfig


def build_model(cfg: ModelConfig, num_features: int, num_classes: int) -> nn.Module:
    if cfg.name == "mlr":
        return nn.Linear(num_features, num_classes)
    layers: list[nn.Module] = []
    width = num_features
    for h in cfg.hidden:
        layers += [nn.Linear(width, h), ACTIVATIONS[cfg.activation]()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


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

    def to(self, device: torch.device | str) -> "FlatModel":
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
