"""Source rules of the CUDA kernels that no GPU run can show reliably (runs without a GPU).

vec.cuh narrow_store reads a local array back through uint4 / uint2 casts: the array must be
declared alignas(16) (issue 12, item 5), else the vector access is undefined behaviour that the
compiler only happens to get right. compute-sanitizer memcheck (scripts/gpu_check.sh) reports a
misaligned access should one appear at run time.
"""

import os
import re

CUDA = os.path.join(os.path.dirname(__file__), "..", "..", "production", "csrc", "cuda")


def vector_read_locals(src: str):
    """(function, array, aligned) for every local `T name[V]` read back through a uint4 / uint2
    cast in a __device__ function of `src`."""
    out = []
    for fn in re.finditer(r"__device__ __forceinline__ \w+ (\w+)\(", src):
        body = src[fn.end(): src.find("\n}\n", fn.end())]
        for m in re.finditer(r"^\s*(alignas\(16\)\s+)?T\s+(\w+)\[V\];", body, re.M):
            if re.search(r"reinterpret_cast<const uint[24]\s*\*>\(%s\)" % m.group(2), body):
                out.append((fn.group(1), m.group(2), bool(m.group(1))))
    return out


def test_local_arrays_read_as_vectors_are_aligned():
    found = vector_read_locals(open(os.path.join(CUDA, "vec.cuh")).read())
    assert ("narrow_store", "e") in [(f, a) for f, a, _ in found]  # the rule is not vacuous
    assert all(aligned for _, _, aligned in found), found
