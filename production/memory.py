"""Where a tensor lives as far as epkit's Python is concerned: device memory or host memory.

The *device path* is what makes a host read of a tensor a wait: CUDA tensors, and, with the
Triton kernels registered for CPU (``EPKIT_KERNELS=triton``, interpreted), every CPU tensor not
marked as host memory. The interpreted path thus takes the CUDA path's branches (the plan's host
mirror, no host read of a device word except through :func:`epkit.hostreads.to_host`), so they
run and are tested on a machine without a GPU. Streams, graphs and NCCL stay keyed on real CUDA
(``t.is_cuda``).

The bottom of the production layers: imports torch and nothing of epkit but the Triton
registry's state (which never imports Triton).
"""

from __future__ import annotations

import torch

from . import triton

__all__ = ["HOST_MEMORY", "HOST_WORK", "device_path", "mark_host", "is_host", "pinned",
           "host_work"]

HOST_MEMORY = "_epkit_host_memory"  # attribute of a tensor in host memory on the device path
HOST_WORK = "epkit::host_work"  # the profiler range of work on host memory (host_work)


def device_path(t) -> bool:
    """Whether ``t`` is device memory as far as epkit's Python is concerned, so that reading it
    on the host is a wait: a CUDA tensor, or, with the Triton kernels registered for CPU, any
    CPU tensor not marked as host memory (:func:`mark_host`: the plan's mirror, the call header
    on a CPU backend)."""
    if not isinstance(t, torch.Tensor):
        return False
    if t.is_cuda:
        return True
    return t.device.type == "cpu" and "CPU" in triton.registered_keys() and not is_host(t)


def mark_host(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` (and so its views) as host memory on the device path; returns ``t``."""
    setattr(t, HOST_MEMORY, True)
    return t


def is_host(t: torch.Tensor) -> bool:
    """``t`` or the tensor it views was marked by :func:`mark_host`."""
    base = t._base
    return getattr(t, HOST_MEMORY, False) or (base is not None and
                                              getattr(base, HOST_MEMORY, False))


def pinned(t: torch.Tensor) -> torch.Tensor:
    """A host tensor in pinned memory where there is CUDA (else itself), marked as host."""
    return mark_host(t.pin_memory() if torch.cuda.is_available() else t)


def host_work():
    """A profiler range around work on host memory only (the static exchange's template plan
    and its words, a host mirror's word): on CUDA it runs on the CPU and launches no kernel,
    so ``epkit.device.count_launches`` does not count what runs inside (on
    ``EPKIT_KERNELS=triton`` the same CPU tensors would otherwise look like device ones)."""
    return torch.profiler.record_function(HOST_WORK)
