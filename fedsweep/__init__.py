"""fedsweep: personalized federated learning experiments on Ray actors, swept with Ray Tune, logged to MLflow."""

import os

__version__ = "0.1.0"

# MLflow 3 sends usage records to its makers from every process that imports it, and fetches their config at
# start-up, unless told not to. fedsweep reaches no network at run time (its clusters are often offline) and
# every one of its processes imports this package before MLflow: off unless the user set it (README, "Tracking").
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
