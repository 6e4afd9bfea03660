"""An autoscaled job over a replayed spot trace with two outages, through the real controller.

The local provider replays a small trace as its spot capacity (20 trace seconds a wall
second): spot is there, goes for a while, comes back, goes again. The job must move
spot -> on-demand after the reclaim and back to spot once a request waiting beside
the on-demand slice fills, training on while it waits; lose nothing (every step's loss
is the undisturbed run's); never spend `max_failures` on a refusal; never pay for a
request that only waited; meet its deadline; and cost what the simulator says the
same policy pays on the same trace window with the restart costs the job measured.
"""

from __future__ import annotations

from orchestrator import JobSpec, JobState
from benchmarks.autoscale_replay import job_spec, measure, outage_trace, sim_slices, simulate_window, write_trace
from tests.conftest import assert_losses_close, run_reference, train_config

SCALE = 20.0  # trace seconds a wall second: a 60 s tick lasts 3 s
STEPS = 12000
DEADLINE_S = 2520.0  # trace seconds, about 1.4x the job's time on one slice with no disruption
COST_TOLERANCE = 0.35  # controller cost within 35% of the simulator's (restart times vary with the machine's load)


def slice_history(job) -> dict[str, list[tuple[float, str, str]]]:
    """name -> [(at, state, tier)] of each of the job's slices, in order."""
    out: dict[str, list[tuple[float, str, str]]] = {}
    for e in job.events():
        if e.kind == "slice":
            out.setdefault(e.data["name"], []).append((e.at, e.data["state"], e.data["tier"]))
    return out


def test_autoscaled_job_moves_make_before_break_over_two_spot_outages(client, tmp_path):
    trace = write_trace(tmp_path / "two-outages.json", outage_trace(up=12, down=15))
    spec = JobSpec.from_dict(job_spec("replay", trace, tmp_path / "ckpt", scale=SCALE, steps=STEPS,
                                      deadline_s=DEADLINE_S, interval=100))
    job = client.submit(spec)
    st = job.wait(timeout_s=600)
    assert st.state is JobState.SUCCEEDED, st.reason
    assert client.store.job(job.id).failures == 0

    slices = slice_history(job)
    ran = [(name, h) for name, h in slices.items() if any(s == "READY" for _, s, _ in h)]
    tiers = [h[0][2] for _, h in ran]
    # spot, reclaimed -> on-demand, back to spot once a request beside it filled, and again.
    assert tiers[:3] == ["spot", "on-demand", "spot"], tiers
    assert tiers.count("on-demand") >= 2, tiers
    # Make before break: every move's new slice was READY before the old one was released.
    moves = [e for e in job.events() if e.kind == "resize"]
    assert moves, "no move was made before break"
    for (old, old_h), (new, new_h) in zip(ran, ran[1:]):
        if old_h[0][2] == "on-demand":  # an on-demand slice is only ever left for a READY spot one
            ready = next(at for at, s, _ in new_h if s == "READY")
            released = next(at for at, s, _ in old_h if s == "RELEASED")
            assert ready < released, (old, new)
    # Steps went on while a spot request waited beside the on-demand slice.
    waited = [(h[0][0], next(at for at, s, _ in h if s != "WAITING" and at > h[0][0]))
              for name, h in slices.items() if any(s == "WAITING" for _, s, _ in h)]
    metrics = job.metrics()
    assert any(sum(start < m.at < end for m in metrics) > 10 for start, end in waited), waited

    m = measure(client.store, job.id, scale=SCALE)
    assert m.refused_billed == 0  # requests that only waited were never billed
    assert m.deadline_met, (m.finish_s, DEADLINE_S)

    ref = run_reference(train_config(spec), devices=4, tmp_path=tmp_path / "ref")
    assert_losses_close([x.loss for x in metrics], ref["losses"], rtol=1e-5)

    # The simulator, replaying the same window with the restart costs and speed the job measured.
    run = simulate_window(trace, m, start_s=0.0, deadline_s=DEADLINE_S)
    assert run.deadline_met
    sim_tiers = [label.split()[-1] for label in sim_slices(run)]
    assert sim_tiers[:3] == tiers[:3], (sim_tiers, tiers)
    assert abs(m.cost_usd / run.cost_usd - 1) <= COST_TOLERANCE, (m.cost_usd, run.cost_usd)
