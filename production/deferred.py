"""Errors the device path defers to a later host read: the static exchange's group error (its
plan carries it on the device) and the Triton unpack's sticky status word.

The CPU unpack raises when the received chunks disagree with the plan; the device unpack cannot
without a host wait. There such a mismatch writes every output of that call in its "nothing
received" form (``expert_x`` zeros, ``row_src`` -1, ``row_weight`` 0, ``recv_map`` -1: never
uninitialised rows) and sets bits in a sticky status word of the device. :func:`check_static`
reads that word together with the plan's error words (one host wait) and raises
:class:`UnpackMismatch` if any bit is set; :func:`unpack_status` reads (and clears) it alone.
``EPKIT_CUDA_CHECKS=1`` makes every device unpack read its own status and raise at once (a host
wait per call).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import agree
from .hostreads import to_host
from .plan import ERR_RANK
from epkit.reference.errors import error

__all__ = ["UnpackMismatch", "unpack_status", "check_static"]


class UnpackMismatch(RuntimeError):
    """A CUDA unpack found received chunks that disagree with the plan (a deferred error: that
    call's outputs were written as if nothing had been received). ``bits``: the status bits
    (1 in-band count, 2 in-band slot count, 4 rows, 8 slot row, 16 expert row, 32 plan shape or
    sizes, 64 expert total; epkit.triton.unpack.STATUS_BITS)."""

    def __init__(self, bits: int):
        self.bits = int(bits)
        super().__init__(f"epkit.unpack: received chunks disagreed with the plan on CUDA (status "
                         f"bits {self.bits:#x}); that unpack's outputs were zero-filled")


def _status_word(device: torch.device) -> Optional[torch.Tensor]:
    """The device's sticky unpack status word (int32 [1]), kept by the Triton unpack
    (epkit.triton.unpack.status_word); None off CUDA (a CPU unpack raises at once instead) or
    where Triton is not importable (then no epkit unpack runs on CUDA)."""
    if device.type != "cuda":
        return None
    try:
        from .triton.unpack import status_word
    except ImportError:
        return None
    return status_word(device)


def unpack_status(device=None, clear: bool = True) -> int:
    """The CUDA unpack status bits of ``device`` (default: the current CUDA device) since they
    were last cleared: 0 when every unpack matched its plan. A host wait; ``clear`` zeroes the
    word (on the stream, no wait). 0 on CPU or without CUDA kernels."""
    if device is None:
        if not torch.cuda.is_available():
            return 0
        device = torch.device("cuda", torch.cuda.current_device())
    word = _status_word(torch.device(device))
    if word is None:
        return 0
    bits = int(to_host(word)[0])
    if bits and clear:
        word.zero_()
    return bits


def check_static(dispatch_or_plan) -> None:
    """Raise the group's :class:`epkit.InputError` if a static-exchange dispatch on CUDA had one
    (its plan carries it on the device), else :class:`UnpackMismatch` if a CUDA unpack on the
    plan's device found chunks that disagree with their plan since the last check (the word is
    then cleared). One host wait for both (it waits for the stream). A no-op on CPU. First,
    the call headers agreed on the device during CUDA-graph capture (production/agree.py) raise
    their error, if one has."""
    handle = getattr(dispatch_or_plan, "handle", None)
    plan = dispatch_or_plan if handle is None else handle.plan
    group = None if handle is None else handle.config.group
    agree.raise_pending(group)  # call headers agreed on the device during graph capture
    head = plan[: ERR_RANK + 1]
    word = _status_word(plan.device)
    if word is not None:  # one copy to the host: the error words and the status together
        head = torch.cat([head, word.to(torch.int64)])
    words = to_host(head).tolist()
    code, a, b, rank = words[:4]
    if code:
        raise error(int(rank), int(code), int(a), int(b))
    if word is not None and words[4]:
        word.zero_()
        raise UnpackMismatch(words[4])
