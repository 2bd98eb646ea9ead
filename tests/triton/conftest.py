"""Triton kernel tests: each kernel against the C++ CPU kernel and the reference, run on this
machine in Triton's interpreter (``epkit/triton/_runtime.py`` sets ``TRITON_INTERPRET=1`` where
there is no GPU). The Triton implementations are called directly (``epkit.triton.<module>``),
the C++ kernels through ``torch.ops.epkit`` (this process keeps ``EPKIT_KERNELS=cpp``)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def cpp():
    """The C++ kernels (``torch.ops.epkit``), loaded."""
    import torch

    import epkit.ops  # noqa: F401  (loads the library)

    return torch.ops.epkit
