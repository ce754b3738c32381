"""One client's shard: below both the data package (which builds shards) and the algorithms (which train on them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ClientData:
    """One client's shard: its own train and test tensors, and a validation part held out of its training
    data (``data.validation_fraction``; none by default): scored like the test part, never trained on."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    x_val: torch.Tensor | None = None
    y_val: torch.Tensor | None = None

    @property
    def num_train(self) -> int:
        return int(self.y_train.shape[0])

    @property
    def num_test(self) -> int:
        return int(self.y_test.shape[0])

    @property
    def num_val(self) -> int:
        return 0 if self.y_val is None else int(self.y_val.shape[0])

    def to(self, device: torch.device | str) -> ClientData:
        tensors = (self.x_train, self.y_train, self.x_test, self.y_test, self.x_val, self.y_val)
        return ClientData(*(None if t is None else t.to(device) for t in tensors))
