"""epkit.nn: MoE layers built on ``epkit.dispatch`` / ``epkit.combine``.

- :class:`DenseMoE`: a single-process top-k SwiGLU MoE layer, the reference; its
  :class:`Router` offers softmax or sigmoid scores, group-limited top-k, an expert bias for
  selection, and :func:`load_balancing_loss` (``aux_loss_coef``).
- :class:`ExpertParallelMoE`: the same layer with its experts spread over a process group
  (``ExpertParallelMoE.from_dense(dense, group)``), equal to DenseMoE up to the order of some
  float32 sums.
- :func:`to_expert_parallel`, :func:`sync_replicated_grads`, :func:`expert_parameters`,
  :func:`named_expert_parameters`,
  :func:`replicated_parameters`: converting a model and training it.
- :func:`grouped_mm`: the segment-wise matmul the experts run.

docs/usage.md walks through adopting them, from the layer down to the ops.
"""

from .grouped import grouped_mm, grouped_mm_backend
from .moe import (
    DenseMoE,
    ExpertParallelMoE,
    Router,
    SwiGLU,
    SwiGLUExperts,
    expert_parameters,
    named_expert_parameters,
    load_balancing_loss,
    replicated_parameters,
    sync_replicated_grads,
    to_expert_parallel,
    weighted_sum,
)

__all__ = [
    "DenseMoE", "ExpertParallelMoE", "Router", "SwiGLU", "SwiGLUExperts", "grouped_mm",
    "grouped_mm_backend", "expert_parameters", "named_expert_parameters", "replicated_parameters",
    "sync_replicated_grads", "to_expert_parallel", "weighted_sum", "load_balancing_loss",
]
