"""A real multi-node Ray cluster on this machine for the tests: a head and worker nodes, each its own raylet with
its own resources, object store and ports, started with Ray's own test utility ``ray.cluster_utils.Cluster``.

The cluster lives in a process of its own (this module run as a script), which the tests drive line by line over
its stdin/stdout: the utility writes the process-wide Ray state of the process that holds it (the "current
cluster" address file, the internal KV client), which must not touch the suite's own Ray instance. Its temp
folder (``RAY_TMPDIR``) is its own for the same reason.

Commands, one per line, each answered by one JSON line: ``add CPUS`` (a worker node; its node id),
``remove NODE_ID`` (its raylet and every process of the node killed at once, as a machine that is lost),
``servers`` (the node id of each ServerActor alive), ``quit``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    from ray.cluster_utils import Cluster

    # a lost node is declared dead after 3 missed health checks 1 s apart (sooner than Ray's defaults); every
    # node's dashboard agent on a free port (fedsweep.experiment.start_local_ray: on 52365 each waits 3.3 s)
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "dashboard_agent_listen_port": 0,
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}})
    nodes = {}
    print(json.dumps({"address": cluster.address}), flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "add":
            node = cluster.add_node(num_cpus=int(args[0]), dashboard_agent_listen_port=0)
            cluster.wait_for_nodes()
            nodes[node.node_id] = node
            reply = {"node_id": node.node_id}
        elif command == "remove":
            cluster.remove_node(nodes.pop(args[0]), allow_graceful=False)
            reply = {"removed": args[0]}
        elif command == "servers":
            actors = cluster.global_state.actor_table(None).values()
            reply = {"nodes": [a["Address"]["NodeID"] for a in actors
                               if a["ActorClassName"] == "ServerActor" and a["State"] == "ALIVE"]}
        elif command == "quit":
            break
        else:
            reply = {"error": f"unknown command {command!r}"}
        print(json.dumps(reply), flush=True)
    cluster.shutdown()


class RayCluster:
    """The test side: starts the cluster process (a head with no CPUs, as a cluster's head node that only
    drives) and sends it commands."""

    def __init__(self, log: Path):
        # short: Ray's socket paths under the temp folder have a length limit
        self.temp = tempfile.mkdtemp(prefix="rc", dir="/tmp")
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": self.temp}
        self.log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env, start_new_session=True)
        self.address = self._reply()["address"]

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the cluster process ended (exit {self.proc.poll()}); see {self.log.name}")
        return json.loads(line)

    def command(self, *words) -> dict:
        self.proc.stdin.write(" ".join(str(w) for w in words) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def add_node(self, cpus: int) -> str:
        return self.command("add", cpus)["node_id"]

    def remove_node(self, node_id: str) -> None:
        self.command("remove", node_id)

    def server_nodes(self) -> list[str]:
        return self.command("servers")["nodes"]

    def close(self) -> None:
        try:
            self.command("quit")
            self.proc.wait(timeout=60)
        except (OSError, RuntimeError, subprocess.TimeoutExpired, ValueError):
            pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
        # processes a killed node left behind, if any
        subprocess.run(["pkill", "-9", "-f", self.temp], check=False)
        shutil.rmtree(self.temp, ignore_errors=True)
        self.log.close()


if __name__ == "__main__":
    main()
