"""``python -m epkit.verify``: the conformance run (see :mod:`epkit.verify.cli`)."""

import sys

from epkit.verify.cli import main

if __name__ == "__main__":
    sys.exit(main())
