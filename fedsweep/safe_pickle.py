"""Unpickling with a list of allowed globals: what fedsweep reads back from a file is data, never code to run.

``pickle.load`` builds whatever a file names (``os.system`` and its argument are a pickle of four opcodes), and the
files fedsweep unpickles come from places a user may not control alone: a downloaded CIFAR-10 batch, a sweep's
storage folder on a shared disk or a bucket. :func:`load` resolves only the (module, name) pairs it is given and
refuses any other with an :class:`pickle.UnpicklingError` that names it, before it is imported or called. Naming a
class is not calling it: a pickle may call a global with arguments of its own choosing (REDUCE; INST and OBJ of the
old protocols), and an allowed class's constructor can act (Optuna's ``Study(name, storage_url)`` opens, and creates,
a database), so only the globals of :data:`CALLED`, which build a value from their arguments and do nothing else, may
be called; every other allowed class is built as pickle builds objects (``cls.__new__`` and its state). The checks
run in the pure-Python unpickler, whose opcodes can be overridden (a CIFAR-10 batch of 30 MB loads in one read).
"""

from __future__ import annotations

import io
import pickle
from typing import IO, Any, ClassVar

Allowed = frozenset[tuple[str, str]]

#: NumPy arrays and dtypes, as NumPy 1.x and 2.x pickle them.
NUMPY_ARRAYS: Allowed = frozenset({
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
})


#: The globals a pickle may call with arguments: each builds a value from them and does nothing else (NumPy's array,
#: dtype, scalar and random-state constructors, ``datetime``, the codec CIFAR-10's Python-2 pickles encode bytes with,
#: and Optuna's two enums, called with their value).
CALLED: Allowed = frozenset({
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy.random._pickle", "__bit_generator_ctor"), ("numpy.random._pickle", "__randomstate_ctor"),
    ("datetime", "datetime"), ("_codecs", "encode"),
    ("optuna.trial._state", "TrialState"), ("optuna.study._study_direction", "StudyDirection"),
})


class _Restricted(pickle._Unpickler):  # the pure-Python one: its REDUCE and _instantiate can be checked
    dispatch: ClassVar[dict] = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: IO[bytes], allowed: Allowed, what: str, **kwargs):
        super().__init__(file, **kwargs)
        self.allowed, self.what, self.named = allowed, what, {}

    def find_class(self, module: str, name: str):
        if (module, name) not in self.allowed:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: {self.what}")
        found = super().find_class(module, name)
        self.named[id(found)] = (module, name)
        return found

    def _check_call(self, func: Any) -> None:
        """Only a global this unpickler resolved may be called (an object built on the way could carry any name)."""
        key = self.named.get(id(func))
        if key not in CALLED:
            what = ".".join(key) if key else f"a {type(func).__name__} built by the pickle"
            raise pickle.UnpicklingError(f"refusing to call {what} with arguments: {self.what}")

    def load_reduce(self):
        self._check_call(self.stack[-2])  # the stack ends with the global and its arguments
        super().load_reduce()

    dispatch[pickle.REDUCE[0]] = load_reduce

    def _instantiate(self, klass, args):  # INST and OBJ (protocols 0 and 1) call the class when given arguments
        if args or not isinstance(klass, type) or hasattr(klass, "__getinitargs__"):
            self._check_call(klass)
        super()._instantiate(klass, args)


def load(data: bytes, allowed: Allowed, what: str, **kwargs) -> Any:
    """The object pickled in ``data``, whose globals must all be in ``allowed``; ``what`` ends the error's message
    (what the file may hold). ``kwargs``: :class:`pickle.Unpickler`'s (e.g. ``encoding``)."""
    return _Restricted(io.BytesIO(data), allowed, what, **kwargs).load()
