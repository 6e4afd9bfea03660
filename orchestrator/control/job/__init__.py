"""One job's control loop, by composition: each piece of state has one owner, and a change to how a
move works is read in one file.

The pieces, and what each one owns (the only code that writes it):

- `driver.JobDriver` assembles the pieces for one job and answers the controller (report, cancel,
  resize, a snapshot for the budget, captures and compile-ahead: `view`). It owns the current
  launch's record (`launched`) and its workers (`group`).
- `loop` is the state machine (`loop.start` runs it on the job's own thread): queue, provision,
  launch, watch (`watch`), tear down, and what the recovery rules say after each attempt
  (`policies.decisions.recovery.after`).
- `placement.Placement` owns where the job runs: the held slices, the ready slices the next launch
  goes on, the lost ones, the survivors and their memory step, and regrowing. Its `requests.Requests`
  owns the request waiting beside the slices, request naming, and all-or-none requests; an attempt's
  requests are waited on together by `attempt_slices.AttemptSlices` (QUEUED or PROVISIONING, a part
  taken, a late start asked for again).
- `moves.Moves` asks the cost policy and applies its `Move` to the placement; it owns when the policy
  is asked next and its last choice before provisioning.
- `reports.ReportSink` owns the job's progress: what the workers reported (started, last step,
  restored step, the last disruption and whether the job resumed since).
- `stop.Stops` owns the launch's one `StopRequest` (notice, cancel, resize, move, release, regrow).
- `orchestrator.control.launched.Launch` is a frozen record of one launch: generation, slices, shape,
  memory step (beside the package: the worker group and adoption read it too).
- `ending` names how an attempt ended (the failure cause by outcome, a finished run found at submit).
- `policy.JobPolicy` is the injected cost policy (`StoredFactsPolicy` in production, a scripted one
  in tests); `services.JobServices` is what the loop needs of the controller.

The words the code uses:

- held slices: those the running workers are on. Ready slices: those the next launch goes on.
- request, held request, waiting request: a slice request made and not launched on; while the job
  trains it waits beside the held slices (make-before-break: the new slices are READY before the
  old ones go).
- move: the cost policy's answer (`policies.cost.moves.Move`): request, switch, release the waiting
  request, release the held slices.
- switch: stop at a committed step and launch on the ready slices of the request.
- grow: a request for more slices of the running type and tier; only those to add are asked for, and
  the held slices are kept beside them.
- survivors: a multi-slice job's held slices that are not lost; the next launch goes on them at once,
  restoring from their hosts' memory when every host keeps the same step.
- keeper: the actor on a host that keeps a copy of the training state in the host's memory
  (`orchestrator.control.memory`); it goes when its slice is released.
- regrow: a job running on fewer slices than its spec asks for requests one beside the survivors and
  switches onto all of them.
- shape: where the job runs now (type, tier, slice count), recorded by `Store.place`; the spec stays as
  the user submitted it (`JobRecord.submitted`), and `JobRecord.spec` is it placed on the shape.
- stop request: why the running workers stop at a committed step; the first one asked stands.
"""
