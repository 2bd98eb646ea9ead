"""An example of examples/ as a module, for the tests that share its code (the CPU set-up of
a framework, its layer's build): what the example does is what the tests check."""

from __future__ import annotations

import importlib.util
import os

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "examples")


def load(name: str):
    """``examples/<name>.py``, imported (its ``main`` does not run)."""
    spec = importlib.util.spec_from_file_location(f"{name}_example", os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
