"""Ray's driver-side messages go to the state directory's logs, not to a Python API user's terminal."""

from __future__ import annotations

import logging

import ray  # noqa: F401  (Ray adds its stderr handler when imported)
import ray._private.worker as ray_worker

from orchestrator.cluster import Home
from orchestrator.cluster.driver_output import keep_ray_quiet


def test_ray_messages_and_warnings_go_to_the_driver_log(tmp_path, capfd):
    home = Home(tmp_path / "home").ensure()
    path = keep_ray_quiet(home)
    assert keep_ray_quiet(home) == path  # idempotent
    # What Ray's error listener thread calls for a message the cluster publishes:
    ray_worker.print_to_stdstream({"lines": ["The node with node id 0123 and address 127.0.0.1 and node name "
                                             "127.0.0.1 has been marked dead"], "pid": "raylet", "is_err": False},
                                  ignore_prefix=False)
    logging.getLogger("ray._private.worker").warning("a warning of Ray's own")
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    for h in logging.getLogger("ray").handlers:
        h.flush()
    text = path.read_text()
    assert "(raylet) The node with node id 0123" in text and "marked dead" in text
    assert "a warning of Ray's own" in text
