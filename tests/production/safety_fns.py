"""Rank functions for test_collective_safety.py: one rank misuses epkit, then a valid round.

Each misuse function returns ``(err, out)``: ``err`` is ``(rank, code, message)`` of the
InputError this rank raised (None if it raised nothing), ``out`` the combine output of the valid
dispatch + combine that follows on the same group (NumPy), which the test compares with the
reference bit for bit.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
import torch.distributed as dist

import epkit
from rank_fns import to_numpy, to_torch

E_PER_RANK = 2


def valid_inputs(rank: int, R: int, seed: int = 0):
    """The valid round's inputs of ``rank`` (the test rebuilds them for the reference)."""
    rng = np.random.default_rng(seed + rank)
    E = E_PER_RANK * R
    T, H, K = 6, 32, 2
    x = rng.standard_normal((T, H)).astype(np.float32)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(T)])
    idx[0, 1] = -1
    w = rng.random((T, K)).astype(np.float32)
    return x, idx, w


def valid_round(group, rank, **opts):
    R = dist.get_world_size(group)
    x, idx, w = valid_inputs(rank, R)
    d = epkit.dispatch(to_torch(x), to_torch(idx), to_torch(w), num_experts=E_PER_RANK * R,
                       group=group, **opts)
    out = epkit.combine(d.expert_x * 2.0, d)
    # expert_x and row_src too: the combine output alone depends only on this rank's tokens,
    # so it would match even when the ranks paired the wrong calls
    return to_numpy(out), to_numpy(d.expert_x), to_numpy(d.row_src)


def _caught(fn):
    try:
        fn()
    except epkit.InputError as exc:
        return exc.rank, int(exc.code), str(exc)
    return None


def _inputs(rank, R):
    x, idx, w = valid_inputs(rank, R, seed=100)
    return to_torch(x), to_torch(idx), to_torch(w)


def bad_dispatch(group, rank, faulty, kind):
    """``faulty`` passes a bad argument or option of ``kind`` to dispatch; the others pass
    valid ones."""
    R = dist.get_world_size(group)
    x, idx, w = _inputs(rank, R)
    opts = dict(num_experts=E_PER_RANK * R)
    if rank == faulty:
        if kind == "typo_transport":
            opts["transport"] = "dedupe"
        elif kind == "typo_exchange":
            opts["exchange"] = "raggedy"
        elif kind == "meta_x":
            x = torch.empty(x.shape, device="meta")
        elif kind == "meta_idx":
            idx = torch.empty(idx.shape, dtype=torch.int64, device="meta")
        elif kind == "list_x":
            x = x.tolist()
        elif kind == "numpy_w":
            w = w.numpy()
        elif kind == "none_idx":
            idx = None
        elif kind == "small_negative_experts":
            opts["num_experts"] = -R - 3
        elif kind == "negative_experts":
            opts["num_experts"] = -100
        elif kind == "float_experts":
            opts["num_experts"] = 4.0
        elif kind == "other_experts":
            opts["num_experts"] = 2 * E_PER_RANK * R
        elif kind == "other_align":
            opts["align"] = 4
        elif kind == "huge_align":
            opts["align"] = 1 << 46
        elif kind == "other_capacity":
            opts["capacity"] = 2
        elif kind == "other_transport":
            opts["transport"] = "pairs"
        elif kind == "other_exchange":
            opts["exchange"] = "padded"
        elif kind == "other_payload":
            opts["payload"] = "mxfp8"
        elif kind == "capacity_and_factor":
            opts.update(capacity=2, capacity_factor=1.0)
        elif kind == "zero_factor":
            opts["capacity_factor"] = 0.0
        elif kind == "other_factor":
            opts["capacity_factor"] = 1.5
        elif kind == "align_2pow64":  # does not fit int64: the header must still be reached
            opts["align"] = 1 << 64
        elif kind == "experts_2pow64":
            opts["num_experts"] = 1 << 64
        elif kind == "factor_overflow":
            opts["capacity_factor"] = 10 ** 400
        elif kind == "group_string":
            opts["group"] = "world"
        elif kind == "uint16_index":
            idx = idx.to(torch.uint16)
        elif kind == "other_ranks_per_node":  # the others: one node of R ranks
            opts["ranks_per_node"] = 1
        elif kind == "zero_ranks_per_node":
            opts["ranks_per_node"] = 0
        elif kind == "hier_lazy":
            opts.update(transport="hier", exchange="lazy")
    if kind == "other_ranks_per_node":
        opts.setdefault("ranks_per_node", R)
    if kind == "hier_lazy":
        opts.setdefault("transport", "hier")
    if kind == "other_max_tokens":
        opts.update(exchange="static", max_tokens_per_rank=8 if rank == faulty else 16)
    if kind == "other_factor":
        opts.setdefault("capacity_factor", 1.25)
    if kind == "too_many_local_experts":  # on every rank: j travels in 24 bits
        opts["num_experts"] = R * (1 << 24)
    opts.setdefault("group", group)
    err = _caught(lambda: epkit.dispatch(x, idx, w, **opts))
    return err, valid_round(group, rank)


def bad_combine(group, rank, faulty, kind):
    """A valid dispatch, then ``faulty`` misuses combine (or skips it) in the way ``kind`` says."""
    R = dist.get_world_size(group)
    x, idx, w = _inputs(rank, R)
    disp = epkit.Dispatcher(group, E_PER_RANK * R)
    d = disp.dispatch(x, idx, w)
    y = d.expert_x * 2.0

    def call():
        if rank != faulty:
            if kind == "other_dispatch":  # the others combine the newer one
                d2 = disp.dispatch(x, idx, w)
                return disp.combine(d2.expert_x, d2)
            return disp.combine(y, d)
        if kind == "dispatch_instead":  # skips combine, goes on to the next dispatch
            return disp.dispatch(x, idx, w)
        if kind == "short_expert_x":  # replaced by a shorter tensor; y made to match it
            d.expert_x = d.expert_x[:-1]
            return disp.combine(d.expert_x * 2.0, d)
        if kind == "short_row_weight":
            d.row_weight = d.row_weight[:-1]
            return disp.combine(y, d)
        if kind == "foreign_group":
            d.handle.group_name = "another-group"
            return disp.combine(y, d)
        if kind == "not_a_dispatch":
            return disp.combine(y, None)
        if kind == "top_level_none":  # epkit.combine: refused over the default group
            return epkit.combine(y, None)
        if kind == "weighted_unreadable":
            return disp.combine(y, d, weighted=torch.tensor([]))
        if kind == "replaced_plan":
            d.handle.plan = d.handle.plan.clone()
            return disp.combine(y, d)
        if kind == "replaced_plan_host":
            d.handle.plan_host = d.handle.plan_host.clone()
            return disp.combine(y, d)
        if kind == "plan_host_written":  # in place: the words combine sizes its exchange from
            d.handle.plan_host.add_(0)
            return disp.combine(y, d)
        if kind == "recv_map_written":
            d.handle.recv_map.add_(0)  # in place: the version counter moves
            return disp.combine(y, d)
        if kind == "list_y":
            return disp.combine(y.tolist(), d)
        if kind == "other_dispatch":
            disp.dispatch(x, idx, w)  # a newer one exists, but this rank combines the first
            return disp.combine(y, d)
        raise AssertionError(kind)

    return _caught(call), valid_round(group, rank)


def bad_exchange(group, rank, faulty, kind):
    R = dist.get_world_size(group)
    x = torch.arange(3 * R * 2, dtype=torch.float32).view(3 * R, 2)
    counts, variant = [3] * R, "ragged"
    if rank == faulty:
        if kind == "short_counts":
            counts = counts[:-1]
        elif kind == "sum":
            counts = [3] * (R - 1) + [2]
        elif kind == "negative":
            counts = [4] * (R - 1) + [3 - (R - 1)] if R > 1 else [-1]
            counts[-1] = -1
        elif kind == "width":
            x = torch.zeros(3 * R, 3)
        elif kind == "dtype":
            x = x.double()
        elif kind == "meta_counts":
            counts = torch.empty(R, dtype=torch.int64, device="meta")
        elif kind == "variant_list":
            variant = ["ragged"]
    err = _caught(lambda: epkit.exchange(x, counts, group=group, variant=variant))
    good = epkit.exchange(torch.full((R, 2), float(rank)), [1] * R, group=group)
    return err, to_numpy(good)


def two_threads(group, rank, rounds):
    """Two threads share one Dispatcher, each running ``rounds`` dispatch + combine of the
    same inputs. Calls on a group are serialised per process; where the threads interleave
    differently on different ranks, the call header turns the mismatch into a collective
    InputError. Returns (other exceptions, InputError count, outputs of successful rounds)."""
    R = dist.get_world_size(group)
    x, idx, w = (to_torch(a) for a in valid_inputs(rank, R))
    disp = epkit.Dispatcher(group, E_PER_RANK * R)
    outs, errors, refused = [], [], []

    def work():
        for _ in range(rounds):
            try:
                try:  # both calls are always made, so every rank makes the same number
                    d = disp.dispatch(x, idx, w)
                except epkit.InputError as exc:
                    refused.append(int(exc.code))
                    d = None
                try:
                    outs.append(to_numpy(disp.combine(d.expert_x * 2.0 if d else x, d)))
                except epkit.InputError as exc:
                    refused.append(int(exc.code))
            except BaseException as exc:  # noqa: BLE001 - reported to the test
                errors.append(repr(exc))

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors, sorted(refused), outs


def skip_backward(group, rank, faulty):
    """Every rank runs dispatch + combine with gradients; ``faulty`` skips ``backward()`` and
    goes on to its next dispatch while the others run the backward passes."""
    R = dist.get_world_size(group)
    x, idx, w = _inputs(rank, R)
    x.requires_grad_(True)
    d = epkit.dispatch(x, idx, w, num_experts=E_PER_RANK * R, group=group)
    out = epkit.combine(d.expert_x * 2.0, d)
    if rank == faulty:
        err = _caught(lambda: epkit.dispatch(x.detach(), idx, w, num_experts=E_PER_RANK * R,
                                             group=group))
    else:
        err = _caught(lambda: out.sum().backward())
    return err, valid_round(group, rank)


def flags_differ(group, rank, faulty, kind):
    """``unweighted``: ``faulty`` combines unweighted, the others weighted."""
    R = dist.get_world_size(group)
    x, idx, w = _inputs(rank, R)
    d = epkit.dispatch(x, idx, w, num_experts=E_PER_RANK * R, group=group)
    err = _caught(lambda: epkit.combine(d.expert_x * 2.0, d, weighted=rank != faulty))
    return err, valid_round(group, rank)


def pending_to_combine(group, rank, faulty):
    """Every rank dispatches lazily; ``faulty`` hands the PendingDispatch itself to combine
    (forgetting ``wait()``), the others wait and combine."""
    R = dist.get_world_size(group)
    x, idx, w = _inputs(rank, R)
    lazy = epkit.Dispatcher(group, E_PER_RANK * R, exchange="lazy")
    pending = lazy.dispatch(x, idx, w)
    if rank == faulty:
        err = _caught(lambda: lazy.combine(x, pending))
        pending.wait()
    else:
        d = pending.wait()
        err = _caught(lambda: lazy.combine(d.expert_x * 2.0, d).wait())
    return err, valid_round(group, rank)
