"""The kernels read the ABI by name (epkit.triton.abi), never retype it as literals: no word
offset written as ``pointer + 9`` and no code as ``exchange == 5`` in a Triton kernel of
production/triton/. The checker is tried on planted kernels first, so it can fail.

What counts (read from each ``@triton.jit`` function's syntax tree):
- a load or store address whose sum has an integer term other than 0 and 1, or that is a
  kernel argument plus 1 (a word's offset: ``p_ptr + 1``; ``offsets + j + 1``, the next
  element of a section, is no word offset);
- a comparison of a variable with an integer other than -1, 0 and 1 by ``==`` or ``!=`` (a
  code), except for the function's own ``tl.constexpr`` arguments (tile sizes and widths:
  ``VB == 16``) and in bits.py (the number formats: an E4M3 exponent field of 15).
"""

from __future__ import annotations

import ast
import glob
import os

import pytest

from epkit.reference import abi
from epkit.triton import abi as K

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNELS = sorted(glob.glob(os.path.join(ROOT, "production", "triton", "*.py")))
FORMATS = {"bits.py"}  # number formats, not the ABI


def _terms(e) -> list:
    if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Add):
        return _terms(e.left) + _terms(e.right)
    return [e]


def _int(e):
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
        v = _int(e.operand)
        return None if v is None else -v
    return e.value if isinstance(e, ast.Constant) and type(e.value) is int else None


def literals(source: str, filename: str = "<kernels>") -> list[str]:
    """``file:line text`` of every literal word offset or code in the source's kernels."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef):
            continue
        if not any("jit" in ast.unparse(d) for d in fn.decorator_list):
            continue
        args = {a.arg for a in fn.args.args}
        constexprs = {a.arg for a in fn.args.args
                      if a.annotation is not None and "constexpr" in ast.unparse(a.annotation)}
        for node in ast.walk(fn):
            if (isinstance(node, ast.Call) and ast.unparse(node.func) in ("tl.load", "tl.store")
                    and node.args):
                terms = _terms(node.args[0])
                ints = [v for v in map(_int, terms) if v is not None]
                word = (len(terms) == 2 and ints == [1]
                        and any(isinstance(t, ast.Name) and t.id in args for t in terms))
                if any(v not in (0, 1) for v in ints) or word:
                    found.append(f"{filename}:{node.lineno} {ast.unparse(node.args[0])}")
            if isinstance(node, ast.Compare) and os.path.basename(filename) not in FORMATS:
                left = node.left
                for op, right in zip(node.ops, node.comparators):
                    v = _int(right)
                    if (isinstance(op, (ast.Eq, ast.NotEq)) and v is not None
                            and v not in (-1, 0, 1) and isinstance(left, ast.Name)
                            and left.id not in constexprs):
                        found.append(f"{filename}:{node.lineno} {ast.unparse(node)}")
    return found


PLANTED = '''
@triton.jit
def plan_words(p_ptr, g_ptr, exchange, R, BX: tl.constexpr):
    tl.store(p_ptr + 9, R)                       # the ranks word, retyped
    h = tl.load(g_ptr + s * W + 4)               # a count word's hidden, retyped
    tl.store(p_ptr + 1, R)                       # err_a, retyped
    static = exchange == 5                       # a code, retyped
    ok = tl.load(p_ptr + PLAN_RANKS)             # named: fine
    nxt = tl.load(p_ptr + o + j + 1)             # the next element: fine
    tiles = BX == 32                             # a constexpr's size: fine
'''


def test_the_checker_finds_planted_literals():
    found = literals(PLANTED)
    assert [f.split(" ", 1)[1] for f in found] == [
        "p_ptr + 9", "g_ptr + s * W + 4", "p_ptr + 1", "exchange == 5"]


@pytest.mark.parametrize("path", KERNELS, ids=os.path.basename)
def test_kernels_read_the_abi_by_name(path):
    with open(path, encoding="utf-8") as f:
        found = literals(f.read(), os.path.relpath(path, ROOT))
    assert not found, "literal ABI words or codes in kernels (use epkit.triton.abi):\n" + \
        "\n".join(found)


def test_the_kernel_constants_are_the_abi():
    """A sample of each table, against the reference ABI's own numbers."""
    assert [getattr(K, f"PLAN_{f.upper()}").value for f in abi.PLAN_FIELDS] == \
        list(range(len(abi.PLAN_FIELDS)))
    assert K.PLAN_HEADER.value == abi.PLAN_HEADER == abi.plan_slices(2, 4)["send_counts"].start
    assert K.WORD_HEADER.value == abi.WORD_HEADER
    assert K.REASON_TOPK_MISMATCH.value == abi.Reason.TOPK_MISMATCH
    assert K.EXCHANGE_STATIC.value == abi.EXCHANGE_CODES["static"]
    assert K.VARIANT_EQUAL.value == abi.VARIANT_CODES["equal"]
    assert K.PAYLOAD_NONE.value == 0 and K.BLOCK_FP8_BLOCK128.value == 128
    assert K.DTYPE_BFLOAT16.value == abi.DTYPE_CODES["bfloat16"]
    assert K.PAIRS_META_W.value == abi.PAIRS_META.index("w")
