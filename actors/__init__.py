"""Ray actors: ClientActors, each hosting one or more clients, and one ServerActor per experiment. They only move tensors and state;
the math is in :mod:`fedsweep.federation` and :mod:`fedsweep.algorithms`."""

from actors.client import ClientActor
from actors.server import ServerActor

__all__ = ["ClientActor", "ServerActor"]
