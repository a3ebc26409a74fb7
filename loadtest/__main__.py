"""``python -m loadtest SUBCOMMAND …``: each subcommand is the module
``loadtest.<name>`` exposing ``main(argv: list[str]) -> int``."""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "replay": "loadtest.replay",
    "realprompts": "loadtest.realprompts",
    "overhead": "loadtest.overhead",
    "overload": "loadtest.overload",
    "adaptive": "loadtest.adaptive",
    "semcache": "loadtest.semcache",
    "validate-sim": "loadtest.validate_sim",
    "token-estimate": "loadtest.token_estimate",
    "fuzz": "loadtest.fuzz",
    "faults": "loadtest.faults",
    "soak": "loadtest.soak",
    "burst": "loadtest.burst",
    "batch": "loadtest.batch",
    "sdk-compare": "loadtest.sdk_compare",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        print(f"usage: python -m loadtest {{{','.join(SUBCOMMANDS)}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[argv[0]])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
