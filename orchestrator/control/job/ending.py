"""How an attempt's end is named: the job's failure cause by outcome, and a finished run found at submit."""

from __future__ import annotations

from orchestrator.state.events import EventKind
from orchestrator.state.protocol import JobStore
from orchestrator.state.states import FailedBecause
from policies.decisions.recovery import OutcomeKind

# How a job that fails after an attempt ended one way is named (FAILED_SETUP, FAILED_BUDGET, ...).
FAILED_BECAUSE: dict[OutcomeKind, FailedBecause] = {
    OutcomeKind.IMPORT_ERROR: FailedBecause.SETUP,
    OutcomeKind.PLATFORM_FAILED: FailedBecause.SETUP,
    OutcomeKind.APP_FAILED: FailedBecause.USER_CODE,
    OutcomeKind.HUNG: FailedBecause.USER_CODE,
    OutcomeKind.USER_EXIT: FailedBecause.USER_EXIT,
    OutcomeKind.STORAGE_FAILED: FailedBecause.STORAGE,
    OutcomeKind.FOLDER_TAKEN: FailedBecause.STORAGE,
    OutcomeKind.PROVISION_FAILED: FailedBecause.NO_RESOURCE,
    OutcomeKind.PREEMPTED: FailedBecause.PREEMPTIONS,
    OutcomeKind.INFRA_LOST: FailedBecause.PREEMPTIONS,
    OutcomeKind.WORKER_ABORTED: FailedBecause.WORKER_ABORTS,
    OutcomeKind.BUDGET_SPENT: FailedBecause.BUDGET,
}

# Attempts that end this way are no disruption: nothing was lost, nothing is counted.
NOT_DISRUPTED = (OutcomeKind.SUCCEEDED, OutcomeKind.CANCELLED, OutcomeKind.PROVISION_FAILED, OutcomeKind.RESIZED,
                 OutcomeKind.BUDGET_SPENT)


def finished_at_submit(store: JobStore, job_id: str) -> tuple[int, str] | None:
    """(its last step, why) for a new job that resumed its folder as the same run and found that run's last
    step committed there already (`ownership`'s claim at submit lists the folder's committed steps)."""
    job = store.job(job_id)
    total = job.spec.workload.steps
    if total is None or store.last_step(job_id) is not None or job.generation:
        return None
    claimed = next((e.data for e in store.events(job_id) if e.kind is EventKind.FOLDER), None) or {}
    last = claimed.get("last_step")
    if claimed.get("action") not in ("resume", "resume-anyway") or last is None or last < total:
        return None
    return last, nothing_to_train(store, job_id, last, total)


def finished_before(store: JobStore, job_id: str) -> str | None:
    """Why a job that succeeded trained no step of its own: its folder held a run that had already finished."""
    job = store.job(job_id)
    committed, total = (job.result or {}).get("steps"), job.spec.workload.steps
    if store.last_step(job_id) is not None or committed is None or total is None or committed < total:
        return None
    return nothing_to_train(store, job_id, committed, total)


def nothing_to_train(store: JobStore, job_id: str, committed: int, total: int) -> str:
    where = store.job(job_id).spec.checkpoint.directory
    if committed == total:
        return (f"resumed a finished run: step {total} of {total} was already committed in {where}; nothing to "
                "train (to train again from step 0, submit with --fresh)")
    return (f"resumed a finished run: the checkpoints in {where} reach step {committed}, past this job's {total} "
            "steps; nothing to train (to train again from step 0, submit with --fresh)")


def worker_aborts(store: JobStore, job_id: str) -> int:
    """Worker aborts so far (they spend `max_aborts`; counted from the job's disruption events)."""
    return sum(1 for e in store.events(job_id)
               if e.kind is EventKind.DISRUPTION and (e.data or {}).get("kind") == OutcomeKind.WORKER_ABORTED.value)
