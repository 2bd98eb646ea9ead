"""Which of epkit's local kernels serve a verify run: what its summary, JSON and JUnit record.

epkit's CPU tensors run the C++ kernels, or, with ``EPKIT_KERNELS=triton``, the Triton kernels
in Triton's interpreter (no GPU) ; CUDA tensors always run the Triton kernels compiled for the
GPU. A run's workers take ``EPKIT_KERNELS`` from the environment ``epkit verify --kernels`` sets
before they start, and its backend decides the tensors' device (gloo: CPU, nccl: CUDA). For an
implementation that does not call epkit the line says which kernels epkit would have used.
"""

from __future__ import annotations

import os


def _triton_version() -> str:
    from importlib import metadata

    for dist in ("triton", "pytorch-triton", "pytorch-triton-rocm"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def kernels_served(backend: str, kernels: str | None = None) -> str:
    """``"C++ (CPU)"``, ``"Triton 3.9.0, interpreted (CPU)"`` or ``"Triton 3.9.0, compiled
    (CUDA)"``: the kernels serving a run over ``backend`` with ``EPKIT_KERNELS`` = ``kernels``
    (None: the environment's, default ``cpp``)."""
    mode = (kernels or os.environ.get("EPKIT_KERNELS", "cpp")).strip().lower() or "cpp"
    if backend == "nccl":
        return f"Triton {_triton_version()}, compiled (CUDA)"
    if mode == "triton":
        import torch

        interpreted = (os.environ.get("TRITON_INTERPRET", "1" if not torch.cuda.is_available()
                                      else "0") == "1")
        return f"Triton {_triton_version()}, {'interpreted' if interpreted else 'compiled'} (CPU)"
    return "C++ (CPU)"
