"""The embedded local Ray cluster: where it lives on disk, how to start, reach and stop it.

Everything the tool keeps is under one state directory (`Home`): ``$ORCHESTRATOR_HOME``,
default ``~/.tpu-orchestrator``. The head node and every local "TPU host" node are
``ray start --block`` processes, each in its own process group so that one signal
removes a node whole (that is also how tests make a host vanish). All of them listen
on 127.0.0.1 only and require Ray's token authentication; the token is a file in the
state directory, readable by its owner only.
"""

from __future__ import annotations

from orchestrator.cluster.home import Home, check_private, ensure_token, node_mark
from orchestrator.cluster.nodes import (
                                        CONTROLLER_NAME,
                                        CONTROLLER_RESOURCE,
                                        NAMESPACE,
                                        ClusterInfo,
                                        answers,
                                        apply_ray_env,
                                        free_port,
                                        ray_env,
                                        read_cluster,
                                        start_head,
                                        start_host_node,
                                        stop_cluster,
)
from orchestrator.cluster.processes import MARK_ENV, group_alive, kill_host, session_is_ours, stop_group, stop_groups
from orchestrator.errors import ClusterError

__all__ = ["CONTROLLER_NAME", "CONTROLLER_RESOURCE", "MARK_ENV", "NAMESPACE", "ClusterError", "ClusterInfo", "Home",
           "answers", "apply_ray_env", "check_private", "ensure_token", "free_port", "group_alive", "kill_host",
           "node_mark", "ray_env", "read_cluster", "session_is_ours", "start_head", "start_host_node",
           "stop_cluster", "stop_group", "stop_groups"]
