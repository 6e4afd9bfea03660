"""Run Ray's own `ray start` for a node of a single-machine cluster, kept on 127.0.0.1.

Ray rewrites 127.0.0.1 to the machine's network address, and refuses to start worker
nodes in its loopback mode, so a local multi-node cluster would listen on every
interface. This entry point runs the unchanged `ray start` command with those two
checks relaxed for this process only: every node then binds to 127.0.0.1, which is
what a cluster that lives on one machine should do. Used as
``python -m orchestrator.cluster.raynode start --block ...``.

One more change for nodes that share a machine: Ray names a node's raylet and plasma
sockets by taking the first unused `raylet`, `raylet.1`, ... in the session directory,
and two nodes starting at the same moment take the same name; the second raylet then
dies on "Address already in use" and the node stalls for 30 s before it is started
again. Here the name carries this process's id, unique among running processes.

And one more: each node keeps the runtime environments it sets up (a job's shipped folder,
the project's packages) in a folder of its own, as separate hosts would. Ray keeps them in
`runtime_resources` of the session directory, which every node of one machine shares, and a
node that sets up a job's folder deletes and unpacks it anew: under the working directory of
a worker another node had already started there (its `os.getcwd()` then fails).
"""

import os
import sys

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # children (raylet, workers) stay on loopback

import ray._private.node as node  # noqa: E402
import ray._private.ray_constants as ray_constants  # noqa: E402
import ray._private.services as services  # noqa: E402

ray_constants.ENABLE_RAY_CLUSTER = True  # allow `ray start --address` for worker nodes
services.resolve_ip_for_localhost = lambda host: host

_prepare_socket_file = node.Node._prepare_socket_file


def _unique_socket_file(self, socket_path, default_prefix):
    if socket_path is None:
        socket_path = os.path.join(self._sockets_dir, f"{default_prefix}.{os.getpid()}")
    return _prepare_socket_file(self, socket_path, default_prefix)


setattr(node.Node, "_prepare_socket_file", _unique_socket_file)  # noqa: B010 -- a patch of Ray's method; mypy refuses it written plainly
# read when the node's parameters are made, below `runtime_resources` so Ray's layout stays recognisable
ray_constants.DEFAULT_RUNTIME_ENV_DIR_NAME = os.path.join(ray_constants.DEFAULT_RUNTIME_ENV_DIR_NAME,
                                                          f"node-{os.getpid()}")

from ray.scripts.scripts import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
