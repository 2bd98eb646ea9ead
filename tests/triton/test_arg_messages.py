"""The argument errors of the C++ ops and of their Triton kernels are one message: every case of
arg_cases.py's table raises in both, and the first lines agree word for word."""

from __future__ import annotations

import importlib

import pytest
import torch

from arg_cases import cases
from epkit import triton as registry

CASES = cases()


def _message(fn, args):
    try:
        fn(*args)
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    return None


def test_the_table_covers_every_op_with_checks():
    """Every op of the Triton table has cases (empty_large checks nothing of its own)."""
    ops = {op for op, _ in CASES.values()}
    assert ops == set(registry.OPS) - {"empty_large"}, sorted(set(registry.OPS) ^ ops)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_triton_kernel_gives_the_cpp_message(cpp, name):
    op, args = CASES[name]
    want = _message(getattr(torch.ops.epkit, op), args)
    assert want is not None, f"the C++ kernel accepts {name}"
    kernel = getattr(importlib.import_module(f"epkit.triton.{registry.OPS[op]}"), op)
    assert _message(kernel, args) == want
