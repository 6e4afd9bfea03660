"""A user entrypoint that fails, for the failure-budget test."""


def broken(ctx):
    ctx.report(0, 5.0)
    print(f"host {ctx.rank} read its first batch")
    raise ValueError(f"bad batch on host {ctx.rank}")
