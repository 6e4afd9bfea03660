"""An entrypoint whose module imports what the hosts do not have: found at submit, failing on every host."""

import importlib

# As `import a_package_no_host_has` would (hidden from the packaging check).
importlib.import_module("a_package_no_host_has")


def main(ctx) -> None:
    raise AssertionError("never reached")
