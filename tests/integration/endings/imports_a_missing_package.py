"""An entrypoint whose module imports what the hosts do not have: found at submit, failing on every host."""

import importlib

importlib.import_module("a_package_no_host_has")  # as `import a_package_no_host_has` would (hidden from the packaging check)


def main(ctx) -> None:
    raise AssertionError("never reached")
