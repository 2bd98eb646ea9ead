"""Functions run on every rank of the test group (see group.py): NumPy in, NumPy out."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

import epkit

BF16 = ml_dtypes.bfloat16


def to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == BF16:
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)  # exact widening back
    return torch.from_numpy(np.ascontiguousarray(a))


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(BF16)
    return t.numpy().copy()


def forward_backward(group, rank, x, idx, w, grad_out, opts):
    """dispatch -> y = where(padding, NaN, expert_x * 2) in y_dtype -> combine -> backward."""
    xt = to_torch(x).requires_grad_(True)
    wt = to_torch(w).requires_grad_(True)
    idx_t = to_torch(idx)
    d = epkit.dispatch(xt, idx_t, wt, num_experts=opts["E"], group=group, align=opts["align"],
                       capacity=opts["capacity"], transport=opts["transport"],
                       exchange=opts["exchange"],
                       max_tokens_per_rank=opts.get("max_tokens_per_rank"),
                       capacity_factor=opts.get("capacity_factor"),
                       ranks_per_node=opts.get("ranks_per_node"))
    if opts["exchange"] == "lazy":
        assert not hasattr(d, "expert_x")  # nothing to read before wait()
        d = d.wait()
    ydt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[opts["y_dtype"]]
    pad = (d.row_src[:, 0] < 0).unsqueeze(1)
    y = torch.where(pad, torch.tensor(float("nan")), d.expert_x.float() * 2.0).to(ydt)
    out = epkit.combine(y, d, weighted=opts["weighted"])
    if opts["exchange"] == "lazy":
        out = out.wait()
    out.backward(to_torch(grad_out).to(out.dtype))
    return {
        "expert_x": to_numpy(d.expert_x), "tokens_per_expert": to_numpy(d.tokens_per_expert),
        "expert_offsets": to_numpy(d.expert_offsets), "row_src": to_numpy(d.row_src),
        "row_weight": to_numpy(d.row_weight), "dropped_per_expert": to_numpy(d.dropped_per_expert),
        "bytes_sent": to_numpy(d.bytes_sent), "out": to_numpy(out),
        "grad_x": to_numpy(xt.grad), "grad_w": to_numpy(wt.grad),
    }


def weight_grad_bytes(group, rank, x, idx, w, grad_out, opts):
    """forward_backward, returning the bytes this rank sent each peer in the weight gradients'
    exchange ([R] int64, as handed to all_to_all_single: splits, or equal chunks)."""
    import math

    from epkit import collectives

    seen, orig = [], collectives._collective

    def spy(what, fn, *args, **kw):
        if "weight gradients" in what:
            inp, R = args[1], torch.distributed.get_world_size(group)
            row = inp.element_size() * math.prod(inp.shape[1:])
            splits = kw.get("input_split_sizes")
            seen.append([n * row for n in splits] if splits is not None else
                        [inp.numel() * inp.element_size() // R] * R)
        return orig(what, fn, *args, **kw)

    collectives._collective = spy
    try:
        forward_backward(group, rank, x, idx, w, grad_out, opts)
    finally:
        collectives._collective = orig
    assert len(seen) == 1, seen
    return np.array(seen[0], np.int64)


def dispatch_only(group, rank, x, idx, w, opts):
    d = epkit.dispatch(to_torch(x), to_torch(idx), to_torch(w), group=group, **opts)
    return to_numpy(d.expert_x), to_numpy(d.bytes_sent)


def raises_input_error(group, rank, x, idx, w, opts):
    """Returns the InputError's (rank, code, message) or None, then proves the group usable."""
    try:
        epkit.dispatch(to_torch(x), to_torch(idx), to_torch(w), group=group, **opts)
        got = None
    except epkit.InputError as exc:
        got = (exc.rank, int(exc.code), str(exc))
    R = torch.distributed.get_world_size(group)
    E = R * 2
    ok = epkit.dispatch(torch.ones(2, 4), torch.tensor([[0, E - 1], [1, -1]]), torch.ones(2, 2),
                        num_experts=E, group=group)
    return got, int(ok.tokens_per_expert.sum())


def opcheck_all(group, rank):
    """torch.library.opcheck on every epkit op, with arguments taken from a real dispatch."""
    from epkit import agree, moves, ops, payloads, workspace  # noqa: F401 (payloads: its ops)
    from epkit import plan as planw
    from epkit.collectives import group_name

    C = torch.ops.epkit
    gname = group_name(group)
    torch.manual_seed(0)
    T, H, K, E = 5, 4, 2, 4
    x = torch.randn(T, H)
    idx = torch.tensor([[0, 3], [1, -1], [2, 0], [3, 1], [-1, -1]])
    w = torch.rand(T, K)
    checked = []
    for transport in (planw.PAIRS, planw.DEDUP):
        words = C.prepare(x, idx, w, E, 1, [0, 0, 0, 1], 0)
        plan, hp = ops.count_exchange(words, gname, 0, E, 2, -1, transport, 0, -1)
        SB, S, N, M = hp[[planw.SEND_BYTES, planw.SEND_ROWS, planw.RECV_ROWS,
                            planw.EXPERT_ROWS]].tolist()
        send, send_map = C.pack(x, idx, w, plan, transport, 1, SB)
        ex, src, rw, recv_map = C.unpack(send, plan, transport, H, x.dtype, K, N, M)
        y = torch.randn(M, H)
        back = C.gather_rows(y, recv_map, rw, transport, True)
        u = (recv_map >= 0).sum(1)  # the weight gradients' places (R = 1, ragged)
        first = (torch.arange(N) if transport == planw.PAIRS else
                 torch.where(u > 0, torch.cumsum(u, 0) - u, -1))
        slots = N if transport == planw.PAIRS else int(u.sum())
        vals = C.gather_slot_values(rw, recv_map, first, slots)
        # the return path's units (dedup: min(n, per) per token row, compact; pairs: a row each)
        un = u.clamp(max=4 // y.element_size())
        ufirst = (None if transport == planw.PAIRS
                  else torch.where(un > 0, torch.cumsum(un, 0) - un, -1))
        units = torch.empty((N if transport == planw.PAIRS else int(un.sum()), H))
        ws = workspace.Workspace()  # the ops' workspace key: buffers reused from call to call
        calls = [
            (C.layout, (idx, E, 1)),
            (C.prepare, (x, idx, w, E, 1, [0, 0, 0, 1], 0)),
            (C.plan, (words.view(1, -1), 0, E, 2, -1, transport, 0, -1)),
            (C.plan, (words.view(1, -1), 0, E, 2, -1, transport, 1, -1)),
            (C.plan, (words.view(1, -1), 0, E, 2, -1, transport, 5, T)),
            (C.pack, (x, idx, w, plan, transport, 1, SB)),
            (C.pack, (x, idx, w, plan, transport, 1, SB, hp)),
            (C.unpack, (send, plan, transport, H, x.dtype, K, N, M)),
            (C.unpack, (send, plan, transport, H, x.dtype, K, N, M, hp)),
            (C.gather_rows, (y, recv_map, rw, transport, True)),
            (C.reduce_tokens, (back, send_map, idx, w, E, 1, transport, True, x.dtype)),
            (C.gather_units, (y, recv_map, rw, transport, True, ufirst, units)),
            (C.pack_into, (x, idx, w, plan, transport, 1, torch.empty(SB, dtype=torch.uint8))),
            (C.pack_into, (x, idx, w, plan, transport, 1, torch.empty(SB, dtype=torch.uint8), hp)),
            (C.scatter_rows_into, (x, send_map, torch.empty((S, H)))),

            (C.scatter_rows, (x, send_map, S)),
            (C.combine_backward_dest, (send_rows_like(x, send_map, S), recv_map, rw, y, True)),
            (C.gather_slot_values, (rw, recv_map, first, slots)),
            (C.quantize_mxfp8, (torch.randn(3, 64),)),
            (C.quantize_mxfp8, (torch.randn(2, 32).to(torch.bfloat16),)),
            (C.quantize_fp8_block128, (torch.randn(3, 256),)),
            (C.quantize_fp8_block128, (torch.randn(2, 128).to(torch.bfloat16),)),
            (C.quantize_rows, (torch.randn(3, 64), "mxfp8")),
            (C.quantize_rows, (torch.randn(2, 128).to(torch.bfloat16), "fp8_block128")),
            # a single row too: its slices are contiguous views, which the op must not return
            (C.dequantize_rows, (C.quantize_rows(torch.randn(1, 64), "mxfp8"), 64, "mxfp8")),
            (C.dequantize_rows, (C.quantize_rows(torch.randn(3, 128), "fp8_block128"), 128,
                                 "fp8_block128")),
            (C.dispatch_counts, (plan, 1, E)),
            (C.scatter_slot_values, (vals, send_map, idx, first, E, 1, transport)),
            (C.count_exchange, (words, gname, 0, E, 2, -1, transport, 0, -1)),
            (C.prepare_dispatch, (x.detach().requires_grad_(True), idx, w.detach().requires_grad_(True),
                                  gname, 0, E, 2, -1, transport, 0, [0, 0, 0, 1], 0)),
            (C.dispatch_tokens, (x.requires_grad_(True), idx, w.requires_grad_(True), plan, hp,
                                 gname, transport, SB, N, M)),
            (C.combine_tokens, (y.requires_grad_(True), rw.requires_grad_(True), idx, w.detach(),
                                send_map, recv_map, plan, hp, gname, transport, True, x.dtype,
                                agree.header(agree.COMBINE, [E, 2, -1, transport, 0, 0, -1],
                                             (0, 0, 0), 1, 0))),
            (C.dispatch_tokens_backward, (ex.detach(), rw.detach(), send_map, recv_map, idx, plan,
                                          hp, gname, transport, x.dtype)),
            (C.combine_tokens_backward, (x.detach(), y.detach(), rw.detach(), send_map, recv_map,
                                         plan, hp, gname, True)),
        ]
        if transport == planw.DEDUP:  # the units read in place
            C.gather_units(y, recv_map, rw, transport, True, ufirst, units)
            S_rows = int(send_map.max()) + 1
            calls.append((C.reduce_tokens, (units, send_map, moves.kept_routing(idx, plan, hp), w,
                                            E, 1,
                                            transport, True, x.dtype, 1,
                                            first_of_rows(send_map, idx, S_rows, un))))
        calls += [  # the collective ops with a workspace
            (C.dispatch_tokens, (x.detach().requires_grad_(True), idx, w.detach().requires_grad_(True),
                                 plan, hp, gname, transport, SB, N, M, ws.key)),
            (C.combine_tokens_backward, (x.detach(), y.detach(), rw.detach(), send_map, recv_map,
                                         plan, hp, gname, True, ws.key)),
            (C.dispatch_tokens_backward, (ex.detach(), rw.detach(), send_map, recv_map, idx, plan,
                                          hp, gname, transport, x.dtype, ws.key)),
        ]
        for op, args in calls:
            torch.library.opcheck(op, args)
            checked.append(str(op))
        # a fresh buffer's bytes are undefined, so its eager and traced outputs differ: every
        # check but the output comparison
        torch.library.opcheck(C.empty_large, (x, [3, 5], torch.bfloat16),
                              test_utils=("test_schema", "test_autograd_registration",
                                          "test_faketensor"))
        checked.append(str(C.empty_large))
        x, w = x.detach(), w.detach()
    return sorted(set(checked))


def first_of_rows(send_map, idx, S, un):
    """R = 1: send row r is token r's row, its units where the expert side put them (recv row
    r is send row r, so the same compact places)."""
    return torch.where(un[:S] > 0, torch.cumsum(un[:S], 0) - un[:S], -1)


def send_rows_like(x, send_map, S):
    return torch.ops.epkit.scatter_rows(x, send_map, S)


def compile_step(group, rank, backend, exchange, capture_scalars):
    """A training step dispatch -> expert matmul -> combine -> backward, eager vs compiled
    with fullgraph=True; returns (forward equal, every gradient equal) bitwise."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.config.capture_scalar_outputs = capture_scalars
    R = torch.distributed.get_world_size(group)
    E, T, H = 2 * R, 6, 8
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g)
    W = torch.randn(H, H, generator=torch.Generator().manual_seed(0))
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    idx[0, 1] = -1
    w = torch.rand(T, 2, generator=g)

    def step(x, idx, w, W):
        d = epkit.dispatch(x, idx, w, num_experts=E, group=group, exchange=exchange,
                           max_tokens_per_rank=T if exchange == "static" else None)
        y = d.expert_x @ W
        return epkit.combine(y, d)

    def run(fn):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, W)]
        out = fn(leaves[0], idx, leaves[1], leaves[2])
        out.square().sum().backward()
        return out.detach(), [t.grad for t in leaves]

    out_e, grads_e = run(step)
    out_c, grads_c = run(torch.compile(step, fullgraph=True, backend=backend))
    return torch.equal(out_e, out_c), all(torch.equal(a, b) for a, b in zip(grads_e, grads_c))


def quantized_forward_backward(group, rank, x, idx, w, grad_out, opts):
    """Dispatch under ``opts["payload"]`` (mxfp8, fp8_block128) -> y = expert_x_hp * 2 (float32)
    -> combine -> backward."""
    xt = to_torch(x).requires_grad_(True)
    wt = to_torch(w).requires_grad_(True)
    d = epkit.dispatch(xt, to_torch(idx), wt, num_experts=opts["E"], group=group,
                       align=opts["align"], capacity=opts["capacity"], payload=opts["payload"],
                       transport=opts["transport"], exchange=opts["exchange"],
                       max_tokens_per_rank=opts.get("max_tokens_per_rank"))
    lazy = opts["exchange"] == "lazy"
    d = d.wait() if lazy else d
    assert d.expert_x.dtype == torch.float8_e4m3fn and d.expert_x_hp.dtype == torch.float32
    out = epkit.combine(d.expert_x_hp * 2.0, d, weighted=opts["weighted"])
    out = out.wait() if lazy else out
    out.backward(to_torch(grad_out).to(out.dtype))
    M = int(d.expert_offsets[-1])
    return {"q": d.expert_x.view(torch.uint8)[:M].numpy().copy(),
            "scale": d.expert_scale[:M].numpy().copy(), "row_src": to_numpy(d.row_src)[:M],
            "hp": to_numpy(d.expert_x_hp.detach())[:M],
            "out": to_numpy(out), "grad_x": to_numpy(xt.grad), "grad_w": to_numpy(wt.grad)}


def combine_with_bad_expert_y(group, rank, x, idx, w, kind):
    """Dispatch, then combine an expert_y spoiled as ``kind`` says (on this rank only);
    returns the InputError's (rank, code, message) and whether a valid combine succeeds after."""
    d = epkit.dispatch(to_torch(x), to_torch(idx), to_torch(w), num_experts=2 * torch.distributed.get_world_size(group),
                       group=group)
    y = d.expert_x.clone()
    if kind == "rows":
        y = torch.cat([y, y[:1] if len(y) else torch.zeros(1, y.shape[1])])
    elif kind == "hidden":
        y = torch.zeros(y.shape[0], y.shape[1] + 1)
    elif kind == "dtype":
        y = y.to(torch.float16)
    elif kind == "mixed":
        y = y.to(torch.bfloat16)
    try:
        epkit.combine(y, d)
        got = None
    except epkit.InputError as exc:
        got = (exc.rank, int(exc.code), str(exc))
    out = epkit.combine(d.expert_x.clone(), d)
    return got, tuple(out.shape)


def resolved_ranks_per_node(group, rank, env_values):
    """Dispatcher(ranks_per_node=None).resolved_ranks_per_node() under each LOCAL_WORLD_SIZE."""
    import os

    out = []
    for v in env_values:
        old = os.environ.pop("LOCAL_WORLD_SIZE", None)
        if v is not None:
            os.environ["LOCAL_WORLD_SIZE"] = v
        try:
            out.append(epkit.Dispatcher(group, 8).resolved_ranks_per_node())
        finally:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
            if old is not None:
                os.environ["LOCAL_WORLD_SIZE"] = old
    return out


def non_member_error(group, rank):
    """What epkit says to a rank that passes the marker new_group() gives ranks outside a group
    (GroupMember.NON_GROUP_MEMBER): the message, or None if it did not raise."""
    import epkit
    from torch.distributed.distributed_c10d import GroupMember

    x, idx = torch.ones(2, 4), torch.tensor([[0, 1], [1, -1]])
    try:
        epkit.dispatch(x, idx, torch.ones(2, 2), num_experts=2,
                       group=GroupMember.NON_GROUP_MEMBER)
    except ValueError as exc:
        return str(exc)
    return None


def options_round_trip(group, rank):
    """Dispatcher(**keywords) and Dispatcher.from_options(record) hold the same record and give
    the same dispatch bit for bit; their option attributes are read-only views of the record."""
    E = 4 * torch.distributed.get_world_size(group)
    torch.manual_seed(rank)
    x, idx = torch.randn(6, 8), torch.stack([torch.randperm(E)[:2] for _ in range(6)])
    w = torch.rand(6, 2)
    kw = dict(align=4, capacity=3, transport="pairs", exchange="padded")
    a = epkit.Dispatcher(group, E, **kw)
    b = epkit.Dispatcher.from_options(group, E, epkit.DispatchOptions(**kw))
    if a.options != b.options or a.align != 4 or b.transport != "pairs":
        return f"records differ: {a.options} {b.options}"
    try:
        a.align = 8
        return "an option attribute could be set"
    except AttributeError:
        pass
    da, db = a.dispatch(x, idx, w), b.dispatch(x, idx, w)
    dc = epkit.dispatch(x, idx, w, num_experts=E, group=group, **kw)
    for d in (db, dc):
        if not (torch.equal(da.expert_x, d.expert_x) and torch.equal(da.row_src, d.row_src)):
            return "dispatches differ"
    return "ok"
