"""`python -m orchestrator.emulator`: serve the TPU API emulator until interrupted."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from orchestrator.emulator.server import DEFAULT_TIME_SCALE, serve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orchestrator.emulator", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="a loopback address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8470, help="0 picks a free port (default 8470)")
    p.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE,
                   help=f"multiplies the real service's timings (default {DEFAULT_TIME_SCALE})")
    p.add_argument("--seed", type=int, default=0, help="seed of the random transient errors")
    p.add_argument("--zone", action="append", dest="zones",
                   help="a zone that exists (repeatable); by default every zone exists")
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
    print(f"TPU API emulator on {emu.url} (control API under {emu.url}/_emulator/); Ctrl-C stops it", flush=True)
    try:
        stop.wait()
    finally:
        emu.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
