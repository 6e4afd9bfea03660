"""The job as the user wrote it, parsed and checked: what every other layer stands on.

`spec` (the job file's model, `JobSpec`, and its workloads in `workload`), how a job file is
read (`job_file`), where its files may live (`locations`), whether it fits the slices it may
run on (`fit`), and the slice options the cost policy chooses among (`options`). It imports
nothing of `orchestrator` but the catalog and the errors, and the pure `policies`.
"""
