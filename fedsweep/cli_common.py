"""What every ``fedsweep`` command shares: its exit codes, how it prints a configuration's problems, and the MLflow
store a command reads (checked before it is read)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedsweep.config import ConfigError

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 1, 2, 130  # 130: as a shell reports a command ended by Ctrl-C


def print_problems(err: ConfigError) -> int:
    print(f"error: invalid configuration ({len(err.problems)} problem{'s' * (len(err.problems) != 1)}):", file=sys.stderr)
    for p in err.problems:
        print(f"  {p}", file=sys.stderr)
    return EXIT_BAD_INPUT


def tracking_uri(configured: str | None) -> str | None:
    """The store a command reads (``--tracking-uri``, else $MLFLOW_TRACKING_URI, else ./mlflow.db); None,
    after saying why, when it cannot be one."""
    from fedsweep.checks import tracking_uri_problem
    from fedsweep.config import resolve_tracking_uri

    uri = resolve_tracking_uri(configured)
    if problem := tracking_uri_problem(uri):
        print(f"error: --tracking-uri ({uri}): {problem}", file=sys.stderr)
        return None
    return uri
