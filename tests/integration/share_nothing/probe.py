"""A user program that looks for the submitting machine's files from a host
(tests/integration/test_share_nothing.py)."""

import os


def main(ctx):
    import workers

    print(f"workers imported from {workers.__file__}; working directory {os.getcwd()}")
    seen = []
    for path in ctx.args["must_not_see"]:
        try:
            with open(path, "rb") as f:
                f.read(1)
            seen.append(path)
        except OSError:
            pass
    if seen:
        raise RuntimeError(f"this host sees the submitting machine's files: {seen}")
    print(f"host {ctx.rank} sees none of the submitting machine's files")
