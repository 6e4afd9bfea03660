"""The dashboard: a live web page of every job, served by the controller on 127.0.0.1 behind the cluster's token.

`server` serves it (stdlib `http.server` on a thread, as the metrics are), `data` reads
the store for it, `static/` holds its pages, script and style, and uPlot (MIT, 1.6.32,
vendored from the npm registry's `uplot` package with its license) draws its curves.
"""

from orchestrator.observe.dashboard.auth import Auth
from orchestrator.observe.dashboard.server import DashboardServer, serve_dashboard

__all__ = ["Auth", "DashboardServer", "serve_dashboard"]
