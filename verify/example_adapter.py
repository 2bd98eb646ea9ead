"""The adapter of docs/verify.md: a permute + all-to-all + index_add dispatcher under the harness.

    epkit verify --impl epkit.verify.example_adapter:make --contract bounded
"""
from types import SimpleNamespace

from epkit.verify.adapt import FullTopK, exchange_row_src, offsets_of
from epkit.baselines.megatron_style import A2ADispatcher


class Adapter:
    def __init__(self, group):
        self.group = group

    def dispatch(self, x, topk_idx, topk_weights, *, num_experts, align, capacity):
        d = A2ADispatcher(self.group, num_experts)
        expert_x, tokens_per_expert, h = d.dispatch(x, topk_idx, topk_weights)
        row_src, row_weight = exchange_row_src(
            h.perm, topk_idx.shape[1], topk_weights, h.input_splits, h.output_splits,
            self.group, order=h.sort_idx)
        return SimpleNamespace(expert_x=expert_x, tokens_per_expert=tokens_per_expert,
                               expert_offsets=offsets_of(tokens_per_expert), row_src=row_src,
                               row_weight=row_weight, dispatcher=d, handle=h)

    def combine(self, expert_y, dispatched, *, weighted):
        return dispatched.dispatcher.combine(expert_y, dispatched.handle, weighted=weighted)


def make(group):
    return FullTopK(Adapter(group), group)  # -1 slots: routed elsewhere, turned into padding


make.capabilities = {"capacity": False, "align": 1}  # what the dispatcher does not do
