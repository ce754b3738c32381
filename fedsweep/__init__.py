"""fedsweep: personalized federated learning experiments on Ray actors, swept with Ray Tune, logged to MLflow."""

__version__ = "0.1.0"
