"""``flower_peer.py``'s ClientApp, in a module of its own so that Flower's Ray backend sends it by reference.

Flower's simulation pickles the ClientApp with every message it hands an actor (flwr 1.41,
``RayBackend.process_message``: ``actor.run.remote(app_fn, message, ...)``). A ClientApp whose function closes over
the dataset therefore sends the dataset with each message — MNIST's 220 MB 2,000 times in a 200-round run, which is
what ``flower_peer.py`` did until 2026-11-27 — and the clients it built went with it and were built again each time.
A Flower user loads the client's partition inside the app and lets the process keep it (Flower's examples call
``load_data(partition_id, ...)`` in the ClientApp, flwr-datasets caching the data per process); so does this: each
ClientApp actor builds the dataset once, from the settings the driver puts in ``$FLOWER_PEER``, and keeps the
fedsweep ``Client`` of each partition it has trained. The functions below are importable, so the pickled app holds
their names, not their data.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from types import SimpleNamespace

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

ENV = "FLOWER_PEER"

app = ClientApp()
_clients: dict = {}  # partition id -> fedsweep Client, per actor process


@lru_cache(maxsize=1)
def federation():
    """(validated config, dataset) of the settings in ``$FLOWER_PEER``, built once per process."""
    from benchmarks.flower_peer import config
    from fedsweep.data import build_federated_dataset

    cfg = config(SimpleNamespace(**json.loads(os.environ[ENV])))
    return cfg, build_federated_dataset(cfg.data)


@app.train()
def train(msg: Message, context: Context) -> Message:
    from fedsweep.federation import Client, Setup

    torch.set_num_threads(1)  # as in fedsweep's actors
    cfg, ds = federation()
    cid = int(context.node_config["partition-id"])
    if cid not in _clients:
        _clients[cid] = Client(cid, ds.clients[cid], Setup.of(cfg, ds.num_features, ds.num_classes))
    params = msg.content["arrays"].to_numpy_ndarrays()[0]
    reply = _clients[cid].train({"params": params}, int(msg.content["config"]["server-round"]))
    content = RecordDict({"arrays": ArrayRecord([np.asarray(reply.payload["params"])]),
                          "metrics": MetricRecord({"num-examples": reply.num_samples})})
    return Message(content=content, reply_to=msg)
