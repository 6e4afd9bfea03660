"""Bytes shipped per job to every host, and the time to pack them (`orchestrator.control.shipping`).

    python benchmarks/shipping.py        # writes benchmarks/results/shipping.json

What a launch sends each host through Ray's runtime environments: the project's packages
(`workers`, `kernels`, `policies` as py_modules, uploaded once per cluster and unpacked once per
node) and an entrypoint job's folder (packed at submit). Packing is timed against hashing the
same folder, Ray's own content addressing, measured in the same run (a ratio).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, machine  # noqa: E402
from orchestrator.control import shipping  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def project_package_bytes(name: str) -> int:
    from ray._private.runtime_env.packaging import create_package

    path, _ = shipping.project_source(name)
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "p.zip"
        create_package(str(path), target, include_gitignore=False, include_parent_dir=True,
                       excludes=shipping.PROJECT_EXCLUDES)
        return target.stat().st_size


def timed(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    from ray._private.runtime_env.packaging import get_uri_for_directory

    packages = {name: project_package_bytes(name) for name in shipping.PROJECT_PACKAGES}
    example = REPO / "examples" / "user-train"
    folder = shipping.pack_folder(example)
    pack_s = timed(lambda: shipping.pack_folder(example))
    hash_s = timed(lambda: get_uri_for_directory(str(example), include_gitignore=True,
                                                 excludes=shipping.FOLDER_EXCLUDES))
    result = {
        "machine": machine(),
        "project_packages_bytes": packages,
        "project_bytes_total": sum(packages.values()),
        "user_example_folder_bytes": len(folder.data),
        "bytes_per_job_user_example": sum(packages.values()) + len(folder.data),
        "pack_s_user_example": round(pack_s, 4),
        "hash_s_user_example": round(hash_s, 4),
        "ratio_pack_over_hash": round(pack_s / hash_s, 2),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "shipping.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
