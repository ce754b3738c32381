"""Which kernels compute a CNN's convolutions on the CPU: oneDNN's, PyTorch's default, or PyTorch's own
(``FEDSWEEP_CONV=native``: unfolded patches and MKL's matrix products). oneDNN picks its code by the CPU (its
instruction sets, its caches) and has no branch common to every x86-64 CPU, as MKL has (``MKL_CBWR=COMPATIBLE``);
without it a CNN's numbers depend on PyTorch's kernels (``ATEN_CPU_CAPABILITY``) and MKL's alone. On the Intel Xeon
a small-CNN trial took about 1.24× as long (docs/reproduction.md, "Convolutions without oneDNN"). On a GPU cuDNN
computes the convolutions and the variable changes nothing. Here, without torch, so that a command can check the
variable before it imports anything heavy; ``fedsweep.models`` applies it whenever it builds a CNN."""

from __future__ import annotations

import os

CONV_VAR = "FEDSWEEP_CONV"
NATIVE = "native"
CONV_HELP = f"{NATIVE} (convolutions without oneDNN), or unset (oneDNN, PyTorch's default)"


def conv_problem() -> str | None:
    """What is wrong with ``$FEDSWEEP_CONV`` (an empty value is unset), or None."""
    value = os.environ.get(CONV_VAR)
    return None if not value or value == NATIVE else f"${CONV_VAR}: {value!r}; allowed: {CONV_HELP}"


def native_convolutions() -> bool:
    """Whether this process's environment asks for PyTorch's own convolution kernels; ValueError on another value."""
    if problem := conv_problem():
        raise ValueError(problem)
    return os.environ.get(CONV_VAR) == NATIVE
