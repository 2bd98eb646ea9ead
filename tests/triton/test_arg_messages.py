"""The argument errors of the C++ ops, of their Triton kernels and of their fake kernels are one
message: every case of arg_cases.py's table raises in the C++ and the Triton kernel with the
same first line, word for word; on fake tensors (torch.compile, meta) the fake kernel raises
that line too, or nothing where the check needs the plan's words or the tensors' data."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from arg_cases import EXPECT, cases
from epkit import triton as registry

CASES = cases()


def _message(fn, args):
    try:
        fn(*args)
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    return None


def test_the_table_covers_every_op_with_checks():
    """Every op of the Triton table has cases (empty_large checks nothing of its own), and every
    case says which check it is to hit."""
    ops = {op for op, _ in CASES.values()}
    assert ops == set(registry.OPS) - {"empty_large"}, sorted(set(registry.OPS) ^ ops)
    assert set(EXPECT) == set(CASES), sorted(set(EXPECT) ^ set(CASES))


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_triton_kernel_gives_the_cpp_message(cpp, name):
    op, args = CASES[name]
    want = _message(getattr(torch.ops.epkit, op), args)
    assert want is not None, f"the C++ kernel accepts {name}"
    assert EXPECT[name] in want, f"{name} hits another check: {want}"
    kernel = getattr(importlib.import_module(f"epkit.triton.{registry.OPS[op]}"), op)
    assert _message(kernel, args) == want


def _fake_message(op, args):
    mode = FakeTensorMode()
    fake = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
    with mode:
        try:
            getattr(torch.ops.epkit, op)(*fake)
        except Exception as exc:  # noqa: BLE001 - any other error is the failure reported
            return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_fake_kernel_gives_the_cpp_message_or_none(cpp, name):
    op, args = CASES[name]
    want = _message(getattr(torch.ops.epkit, op), args)
    got = _fake_message(op, args)
    assert got in (None, f"RuntimeError: {want}")


def test_the_fake_kernels_check_the_metadata(cpp):
    """The fakes run the metadata checks: a dtype, a dimension, an option or a transport code
    that is wrong raises while tracing (before: none did, and seven cases failed with a
    KeyError, an IndexError, a ZeroDivisionError or a negative size instead)."""
    raised = {name for name, (op, args) in CASES.items() if _fake_message(op, args)}
    for name in ("gather_rows.transport", "gather_rows.y_1d", "layout.negative_experts",
                 "layout.negative_ranks", "pack.bad_transport", "plan.zero_ranks",
                 "scatter_rows.rows", "prepare.weights_double", "unpack.recv_dtype",
                 "quantize_mxfp8.hidden", "combine_backward_dest.recv_dtype"):
        assert name in raised, name
    assert len(raised) >= 60, len(raised)
