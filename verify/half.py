"""float16 through the reference, which takes float32 and bfloat16 only.

The spec's rule for a half-precision dtype is the one it states for bfloat16: every value moves
as it is, every sum is taken in float32 (from +0.0, in the spec's order) and rounded once to the
output's dtype. A float16 value is exactly a float32 value, so the reference run on the float32
copies of the float16 arrays computes the same float32 sums; rounding its float32 outputs to
float16 where the case says float16 (x: ``expert_x``, combine's output, the gradient of x;
expert_y: its gradient) is then what the spec defines for float16, bit for bit.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["HalfReference", "reference_for"]

_F16 = np.dtype(np.float16)


def _widen(arrays):
    return [a.astype(np.float32) if np.asarray(a).dtype == _F16 else a for a in arrays]


def reference_for(case, ref):
    """``ref`` itself, or a :class:`HalfReference` over it where ``case`` has float16 data."""
    if "float16" in (case.dtype, case.y_dtype):
        return HalfReference(ref, case.dtype == "float16", case.y_dtype == "float16")
    return ref


class HalfReference:
    """The reference module's dispatch / backward / combine with float16 data widened to
    float32 on the way in and the float16 outputs rounded back on the way out; everything
    else is the module's own. ``x16``, ``y16``: x, expert_y are float16."""

    def __init__(self, ref, x16: bool, y16: bool):
        self._ref, self._x16, self._y16 = ref, x16, y16
        self._wide = {}  # id(narrowed result list) -> the reference's own (float32) results

    def __getattr__(self, name):
        return getattr(self._ref, name)

    def _x(self, a):
        return a.astype(_F16) if self._x16 and a is not None and a.dtype == np.float32 else a

    def dispatch(self, xs, *args, **kwargs):
        res = self._ref.dispatch(_widen(xs), *args, **kwargs)
        if not self._x16:
            return res
        out = []
        for r in res:
            r2 = dataclasses.replace(r, expert_x=self._x(r.expert_x))
            if getattr(r, "rank_major", None) is not None:
                r2.rank_major = dataclasses.replace(r.rank_major,
                                                    recv_x=self._x(r.rank_major.recv_x))
            out.append(r2)
        self._wide[id(out)] = res
        return out

    def _own(self, res):
        return self._wide.get(id(res), res)

    def dispatch_backward(self, gs, res, *args, **kwargs):
        return [self._x(g) for g in
                self._ref.dispatch_backward(_widen(gs), self._own(res), *args, **kwargs)]

    def combine(self, ys, res, *args, **kwargs):
        return [self._x(o) for o in self._ref.combine(_widen(ys), self._own(res), *args,
                                                       **kwargs)]

    def combine_backward(self, gos, ys, res, *args, **kwargs):
        gys, gws = self._ref.combine_backward(_widen(gos), _widen(ys), self._own(res), *args,
                                              **kwargs)
        if self._y16:
            gys = [g.astype(_F16) for g in gys]
        return gys, gws
