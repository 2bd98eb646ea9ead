"""The lazy form's side stream (epkit.lazy): issue on a side stream, join on the current one.

On CPU every method is a no-op, so the lazy form's code is the same on every device.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["Side"]

_SIDE_STREAMS: dict = {}


class Side:
    """The lazy form's side stream on CUDA; on CPU a no-op.

    ``with Side(*inputs) as side:`` runs the issue on a side stream that first waits for the
    current stream (the inputs are then in use there: ``record_stream``); ``side.wrap(finish,
    *made)`` returns ``finish`` made to end with :meth:`join`: the current stream waits for the
    side stream's work, and the tensors made on the side stream (the result, ``made``) are marked
    in use by the current stream, so the caching allocator does not hand their memory out while
    the current stream may still read them.
    """

    def __init__(self, *inputs: Optional[torch.Tensor]):
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        self.cuda = bool(tensors) and tensors[0].is_cuda
        if self.cuda:
            dev = tensors[0].device
            if dev not in _SIDE_STREAMS:
                _SIDE_STREAMS[dev] = torch.cuda.Stream(device=dev)
            self.stream = _SIDE_STREAMS[dev]
            self.inputs = tensors
            self.done = None

    def __enter__(self):
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            for t in self.inputs:
                if t.is_cuda:
                    t.record_stream(self.stream)
            self._ctx = torch.cuda.stream(self.stream)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self._ctx.__exit__(*exc)
            self.done = torch.cuda.Event()
            self.done.record(self.stream)
        return False

    def join(self, *made: Optional[torch.Tensor]) -> None:
        if self.cuda:
            cur = torch.cuda.current_stream(self.stream.device)
            cur.wait_event(self.done)
            for t in (x for m in made for x in (m if isinstance(m, tuple) else (m,))):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(cur)

    def wrap(self, finish, *made: Optional[torch.Tensor]):
        if not self.cuda:
            return finish

        def finished():
            out = finish()
            self.join(out, *made)
            return out

        return finished
