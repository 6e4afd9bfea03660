"""`orchestrator data prepare` in a process of its own, timed and measured: one line of megabytes."""

from __future__ import annotations

import numpy as np

from tests.unit.test_data_prepare import tokens_of


def test_one_line_of_megabytes_is_linear_bounded_and_shows_progress(tmp_path):
    """1 MB of letters in one line took over 300 s, and 30 MB used 1.8 GB: a separate process, timed and measured."""
    rng = np.random.default_rng(0)
    src = tmp_path / "src"
    src.mkdir()
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    (src / "word.txt").write_bytes(rng.choice(letters, 1_000_000).tobytes())  # one "word" of 1 MB
    text = rng.choice(np.array([b"the ", b"cat ", b"sat ", b"on ", b"a ", b"mat. "], dtype=object), 1_500_000)
    (src / "line.txt").write_bytes(b"".join(text))  # ~6 MB in one line
    # The peak is the process's own (VmHWM): ru_maxrss carries over the RSS of the pytest process that forked it.
    script = (f"import re, time\n"
              f"from orchestrator.user.data_prepare import prepare\n"
              f"seen = []\n"
              f"t = time.perf_counter()\n"
              f"s = prepare({str(src)!r}, {str(tmp_path / 'out')!r}, vocab_size=1024, "
              f"progress=lambda *a: seen.append(a))\n"
              f"peak = int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read())[1]) // 1024\n"
              f"print(time.perf_counter() - t, peak, s.documents)\n"
              f"print(seen)\n")
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    seconds, peak_mib, documents = r.stdout.splitlines()[0].split()
    assert int(documents) == 2
    assert float(seconds) < 120, seconds  # about 10 s on a quiet 2-core machine
    assert int(peak_mib) < 600, peak_mib  # about 250 MiB; the same 6 MB line took 1.4 GB before
    seen = eval(r.stdout.splitlines()[1])
    total = sum(p.stat().st_size for p in src.iterdir())
    for what in ("training", "encoding"):
        done = [d for w, d, t in seen if w == what and t == total]
        assert len(done) > 5 and done == sorted(done) and done[-1] == total, (what, done)
    assert tokens_of(tmp_path / "out").size > 1_000_000
