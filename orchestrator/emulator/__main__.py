"""`python -m orchestrator.emulator`: serve the TPU API emulator until interrupted.

At start it prints its URL and, on the next line, ``control token: <token>``: the
bearer token every `/_emulator/` control request needs. ``--control-token-file``
also writes the token to a file only its owner can read.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import tempfile
import threading
from pathlib import Path

from orchestrator.emulator.server import DEFAULT_TIME_SCALE, serve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orchestrator.emulator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="a loopback address (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8470, help="0 picks a free port (default 8470)")
    p.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE,
                   help=f"multiplies the real service's timings (default {DEFAULT_TIME_SCALE})")
    p.add_argument("--seed", type=int, default=0, help="seed of the random transient errors")
    p.add_argument("--zone", action="append", dest="zones",
                   help="a zone that exists (repeatable); by default every zone exists")
    p.add_argument("--control-token-file", type=Path,
                   help="also write the control token to this file (mode 600), replacing it")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        emu = serve(args.host, args.port, time_scale=args.time_scale, seed=args.seed,
                    zones=tuple(args.zones) if args.zones else None)
    except (ValueError, OSError) as e:
        p.error(str(e))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        if args.control_token_file is not None:
            try:
                _write_private(args.control_token_file, emu.control_token + "\n")
            except OSError as e:
                p.error(f"cannot write the control token file: {e}")
        print(f"TPU API emulator on {emu.url} (control API under {emu.url}/_emulator/); Ctrl-C stops it", flush=True)
        print(f"control token: {emu.control_token}", flush=True)
        stop.wait()
    finally:
        emu.stop()
    return 0


def port_number(text: str) -> int:
    """A TCP port, 0 to 65535 (0: the system picks a free one); what argparse says of anything else."""
    if not (text.isascii() and text.isdigit() and len(text) <= 5 and int(text) <= 65535):
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to 65535 (0 picks a free port), got {text!r}")
    return int(text)


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path` with mode 600, atomically: a new file renamed over the old,
    so no other user ever reads it and a link at `path` is replaced, never followed."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mkstemp creates it 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


if __name__ == "__main__":
    raise SystemExit(main())
