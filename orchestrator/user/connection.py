"""The client's link to the cluster: start or join it and its controller, ask the controller, and stop them."""

from __future__ import annotations

import logging
import os
import time

from orchestrator import cluster
from orchestrator.cluster.driver_output import keep_ray_quiet
from orchestrator.cluster.processes import stop_marked
from orchestrator.errors import ClusterError, OrchestratorError
from orchestrator.state.store import Store

log = logging.getLogger(__name__)

CONNECT_TRIES, CONNECT_WAIT_S = 2, 10.0  # joining a cluster this client started: tries, and the wait between


def _busy_advice(home: cluster.Home) -> str:
    """What to do when the cluster does not answer: how busy the machine is, where the logs are."""
    try:
        load = f"this machine's load average is {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
    except OSError:
        load = ""
    return (f"{load}Ray's head may still be starting: try again in a minute, or run `orchestrator down` then "
            f"`orchestrator up` and read {home.root / 'logs' / 'head.log'}")


class ClusterLink:
    """The part of `orchestrator.user.client.Client` that reaches the cluster: connecting (starting the
    embedded cluster if none runs), its controller, the calls to it, and `close` and `down`. The client
    sets `home`, `address` and `store`; reading jobs needs none of this."""

    home: cluster.Home
    address: str | None
    store: Store
    _connected: bool = False
    _owns_cluster: bool = False

    def connect(self) -> None:
        """Reach the cluster (starting the embedded one if needed) and its controller."""
        if self._connected:
            return
        import ray

        if self.address is None:
            cluster.apply_ray_env(self.home)
            info = cluster.read_cluster(self.home)
            if info is None:
                info = cluster.start_head(self.home, owner="submit")
                self._owns_cluster = True
            elif not cluster.answers(info):  # Ray's driver would retry a dead head for minutes
                raise ClusterError(f"the cluster at {info.address} (state in {self.home.root}) does not answer; "
                                   "`orchestrator down` stops what is left of it")
            address = info.address
        else:
            address = self.address
        keep_ray_quiet(self.home)  # Ray's own messages go to logs/driver.log, not to the user's terminal
        tries = CONNECT_TRIES if self._owns_cluster else 1  # a head just started on a loaded machine can be slow
        for attempt in range(1, tries + 1):
            try:
                ray.init(address=address, namespace=cluster.NAMESPACE, logging_level=logging.WARNING,
                         log_to_driver=False, configure_logging=False)
                break
            except ConnectionError as e:
                if attempt < tries:
                    log.warning("cannot reach the Ray cluster at %s yet (%s); trying again in %.0f s", address, e,
                                CONNECT_WAIT_S * attempt)
                    time.sleep(CONNECT_WAIT_S * attempt)
                    continue
                if self._owns_cluster:  # leave nothing running behind a failed start
                    cluster.stop_cluster(self.home)
                times = f"{tries} tries" if tries > 1 else "1 try"
                raise ClusterError(f"cannot reach the Ray cluster at {address} ({times}): {e}. "
                                   f"{_busy_advice(self.home)}") from None
        keep_ray_quiet(self.home)  # again: connecting set Ray's logging up anew
        self._connected = True
        try:
            self._ensure_controller(address)
        except Exception:
            self.close()
            raise

    def _ensure_controller(self, address: str):
        import ray

        from orchestrator.control.controller import Controller

        try:
            return ray.get_actor(cluster.CONTROLLER_NAME, namespace=cluster.NAMESPACE)
        except ValueError:
            pass
        has_head_resource = ray.cluster_resources().get(cluster.CONTROLLER_RESOURCE, 0) > 0
        ctrl = ray.remote(Controller).options(
            name=cluster.CONTROLLER_NAME, namespace=cluster.NAMESPACE, lifetime="detached", get_if_exists=True,
            num_cpus=0, max_concurrency=64, max_restarts=-1,
            resources={cluster.CONTROLLER_RESOURCE: 0.01} if has_head_resource else None,
        ).remote(str(self.home.root), address)
        # Ray types an actor handle's method as the class's own (without .remote).
        ray.get(ctrl.ping.remote(), timeout=120)  # type: ignore[attr-defined]
        return ctrl

    def controller(self):
        import ray

        self.connect()
        return ray.get_actor(cluster.CONTROLLER_NAME, namespace=cluster.NAMESPACE)

    @property
    def owns_cluster(self) -> bool:
        return self._owns_cluster

    def close(self, *, stop_owned_cluster: bool = True) -> None:
        """Disconnect; stop the embedded cluster if this client started it and no job is active."""
        if not self._connected:
            return
        import ray

        if stop_owned_cluster and self._owns_cluster and not self.store.jobs(active_only=True):
            self._shutdown_controller()
            ray.shutdown()
            cluster.stop_cluster(self.home)
        else:
            ray.shutdown()
        self._connected = False

    def _shutdown_controller(self) -> None:
        import ray

        try:
            ctrl = ray.get_actor(cluster.CONTROLLER_NAME, namespace=cluster.NAMESPACE)
            ray.get(ctrl.shutdown.remote(), timeout=120)
            ray.kill(ctrl, no_restart=True)
        except ValueError:
            pass

    def down(self) -> bool:
        """Cancel active jobs, release every slice, stop the embedded cluster. False if none ran.

        Only processes that are this cluster's nodes are stopped (`cluster.session_is_ours`);
        a recorded id that another program holds now is left alone and logged. A head that
        does not answer is stopped without asking its controller first.
        """
        info = cluster.read_cluster(self.home)
        if info is None:
            self._release_recorded_slices()
            stop_marked(self.home)  # what a job's code left running past the cluster
            (self.home.root / "metrics.json").unlink(missing_ok=True)
            return False
        import ray

        try:
            if cluster.answers(info):
                self.connect()
                self._shutdown_controller()
            else:
                log.warning("the cluster at %s does not answer; stopping its processes", info.address)
        except Exception:  # whatever the controller says, the cluster goes down
            log.exception("the controller did not shut down cleanly; stopping the cluster anyway")
        finally:
            ray.shutdown()
            self._connected = False
            self._release_recorded_slices()
            cluster.stop_cluster(self.home)
            stop_marked(self.home)  # what a job's code started and hid from the nodes' sessions
        (self.home.root / "metrics.json").unlink(missing_ok=True)  # its server went with the controller
        return True

    def _release_recorded_slices(self) -> list[int]:
        """Stop the hosts of every slice the store says is live; returns the ids left alone (not ours)."""
        from orchestrator.providers.local import release_recorded

        return [pgid for rec in self.store.slices(live_only=True)
                for pgid in release_recorded(self.home, self.store, rec)]

    def _ask(self, method: str, *args, timeout_s: float = 60):
        """Call the controller's `method` and wait for its answer.

        An `OrchestratorError` the controller raises is raised here as itself (not wrapped
        in Ray's `RayTaskError`); a controller that died or does not answer is a
        `ClusterError`. Any other error of the controller's stays a `RayTaskError`.
        """
        import ray

        ctrl = self.controller()
        try:
            return ray.get(getattr(ctrl, method).remote(*args), timeout=timeout_s)
        except ray.exceptions.RayTaskError as e:
            log.debug("controller.%s failed: %s", method, e)  # str(e) holds the remote traceback
            if isinstance(e.cause, OrchestratorError):
                raise e.cause from None
            raise
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(f"the controller did not answer {method} within {timeout_s:g} s") from None
        except ray.exceptions.RayActorError as e:
            raise ClusterError(f"the controller died during {method}: {e.error_msg}") from None

