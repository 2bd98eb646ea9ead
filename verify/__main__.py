"""``python -m epkit.verify``: the conformance run (see :mod:`epkit.verify.cli`)."""

import os
import sys

from .cli import main
from .pool import under_torchrun

if __name__ == "__main__":
    rc = main()
    if under_torchrun():
        # Every rank has met at a barrier and destroyed the group (TorchrunGroup.close); skip
        # interpreter teardown, where gloo's threads can still be winding down ("terminate
        # called without an active exception"): the verdict is already printed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc or 0)
    sys.exit(rc)
