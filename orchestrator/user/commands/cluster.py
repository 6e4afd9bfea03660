"""The commands on the cluster and the cloud: `up`, `dashboard`, `down` and `gc`."""

from __future__ import annotations

import json
from typing import Optional

import typer

from orchestrator.errors import ClusterError
from orchestrator.user.client import Client
from orchestrator.user.commands import console
from orchestrator.user.commands.console import fail


def gc(project: str = typer.Option(..., help="Google Cloud project."),
       zone: list[str] = typer.Option(..., "--zone", help="Zone to look in (repeatable)."),
       endpoint: Optional[str] = typer.Option(None, help="TPU API endpoint (the emulator's URL in tests)."),
       dry_run: bool = typer.Option(False, "--dry-run", help="List, do not delete.")) -> None:
    """Delete Cloud TPU slices labelled by this tool whose jobs are gone (leaked slices)."""
    from orchestrator.domain.locations import check_endpoint
    from orchestrator.providers.gcp import GcpTpuProvider, collect_leaked

    if not project.strip():
        fail("--project must name a Google Cloud project, got ''")
    if endpoint is not None:  # "" would mean Google's, with this machine's credentials: not what was asked
        try:
            endpoint = check_endpoint(endpoint)
        except ValueError as e:
            fail(f"--endpoint {e}")
    client = Client()
    live = {j.id for j in client.store.jobs(active_only=True)}
    provider = GcpTpuProvider(project, zone, endpoint=endpoint, join_check=lambda s: [])
    leaked = collect_leaked(provider, live, dry_run=dry_run)
    verb = "would delete" if dry_run else "deleted"
    console.out.print(f"{verb} {len(leaked)} leaked slice(s){': ' + ', '.join(leaked) if leaked else ''}",
                      highlight=False)


def up() -> None:
    """Start the embedded local Ray cluster (127.0.0.1, token auth) and its controller."""
    client = Client()
    client.connect()  # a ClusterError ends the command, exit 1
    import orchestrator.cluster as c

    info = c.read_cluster(client.home)
    if info is None:  # it went again between the two looks
        raise ClusterError(f"the cluster in {client.home.root} stopped just after it started; see its logs there")
    import ray

    ray.get(client.controller().ping.remote())
    client.close(stop_owned_cluster=False)
    urls = json.loads((client.home.root / "metrics.json").read_text())
    out = console.out
    out.print(f"cluster up at {info.address} (state in {client.home.root})", highlight=False)
    out.print(f"metrics at {urls['url']}", highlight=False)
    if urls.get("dashboard"):
        out.print(f"dashboard at {urls['dashboard']} (`orchestrator dashboard` prints its login link)", highlight=False)
    out.print("stop it with: orchestrator down", highlight=False)


def dashboard(open_browser: bool = typer.Option(False, "--open", help="Also open it in the web browser.")) -> None:
    """Print the dashboard's login link (all jobs, live); starts the local cluster if none runs.

    The link carries the cluster's token once: the page logs in, keeps a session cookie and
    drops the token from the address. Keep the link to yourself as you would the token.
    """
    import ray

    from orchestrator.cluster import ensure_token

    client = Client()
    try:
        url = ray.get(client.controller().dashboard_url.remote(), timeout=60)
    finally:
        client.close(stop_owned_cluster=False)
    if url is None:
        fail(f"the controller could not serve the dashboard; see {client.home.root / 'logs' / 'controller.log'}", 1)
    ensure_token(client.home)
    token = client.home.token_file.read_text().strip()
    link = f"{url}?token={token}"
    print(link, flush=True)  # plain print: a terminal must not wrap or style the one line to copy
    if open_browser:
        import webbrowser

        webbrowser.open(link)


def down() -> None:
    """Cancel active jobs, release every slice and stop the embedded cluster."""
    stopped = Client(stopping=True).down()
    console.out.print("cluster stopped" if stopped else "no cluster was running", highlight=False)
