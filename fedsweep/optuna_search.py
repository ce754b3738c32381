"""``sweep.search: optuna``: one Optuna study (through Ray Tune's ``OptunaSearch``, TPE sampler, seeded) for
each grid point of the sweep file, each asked ``sweep.num_samples`` settings, the points taking turns.

A grid point is what the file fixes (e.g. an algorithm); the study searches the fields given as
distributions (:mod:`fedsweep.search`). Each point gets the same number of tries, so algorithms with more
hyperparameters are not searched harder. The study is told each setting's selection metric averaged over
``sweep.seeds`` (the trial runs them one after another). TPE's first 10 settings of a study are drawn at
random from its seed, so they do not depend on when trials finish; later ones follow the results.

Needs the ``optuna`` extra: ``pip install 'fedsweep[optuna]'``.
"""

from __future__ import annotations

import pickle
from typing import Any

from ray.tune.search import Searcher
from ray.tune.search.optuna import OptunaSearch

from fedsweep import safe_pickle

#: What :meth:`PointwiseOptuna.save` writes names (an in-memory study of the TPE sampler, seeded, and Tune's
#: wrapper of it): :meth:`~PointwiseOptuna.restore` resolves these and nothing else (:mod:`fedsweep.safe_pickle`).
#: An Optuna release that pickles its study with other names is refused by name (``tests/test_tuning.py`` saves
#: and restores a study that has used every kind of distribution, so such a release fails that test first).
SEARCH_STATE = safe_pickle.NUMPY_ARRAYS | {
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy.random._mt19937", "MT19937"), ("numpy.random._pickle", "__bit_generator_ctor"),
    ("numpy.random._pickle", "__randomstate_ctor"), ("datetime", "datetime"),
    ("optuna.distributions", "CategoricalDistribution"), ("optuna.distributions", "FloatDistribution"),
    ("optuna.distributions", "IntDistribution"), ("optuna.pruners._nop", "NopPruner"),
    ("optuna.samplers._lazy_random_state", "LazyRandomState"), ("optuna.samplers._random", "RandomSampler"),
    ("optuna.samplers._tpe.parzen_estimator", "_ParzenEstimator"),
    ("optuna.samplers._tpe.parzen_estimator", "_ParzenEstimatorParameters"),
    ("optuna.samplers._tpe.sampler", "TPESampler"), ("optuna.samplers._tpe.sampler", "default_gamma"),
    ("optuna.samplers._tpe.sampler", "default_weights"), ("optuna.search_space.intersection", "IntersectionSearchSpace"),
    ("optuna.storages._in_memory", "InMemoryStorage"), ("optuna.storages._in_memory", "_StudyInfo"),
    ("optuna.study._study_direction", "StudyDirection"), ("optuna.study.study", "Study"),
    ("optuna.trial._frozen", "FrozenTrial"), ("optuna.trial._state", "TrialState"), ("optuna.trial._trial", "Trial"),
    ("ray.tune.search.optuna.optuna_search", "OptunaSearch"),
}


class PointwiseOptuna(Searcher):
    """Tune searcher: one :class:`OptunaSearch` per grid point; suggests ``{"trial", "point", "drawn"}``."""

    def __init__(self, spaces: list[dict[str, Any]], num_samples: int, metric: str, mode: str, seed: int):
        super().__init__(metric=metric, mode=mode)
        self.studies = [OptunaSearch(space=space, metric=metric, mode=mode, seed=(seed + 1000 * p) % 2**32)
                        for p, space in enumerate(spaces)]
        self.num_samples = num_samples
        self.asked = [0] * len(spaces)
        self.owner: dict[str, int] = {}
        self.counter = 0

    def suggest(self, trial_id: str) -> dict | None:
        waiting = [p for p, n in enumerate(self.asked) if n < self.num_samples]
        if not waiting:
            return Searcher.FINISHED
        point = min(waiting, key=lambda p: (self.asked[p], p))  # the points take turns
        drawn = self.studies[point].suggest(trial_id)
        if drawn is None or drawn == Searcher.FINISHED:
            return drawn
        self.asked[point] += 1
        self.owner[trial_id] = point
        index, self.counter = self.counter, self.counter + 1
        return {"trial": index, "point": point, "drawn": drawn}

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if trial_id in self.owner:
            self.studies[self.owner[trial_id]].on_trial_result(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if trial_id in self.owner:
            self.studies[self.owner.pop(trial_id)].on_trial_complete(trial_id, result, error)

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.__dict__, f)

    def restore(self, checkpoint_path: str) -> None:
        """The state :meth:`save` wrote, read with the restricted unpickler: a sweep's storage folder may be shared."""
        with open(checkpoint_path, "rb") as f:
            state = safe_pickle.load(f.read(), SEARCH_STATE, f"{checkpoint_path} is a sweep's Optuna search state, "
                                     "which holds Optuna's study and NumPy arrays only")
        self.__dict__.update(state)
