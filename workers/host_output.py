"""What a host's program prints and logs, on its way to the job's log: the logging route and the line buffer."""

from __future__ import annotations

import io
import logging
import threading

# Libraries that narrate routine work at INFO into the job's log: orbax every save (through absl), fsspec every
# block it reads of a bucket's token files, gcsfs its set-up. Their warnings still come through.
_CHATTY_LOGGERS = ("absl", "fsspec", "gcsfs", "google.auth", "urllib3", "etils")


def route_logs(out) -> logging.Handler:
    """This process's logging into the job's log (`out`, a stream): INFO and up, from the chatty libraries
    their warnings only. Returns the handler added to the root logger."""
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    for chatty in _CHATTY_LOGGERS:
        logging.getLogger(chatty).setLevel(logging.WARNING)
    return handler


class LineBuffer(io.TextIOBase):
    """Collects what user code prints or logs, to ship with the next report."""

    def __init__(self, echo):
        self._echo, self._lock, self._lines, self._partial = echo, threading.Lock(), [], ""

    def write(self, s: str) -> int:
        self._echo.write(s)
        with self._lock:
            text = self._partial + s
            *full, self._partial = text.split("\n")
            self._lines.extend(full)
        return len(s)

    def flush(self) -> None:
        self._echo.flush()

    def fileno(self) -> int:  # for code that writes to the descriptor itself (that output is not collected)
        return self._echo.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]  # typeshed has TextIOBase.encoding writeable; io's is not
        return getattr(self._echo, "encoding", None) or "utf-8"

    def isatty(self) -> bool:
        return False

    def drain(self) -> list[str]:
        with self._lock:
            lines, self._lines = self._lines, []
        return lines
