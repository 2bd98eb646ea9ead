"""The all-to-all underneath dispatch and combine, in its variants (semantics: "Exchange").

All variants deliver the same bytes: the concatenation, over source ranks ascending, of the
rows each source addressed to this rank.

- ``ragged``: one ``all_to_all_single`` with split sizes (gloo and NCCL both support them).
- ``padded``: every chunk padded to the group-wide maximum, an equal-length all-to-all, unpad
  (for a backend without split sizes).
- ``equal``: the plan is uniform (every count the same): the split-free all-to-all.

Each is one entry of :data:`VARIANTS` (how it stages rows and reads them back). The lazy
schedule is ``all_to_all(..., async_op=True)``: any variant, issued now, finished later.

:func:`all_to_all` moves a buffer whose counts every rank already knows (the plan gives them);
the public ``epkit.exchange`` (row_exchange.py) builds on it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as _dist_nn_functional

from epkit.reference import abi
from epkit.reference.errors import DTYPE_CODES

from . import workspace


class PeerError(RuntimeError):
    """A collective of an epkit operation failed: a peer died, stalled past the process group's
    timeout, or the group was torn down. The message names the operation and the step."""


def _collective(what: str, fn, *args, **kwargs):
    """Run one torch.distributed collective; turn its failure into a PeerError naming ``what``.

    gloo and NCCL raise after the process group's timeout when a peer never arrives, and at
    once when a peer's connection drops: either way every surviving rank gets an error, not a
    hang. Wait handles of async work are wrapped the same way.
    """
    try:
        work = fn(*args, **kwargs)
    except RuntimeError as exc:
        raise PeerError(f"{what}: collective failed ({_why(exc)})") from exc
    if work is None or not kwargs.get("async_op"):
        return work
    return _Work(work, what)


class _Work:
    def __init__(self, work, what):
        self._work, self._what = work, what

    def wait(self):
        try:
            return self._work.wait()
        except RuntimeError as exc:
            raise PeerError(f"{self._what}: collective failed ({_why(exc)})") from exc


def _why(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"a peer died, stalled past the process group timeout, or left the group: {text}"


CODES = dict(abi.EXCHANGE_CODES)  # the requested exchange's code (reference/abi.py)
_VARIANT_NAMES = {v: k for k, v in abi.VARIANT_CODES.items()}  # the plan's VARIANT word
_VARIANT_WORD = abi.PLAN_FIELDS.index("variant")


def resolve_group(group):
    """``group``, or the default group; a clear error when there is none (raised alone, but
    then no rank has a group to wait in). Something that is not a ProcessGroup resolves to the
    default group too (see :func:`is_group`: the caller reports BAD_GROUP over it)."""
    if group is not None and is_group(group):
        return group
    if _non_member(group):
        # new_group() gives the ranks outside it this marker; such a rank shares no collective
        # with the group's members, so it raises alone, and none of them waits for it.
        raise ValueError(
            f"epkit: rank {dist.get_rank()} is not a member of the group passed to epkit "
            "(torch.distributed.new_group returns GroupMember.NON_GROUP_MEMBER on the ranks "
            "outside it): call epkit only on the group's ranks")
    if not dist.is_initialized():
        raise RuntimeError(
            "epkit: no process group: call torch.distributed.init_process_group(...) first "
            "(under torchrun: init_process_group('gloo') on CPU, 'nccl' or 'cpu:gloo,cuda:nccl' "
            "on GPU; one process alone: init_process_group('gloo', init_method="
            "'tcp://127.0.0.1:29500', rank=0, world_size=1)), or pass group=")
    return dist.group.WORLD


def _unpin_default_group() -> None:
    """Take the default process group out of torch.distributed.nn.functional's default arguments.

    That module writes ``group=group.WORLD`` as a default argument, evaluated once, at its
    import: imported after ``init_process_group`` (torch._dynamo imports it, and an epkit op's
    first call imports torch._dynamo), its ten functions hold the default group for the rest of
    the process. ``destroy_process_group()`` then frees nothing: gloo's threads outlive it, run
    into the interpreter's teardown, and there can abort the process (SIGABRT, ``terminate
    called without an active exception``; docs/usage.md, "Troubleshooting"). ``None`` means the
    default group at call time, the same group while it lives, so it takes the group's place.
    Imported here, before any epkit op runs, so whoever imports the module later finds it so."""
    for fn in vars(_dist_nn_functional).values():
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(isinstance(v, dist.ProcessGroup) for v in defaults):
            fn.__defaults__ = tuple(None if isinstance(v, dist.ProcessGroup) else v
                                    for v in defaults)
        kw = getattr(fn, "__kwdefaults__", None)
        if kw and any(isinstance(v, dist.ProcessGroup) for v in kw.values()):
            fn.__kwdefaults__ = {k: None if isinstance(v, dist.ProcessGroup) else v
                                 for k, v in kw.items()}


_unpin_default_group()


def group_ref(group) -> Callable:
    """``ref()`` gives ``group`` back, or None once it was destroyed.

    A group torch.distributed knows (the default group, ``new_group``'s, a DeviceMesh's) is held
    weakly: epkit's objects (a Dispatcher, the Dispatch it returns, a layer) must not keep a
    group alive past ``destroy_process_group()``, whose gloo threads would then run on into the
    interpreter's teardown (see :func:`_unpin_default_group`). A group torch.distributed does not
    know (one built by hand) has no other owner, so it is held strongly."""
    try:
        known = group in dist.distributed_c10d._world.pg_map
    except Exception:  # noqa: BLE001 - a private map: hold strongly if it moved
        known = False
    if known:
        return weakref.ref(group)
    return lambda: group


def destroyed(what: str) -> RuntimeError:
    return RuntimeError(f"epkit: {what}'s process group was destroyed "
                        "(torch.distributed.destroy_process_group): make a new one for a new group")


def is_group(group) -> bool:
    return group is None or isinstance(group, dist.ProcessGroup)


def _non_member(group) -> bool:
    from torch.distributed.distributed_c10d import GroupMember

    return (isinstance(group, int) and not isinstance(group, bool)
            and group == GroupMember.NON_GROUP_MEMBER and dist.is_initialized())


def group_name(group) -> str:
    return resolve_group(group).group_name


def group_from_name(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, what: str = "epkit") -> None:
    """Gather ``inp [W]`` from every rank into the flat ``out [R * W]`` (gloo wants it flat)."""
    # all_gather_single supersedes all_gather_into_tensor (deprecated in recent torch).
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    _collective(what, fn, out, inp, group=group)


def small_device(group) -> torch.device:
    """Where a small host-side agreement travels: CPU where the group has a CPU backend (gloo,
    or ``cpu:gloo,cuda:nccl``: no device synchronisation), else the current CUDA device (NCCL
    alone, which takes no CPU tensor: reading the words back is then a host wait)."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        _warn_nccl_only(backend)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_WARNED_NCCL_ONLY = False


def _warn_nccl_only(backend: str) -> None:
    """Once per process: an NCCL-only group makes every call header a host wait (docs/design.md,
    "Host reads"), which ``cpu:gloo,cuda:nccl`` avoids."""
    global _WARNED_NCCL_ONLY
    if _WARNED_NCCL_ONLY:
        return
    _WARNED_NCCL_ONLY = True
    import warnings

    warnings.warn(f"epkit: the process group's backend is {backend!r}, with no CPU backend: every "
                  "epkit call's header (dispatch, combine, both backward passes) is then a CUDA "
                  "tensor read on the host, one host wait per call. init_process_group("
                  "'cpu:gloo,cuda:nccl') carries the headers over gloo, and leaves a dispatch "
                  "its one wait and combine and the backward passes none", stacklevel=3)


@dataclass(frozen=True)
class Variant:
    """One exchange variant (reference/exchange.py), a row that the exchange and the ops ask:

    - ``stage(buf, send_counts, recv_counts, max_chunk, alloc)`` -> ``(out, inp, out_splits,
      in_splits)`` (None splits: equal-length chunks; ``out`` from ``alloc``,
      production/workspace.py, or fresh) and ``unstage(out, recv_counts, max_chunk)`` -> the
      received rows: how it runs on ``all_to_all_single``; ``max_chunk`` is the group-wide
      largest count (the padded chunk, the equal count).
    - ``fixed_chunks``: every chunk has one group-wide length (padded, equal, static), so the
      return rows and the slot values travel in chunks of a length the plan gives.
    - ``header_rows``: rows at the front of every chunk that carry its counts in-band (static:
      its chunks are sized by the configuration, so the counts travel with the rows).
    - ``uniform``: every count in the group must be the same (equal).
    - ``packed``: the variant a buffer already laid out in this variant's chunks (pack pads and
      writes the in-band rows) moves as.

    A new variant is one row here and one in the reference's table (reference/exchange.py)."""
    name: str
    stage: Callable
    unstage: Callable
    fixed_chunks: bool = True
    header_rows: int = 0
    uniform: bool = False
    packed: str = "equal"


def _recv_buffer(buf, rows, alloc):
    return workspace.empty(alloc, (rows,) + tuple(buf.shape[1:]), buf.dtype, buf)


def _ragged_stage(buf, send, recv, max_chunk, alloc=None):
    return _recv_buffer(buf, sum(recv), alloc), buf, list(recv), list(send)


def _equal_stage(buf, send, recv, max_chunk, alloc=None):
    return _recv_buffer(buf, len(send) * max_chunk, alloc), buf, None, None


def _padded_stage(buf, send, recv, max_chunk, alloc=None):
    src = buf.new_zeros((len(send) * max_chunk,) + tuple(buf.shape[1:]))
    for d, rows in enumerate(torch.split(buf, list(send))):
        src[d * max_chunk : d * max_chunk + rows.shape[0]] = rows
    return _equal_stage(buf, send, recv, max_chunk, alloc)[0], src, None, None


def _as_is(staged, recv, max_chunk):
    return staged


def _unpad(staged, recv, max_chunk):
    return torch.cat([staged[s * max_chunk : s * max_chunk + n] for s, n in enumerate(recv)])


VARIANTS = {v.name: v for v in (
    Variant("ragged", _ragged_stage, _as_is, fixed_chunks=False, packed="ragged"),
    Variant("padded", _padded_stage, _unpad),
    Variant("equal", _equal_stage, _as_is, uniform=True),
    Variant("static", _equal_stage, _as_is, header_rows=1))}
# The variants a caller may name for epkit.exchange: not those whose counts travel in-band
# (static), which need the plan's fixed chunks.
EXCHANGE_VARIANTS = tuple(name for name, v in VARIANTS.items() if not v.header_rows)


@dataclass(frozen=True)
class Exchange:
    """One ``exchange=`` option of a Dispatcher, as the dispatch path asks it (the variant that
    runs is the plan's, :func:`variant_of`):

    - ``static``: fixed worst-case chunks sized by ``max_tokens_per_rank``, counts in-band: no
      host read of a count, the plan's error deferred on the device path;
    - ``deferred``: issued asynchronously (lazy): dispatch and combine return pending objects;
    - ``uniform``: the plan must be uniform (equal), else EQUAL_NONUNIFORM on every rank;
    - ``lazy_twin``: the option that makes the same pick on the lazy schedule (auto's is lazy,
      reference/exchange.py's ``eager``), what a caller overlapping work with the exchange
      switches to; "" where there is none.
    """
    name: str
    static: bool = False
    deferred: bool = False
    uniform: bool = False
    lazy_twin: str = ""

    @property
    def code(self) -> int:
        return CODES[self.name]


EXCHANGES = {e.name: e for e in (Exchange("auto", lazy_twin="lazy"), Exchange("ragged"), Exchange("padded"),
                                 Exchange("equal", uniform=True), Exchange("lazy", deferred=True),
                                 Exchange("static", static=True))}
assert set(EXCHANGES) == set(CODES), "an exchange option without a row (or without a code)"


def exchange_of(name) -> Exchange | None:
    """The row of exchange option ``name``; None for a name that is not one."""
    try:
        return EXCHANGES.get(name)
    except TypeError:
        return None


def variant_of(plan_words) -> Variant:
    """The row of the variant a plan runs (its VARIANT word; host memory)."""
    return VARIANTS[_VARIANT_NAMES[int(plan_words[_VARIANT_WORD])]]


def all_to_all(
    buf: torch.Tensor,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    group,
    variant: str,
    max_chunk: int,
    async_op: bool = False,
    what: str = "epkit exchange",
    alloc=None,
):
    """Move rows of ``buf [sum(send_counts), ...]``; returns ``[sum(recv_counts), ...]``.

    ``max_chunk`` is the group-wide largest count (the padded chunk, the equal count).
    ``async_op`` is the lazy schedule: returns ``finish``, which waits and returns the rows.
    ``alloc`` (production/workspace.py): where the receive buffer comes from (None: fresh); the
    rows returned may then be a view of it, to be read before the op returns.
    """
    if variant not in VARIANTS:
        raise ValueError(f"epkit: unknown exchange variant {variant!r} (choose from "
                         f"{tuple(VARIANTS)})")
    v, max_chunk = VARIANTS[variant], int(max_chunk)
    staged, src, out_splits, in_splits = v.stage(buf.contiguous(), send_counts, recv_counts,
                                                 max_chunk, alloc)
    splits = {} if out_splits is None else {"output_split_sizes": out_splits,
                                            "input_split_sizes": in_splits}
    work = _collective(what, dist.all_to_all_single, staged, src, group=group,
                       async_op=async_op, **splits)

    def finish() -> torch.Tensor:
        if async_op:
            work.wait()
        return v.unstage(staged, recv_counts, max_chunk)

    return finish if async_op else finish()


def dtype_code(dt) -> int:
    """A torch dtype's code in the call header and the count words (errors.DTYPE_CODES; 0 for
    one outside the table, or not a dtype)."""
    return DTYPE_CODES.get(str(dt).replace("torch.", ""), 0)
