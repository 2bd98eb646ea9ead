"""Adapters that misbehave as processes: the pool must survive them."""

from __future__ import annotations

import os
import time

import torch.distributed as dist

from epkit.baselines.plain_torch import PlainTorchDispatcher


class _OnRank(PlainTorchDispatcher):
    rank_to_hit = 0

    def hit(self):
        return dist.get_rank(self.group) == self.rank_to_hit


class Hang(_OnRank):
    """Rank 0 never returns from dispatch (its peers then wait in the count exchange)."""

    def dispatch(self, *a, **kw):
        if self.hit():
            while True:
                time.sleep(1)
        return super().dispatch(*a, **kw)


class Die(_OnRank):
    """Rank 0's process exits in the middle of dispatch."""

    def dispatch(self, *a, **kw):
        if self.hit():
            os._exit(7)
        return super().dispatch(*a, **kw)


class RaiseOnOneRank(_OnRank):
    """Rank 0 raises before the first collective; its peers are left waiting."""

    def dispatch(self, *a, **kw):
        if self.hit():
            raise RuntimeError("rank 0 gave up")
        return super().dispatch(*a, **kw)


class CombineNotImplemented(PlainTorchDispatcher):
    """Dispatch works; combine is not there yet (on every rank)."""

    def combine(self, *a, **kw):
        raise NotImplementedError("combine: not yet")


# factories: factory(group) -> adapter (a class is one)
hang = Hang
die = Die
raise_on_one_rank = RaiseOnOneRank
combine_not_implemented = CombineNotImplemented


def not_implemented(group):
    raise NotImplementedError("this mode is not implemented")
