"""A user's own program as a new user meets it: `examples/user-train`'s job file, token files, weights out.

The job file is submitted as it is in the repository (only its data, its checkpoint
folder and its length changed), on token files made by `data prepare`. It must
SUCCEED with a falling loss; the program's own metric and the loop's MFU reach
`status`, Prometheus and the report; and `export` writes the final parameters, which
load back into the program's own pytree with the sums the workers reported.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from orchestrator import JobSpec, JobState
from orchestrator.observe.metrics import JobCollector
from orchestrator.observe.report import write_report
from orchestrator.user.data_prepare import prepare
from tests.conftest import REPO
from workers.export import load

EXAMPLE = REPO / "examples" / "user-train"


def test_the_user_example_trains_reports_and_exports(client, tmp_path):
    prepare(REPO / "orchestrator", tmp_path / "data", vocab_size=512, pattern="*.py")
    data = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    data["workload"].update(steps=16, data={"path": str(tmp_path / "data")})
    data["checkpoint"] = {**data["checkpoint"], "interval_steps": 8, "directory": str(tmp_path / "ckpt")}
    spec = JobSpec.from_dict(data)
    job = client.submit(spec, workdir=EXAMPLE)
    st = job.wait(timeout_s=600)
    assert st.state is JobState.SUCCEEDED, (st.reason, job.logs()[-3000:])
    losses = [m.loss for m in job.metrics()]
    assert len(losses) == 16 and np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.3, losses

    # The program's own metric, and TFLOP/s per chip from the FLOPs the program states (no MFU: CPU devices
    # stand in for the chips, whose peak it would be measured against).
    assert st.metrics["grad_norm"] > 0 and st.metrics["tflops_per_chip"] > 0 and "mfu" not in st.metrics
    registry = CollectorRegistry()
    registry.register(JobCollector(client.store))
    prom = generate_latest(registry).decode()
    assert re.search(rf'orchestrator_job_metric{{job_id="{job.id}",name="grad_norm"}} [0-9.e+-]+', prom), prom
    page = write_report(client.store, job.id, tmp_path / "report.html").read_text()
    assert "<td>grad_norm (last step)</td>" in page

    # Weights out: the final step's parameters, the program's own tree, equal to what the workers summed.
    exported = client.export(job.id, tmp_path / "weights")
    params, config = load(tmp_path / "weights")
    assert config["step"] == 16 and set(params) == {"tokens", "positions", "blocks", "ln_f"}
    assert len(params["blocks"]) == 2 and params["tokens"].shape == (512, 128)
    flat = {k: v for k, v in _flatten(params)}
    want = job.record().result["param_sums"]
    assert len(flat) == len(want) and exported.step == 16 and Path(exported.out).exists()
    for key, total in want.items():
        assert abs(float(np.sum(flat[key].astype(np.float64))) - total) <= 1e-4 * max(1.0, abs(total)), key


def _flatten(tree, prefix=""):
    """(key path as `jax.tree_util.keystr` writes it, leaf) pairs of a tree of dicts and lists."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}[{k!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _flatten(v, f"{prefix}[{i}]")
    else:
        yield prefix, np.asarray(tree)
