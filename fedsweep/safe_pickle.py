"""Unpickling with a list of allowed globals: what fedsweep reads back from a file is data, never code to run.

``pickle.load`` builds whatever a file names (``os.system`` and its argument are a pickle of four opcodes), and the
files fedsweep unpickles come from places a user may not control alone: a downloaded CIFAR-10 batch, a sweep's
storage folder on a shared disk or a bucket. :func:`load` resolves only the (module, name) pairs it is given and
refuses any other with an :class:`pickle.UnpicklingError` that names it, before it is imported or called.
"""

from __future__ import annotations

import io
import pickle
from typing import IO, Any

Allowed = frozenset[tuple[str, str]]

#: NumPy arrays and dtypes, as NumPy 1.x and 2.x pickle them.
NUMPY_ARRAYS: Allowed = frozenset({
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
})


class _Restricted(pickle.Unpickler):
    def __init__(self, file: IO[bytes], allowed: Allowed, what: str, **kwargs):
        super().__init__(file, **kwargs)
        self.allowed, self.what = allowed, what

    def find_class(self, module: str, name: str):
        if (module, name) not in self.allowed:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: {self.what}")
        return super().find_class(module, name)


def load(data: bytes, allowed: Allowed, what: str, **kwargs) -> Any:
    """The object pickled in ``data``, whose globals must all be in ``allowed``; ``what`` ends the error's message
    (what the file may hold). ``kwargs``: :class:`pickle.Unpickler`'s (e.g. ``encoding``)."""
    return _Restricted(io.BytesIO(data), allowed, what, **kwargs).load()
