"""epkit on the device path, for users: where a tensor lives, the host reads, the deferred errors.

Off the *device path* (:func:`device_path`: CUDA tensors, or any tensor not in host memory under
``EPKIT_KERNELS=triton``, where the interpreted Triton kernels stand in for the GPU's) every
function here is the identity or a no-op, so the default CPU path does what it always did. On
it, every host read of device memory goes through :func:`to_host`, which
:func:`count_host_reads` counts (docs/design.md, "Host reads").

This module gathers the public names; each is defined where its job is:

- ``production/memory.py``: :func:`device_path`, :func:`mark_host`, :func:`is_host`;
- ``production/hostreads.py``: :func:`to_host`, :func:`count_host_reads` (host reads and
  host-to-device copies: the host waits);
- ``production/launches.py``: :func:`count_launches` (kernel launches and collectives);
- ``production/count_exchange.py``: how the plan and its host mirror (a dispatch's
  ``handle.plan_host``) are made on the device (the one host wait of an eager dispatch; none
  for the static exchange);
- ``production/deferred.py``: :func:`check_static`, :func:`unpack_status`, :class:`UnpackMismatch`;
- ``production/streams.py``: :class:`Side`, the lazy form's side stream.

Nothing inside epkit imports this module: it sits above the layers it gathers.
"""

from __future__ import annotations

from .deferred import UnpackMismatch, check_static, unpack_status
from .hostreads import count_host_reads, to_host
from .launches import count_launches
from .memory import device_path, is_host, mark_host
from .streams import Side

__all__ = ["device_path", "mark_host", "is_host", "to_host", "check_static", "unpack_status",
           "UnpackMismatch", "Side", "count_host_reads", "count_launches"]
