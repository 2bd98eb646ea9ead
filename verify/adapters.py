"""Adapters: how the harness drives an implementation.

Protocol (``--impl module:factory``)::

    adapter = factory(group)            # group: a torch.distributed ProcessGroup
    d = adapter.dispatch(x, topk_idx, topk_weights, *, num_experts, align, capacity)
    #   d.expert_x, d.tokens_per_expert, d.expert_offsets, d.row_src, d.row_weight
    #   (optional: d.dropped_per_expert, d.expert_scale); a pending handle with .wait() is
    #   waited for
    out = adapter.combine(expert_y, d, *, weighted)

Instead of the expert-major fields, ``d`` may hold the reference's rank-major ones
(``recv_x``, ``recv_topk_idx``, ``recv_topk_weights``, ``recv_src``; docs/verify.md).

A factory may carry ``modes``: a list of :class:`~epkit.verify.cases.ModeSpec`; the harness then
runs every mode, calling ``factory(group, **mode.kwargs)``. Without ``modes`` there is one mode,
``default``. It may carry ``capabilities`` (a dict, :mod:`epkit.verify.capabilities`): the
strategies draw only inside them. A draw refused with ``NotImplementedError`` on every rank is
redrawn without the refused feature and counted as refused (a failure when the feature is
declared supported); a refusal that cannot be attributed leaves the example unchecked, which
fails the mode. :mod:`epkit.verify.adapt` has helpers for adapters.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import os
import sys

from epkit.reference import payloads
from .cases import ModeSpec

__all__ = ["EpkitAdapter", "ImplNotFound", "epkit_factory", "epkit_modes", "plain_torch",
           "load_factory"]


def epkit_modes() -> list[ModeSpec]:
    """Every transport x exchange x payload of epkit that its tables say runs, named
    ``transport/exchange[/payload]`` (the transport table, production/transports/, says what each
    transport runs: hier its exchanges without a payload; the exchange table,
    epkit.collectives.EXCHANGES, which option is uniform or static; the payload table
    reference/payloads.py). Every mode draws ``ranks_per_node`` (``nodes``), which fixes the
    combine's summation order of every transport and hier's nodes."""
    from epkit import collectives, transports

    modes = []
    for payload, transport, exchange in itertools.product(
            (None, *payloads.NAMES), transports.TABLE.values(), collectives.EXCHANGES.values()):
        if not transport.runs(exchange.name, payload):
            continue
        name = f"{transport.name}/{exchange.name}" + (f"/{payload}" if payload else "")
        kwargs = (("transport", transport.name), ("exchange", exchange.name),
                  ("payload", payload))
        modes.append(ModeSpec(name=name, kwargs=kwargs, payload=payload, uniform=exchange.uniform,
                              static=exchange.static, nodes=True))
    return modes


class EpkitAdapter:
    """epkit's ``dispatch`` / ``combine`` bound to a group and one mode."""

    def __init__(self, group=None, *, transport="dedup", exchange="auto", payload=None,
                 max_tokens_per_rank=None, ranks_per_node=1):
        import epkit

        self._epkit = epkit
        self.group = group
        # ranks_per_node always explicit: epkit's default follows LOCAL_WORLD_SIZE (torchrun),
        # which would make it sum in another order than the reference the case names
        self.options = dict(transport=transport, exchange=exchange, payload=payload,
                            ranks_per_node=ranks_per_node)
        if max_tokens_per_rank is not None:
            self.options["max_tokens_per_rank"] = max_tokens_per_rank

    def dispatch(self, x, topk_idx, topk_weights, *, num_experts, align=1, capacity=None):
        d = self._epkit.dispatch(x, topk_idx, topk_weights, num_experts=num_experts,
                                 group=self.group, align=align, capacity=capacity,
                                 **self.options)
        d = d.wait() if hasattr(d, "wait") and not hasattr(d, "expert_x") else d
        if self.options["exchange"] == "static":
            # On the device path (a GPU, or EPKIT_KERNELS=triton) a static dispatch reads
            # nothing back, so the group's input error stays on the device until asked for:
            # what a static caller does once per step (docs/design.md, "GPU kernels").
            from epkit.device import check_static

            check_static(d)
        return d

    def combine(self, expert_y, dispatched, *, weighted=True):
        out = self._epkit.combine(expert_y, dispatched, weighted=weighted)
        return out.wait() if hasattr(out, "wait") and not hasattr(out, "shape") else out


def epkit_factory(group=None, **options) -> EpkitAdapter:
    """The default ``--impl``: epkit itself, in the mode given by ``options``."""
    return EpkitAdapter(group, **options)


epkit_factory.modes = epkit_modes()
# epkit raises the reference's InputError on every rank: check it on every run; x and
# expert_y are float32 or bfloat16 (float16 is an InputError, as in the reference)
epkit_factory.capabilities = {"check_errors": True, "x_dtypes": ("float32", "bfloat16")}


def plain_torch(group=None, exchange="ragged"):
    """The plain-torch baseline (:mod:`epkit.baselines.plain_torch`), Megatron / torchtitan style;
    ``exchange="padded"`` pads every chunk for a backend without split sizes."""
    from epkit.baselines.plain_torch import PlainTorchDispatcher

    return PlainTorchDispatcher(group, exchange=exchange)


plain_torch.modes = [ModeSpec("ragged"),
                     ModeSpec("padded", kwargs=(("exchange", "padded"),))]


class ImplNotFound(LookupError):
    """``--impl`` names nothing loadable: a usage error (one line, exit status 2)."""


def load_factory(spec: str):
    """``"package.module:name"`` or ``"path/to/file.py:name"`` -> the factory object. Raises
    :class:`ImplNotFound` (one line) when the module, the file or the factory is missing;
    errors raised by the module's own code propagate."""
    mod_name, sep, attr = str(spec).rpartition(":")
    if not sep or not mod_name or not attr:
        raise ImplNotFound(f"--impl wants module:factory or path/file.py:factory, got "
                           f"{spec!r} (no ':factory')")
    if mod_name.endswith(".py") or os.sep in mod_name:
        path = os.path.abspath(mod_name)
        if not os.path.isfile(path):
            raise ImplNotFound(f"--impl {spec}: no file {path}")
        name = "_epkit_verify_impl_" + str(abs(hash(path)))
        module = sys.modules.get(name)
        if module is None:
            s = importlib.util.spec_from_file_location(name, path)
            if s is None or s.loader is None:
                raise ImplNotFound(f"--impl {spec}: cannot load {path} as a Python module")
            module = importlib.util.module_from_spec(s)
            sys.modules[name] = module
            try:
                s.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
    else:
        try:
            module = importlib.import_module(mod_name)
        except ModuleNotFoundError as exc:
            if exc.name and mod_name.startswith(exc.name):  # the module itself, not its import
                raise ImplNotFound(f"--impl {spec}: no module named {mod_name!r}") from None
            raise
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImplNotFound(f"--impl {spec}: {mod_name} has no factory {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ImplNotFound(f"--impl {spec}: {attr!r} is not callable (a factory(group))")
    return obj
