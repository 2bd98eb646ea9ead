"""The one tolerance of the contract: ``grad_topk_weights`` (docs/design.md, item 6).

Every other output of dispatch and combine is bitwise: rows are moved, cast or scaled by one
float32 multiply, so there is one right answer. The weight gradient of a slot is a dot product
``<grad_out_s[t], y(s, t, k)>`` over the ``H`` elements of a row, and a sum over ``H`` terms has
as many right answers as there are orders to add them in: a kernel that sums in blocks, in a
tree or with fused multiply-adds is as correct as the reference (which adds the products in
float64, ``h`` ascending, and rounds once). Pinning the bits would pin the summation order.

Why this value: adding ``n`` terms in float32 in any order errs by at most about
``n * u * sum |terms|`` (``u = 2**-24``, the unit roundoff); the bound allows twice that,
``H * 2**-23 * sum_h |g_h * y_h|``, which covers the rounding of each product (exact for
bfloat16 data, whose products fit a float32), of every addition and of the final cast, in any
order. The ``+ 2**-126`` (float32's smallest normal) is the absolute slack where every product
is so small that the sum lands among the subnormals (or is flushed to zero) and a relative
bound says nothing.
"""

from __future__ import annotations

__all__ = ["WEIGHT_GRAD_PER_TERM", "WEIGHT_GRAD_FLOOR", "weight_grad_allowed_error"]

WEIGHT_GRAD_PER_TERM = 2.0**-23  # twice float32's unit roundoff, per term of the dot product
WEIGHT_GRAD_FLOOR = 2.0**-126  # float32's smallest normal: the underflow slack


def weight_grad_allowed_error(hidden, abs_dot):
    """The largest ``|got - exact|`` allowed for a slot's weight gradient: ``hidden * 2**-23 *
    abs_dot + 2**-126``, with ``abs_dot = sum_h |g_h * y_h|`` (in float64). ``abs_dot`` may be
    a float or a NumPy array (one bound per slot)."""
    return hidden * WEIGHT_GRAD_PER_TERM * abs_dot + WEIGHT_GRAD_FLOOR
