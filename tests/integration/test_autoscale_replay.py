"""An autoscaled job over a replayed spot trace with an outage, through the real controller.

The local provider replays a small trace as its spot capacity (60 trace seconds a wall
second): spot is there, goes for a while, and comes back. On a quiet machine the job moves
spot -> on-demand after the reclaim and back to spot once a request waiting beside
the on-demand slice fills, training on while it waits, and meets its deadline.

Which path the policy takes over the outage depends on what the job measures (its speed, its restart
costs, in trace time), and on this 2-core machine those depend on the load: on a quiet machine (1.8
steps a trace second) the policy goes back to spot once it returns and meets the deadline; under load
(1.0) its safety net runs on-demand to the end, the right answer at that speed (a clean-clone run
failed here on that). So the return to spot and the deadline are asserted on fixed facts, where the
same policy decides over the same trace and job in the simulator
(`tests/unit/test_replay_policy_path.py`), and this test asserts at any load what the controller
must do whatever the policy chose: start on spot (nothing measured yet), go on-demand after the
reclaim, run only on slices the policy chose, make every move before break while the job trains on,
lose nothing and bill no request that only waited.

What the controller pays against what the simulator says the same policy pays on the
same window is a measurement, not a property: `benchmarks/autoscale_replay.py` records it.
"""

from __future__ import annotations

from benchmarks.autoscale_replay import job_spec, measure, outage_trace, write_trace
from orchestrator import JobSpec, JobState
from tests.conftest import assert_losses_close, start_reference

SCALE = 60.0  # trace seconds a wall second: a 60 s tick lasts 1 s
STEPS = 4000  # about 2,200 trace seconds on one undisturbed slice (about 1.8 steps a trace second here)
# Trace seconds, about 2.3x that. At 4,000 (1.8x) the job failed on this machine on the code it was tuned on
# too (4 of 4 runs): its first steps measured about 1.0 steps a trace second, the safety net moved it to
# on-demand before the outage, and with the deadline then at risk it never went back to spot.
DEADLINE_S = 5000.0


def slice_history(job) -> dict[str, list[tuple[float, str, str]]]:
    """name -> [(at, state, tier)] of each of the job's slices, in order."""
    out: dict[str, list[tuple[float, str, str]]] = {}
    for e in job.events():
        if e.kind == "slice":
            out.setdefault(e.data["name"], []).append((e.at, e.data["state"], e.data["tier"]))
    return out


def first(history, state):
    return next((at for at, s, _ in history if s == state), None)


def test_autoscaled_job_moves_make_before_break_over_a_spot_outage(client, tmp_path):
    trace = write_trace(tmp_path / "outage.json", outage_trace(up=12, down=6, cycles=1))
    spec = JobSpec.from_dict(job_spec("replay", trace, tmp_path / "ckpt", scale=SCALE, steps=STEPS,
                                      deadline_s=DEADLINE_S))
    job = client.submit(spec)
    # It trains beside the job: it slows the job's steps, which changes no assertion here (see above).
    ref = start_reference(spec, devices=4, tmp_path=tmp_path / "ref")
    st = job.wait(timeout_s=600)
    assert st.state is JobState.SUCCEEDED, st.reason
    assert client.store.job(job.id).failures == 0
    m = measure(client.store, job.id, scale=SCALE)
    speed = f"{m.tokens_per_s / 512:.2f} steps a trace second"  # 512 tokens a step; in failure messages
    assert st.preemptions >= 1, speed  # the first outage reclaimed the spot slice (the job starts on it)

    slices = slice_history(job)
    ran = [(name, h) for name, h in slices.items() if first(h, "READY") is not None]
    tiers = [h[0][2] for _, h in ran]
    # spot (before it measured anything), and on-demand after the reclaim (or before it, under load).
    assert tiers[0] == "spot" and "on-demand" in tiers, (tiers, speed)
    # Only slices the policy chose: each was asked for after a decision for its type and tier.
    chosen = [(e.at, e.data["accelerator"], e.data["tier"]) for e in job.events() if e.kind == "autoscale" and e.data]
    for name, h in ran:
        asked = first(h, "REQUESTED")
        assert any(at <= asked and (a, t) == ("v4-8", h[0][2]) for at, a, t in chosen), (name, h, chosen)
    # Make before break: a move's new slice was READY before the old one was released, and
    # the job trained on the old one while the new one was requested.
    metrics = job.metrics()
    for e in [e for e in job.events() if e.kind == "resize"]:  # "slice NEW (v4-8 TIER) is ready beside OLD: ..."
        words = e.reason.replace(":", " ").split()
        new_name, old_name = words[1], words[words.index("beside") + 1]
        new, old = slices[new_name], slices[old_name]
        assert first(new, "READY") < first(old, "RELEASED"), (e.reason, old, new)
        trained = [m for m in metrics if first(new, "REQUESTED") < m.at < first(new, "READY")]
        assert trained, f"no step while {new_name} was requested beside the running slice"

    assert m.refused_billed == 0  # requests that only waited were never billed

    assert_losses_close([x.loss for x in metrics], ref.result()["losses"], rtol=1e-5)
