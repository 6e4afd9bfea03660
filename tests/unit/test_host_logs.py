"""What reaches a job's log from a host's logging (`workers.host.route_logs`)."""

from __future__ import annotations

import io
import logging

from workers.host_output import _CHATTY_LOGGERS, route_logs


def test_the_job_log_gets_the_program_s_lines_and_only_the_libraries_warnings():
    out = io.StringIO()
    root = logging.getLogger()
    levels = {name: logging.getLogger(name).level for name in ("", *_CHATTY_LOGGERS)}
    handler = route_logs(out)
    try:
        logging.getLogger("workers.host").info("step 10/40 loss 4.2")
        logging.getLogger("fsspec.caching").info("BlockCache fetching block 7")  # every read of a bucket's tokens
        logging.getLogger("gcsfs").info("gcsfs experimental features enabled")
        logging.getLogger("absl").info("Saving checkpoint at step 10")  # orbax
        logging.getLogger("fsspec.caching").warning("a block could not be read")
    finally:
        root.removeHandler(handler)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    assert out.getvalue().splitlines() == ["INFO workers.host: step 10/40 loss 4.2",
                                           "WARNING fsspec.caching: a block could not be read"]
