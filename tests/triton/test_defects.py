"""The CUDA path's defects of issue 12 (items 3-7), one test each; every one fails on the code
before its fix. Kernel calls that read out of bounds before the fix run in a subprocess, so an
illegal address there fails that test and leaves this session's CUDA context alone.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import sim
from epkit import ops

pytestmark = [pytest.mark.cuda, sim.needs_cuda]

C = ops.C
HERE = os.path.dirname(os.path.abspath(__file__))


def _run_isolated(body: str, timeout=240):
    """Run `body` (Python, with torch, ops, C and sim imported) in a fresh process."""
    code = "import sys; sys.path.insert(0, %r)\n" % HERE + textwrap.dedent("""
        import torch
        from epkit import ops
        import sim
        C = ops.C
    """) + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, (r.stdout[-4000:] + r.stderr[-4000:])
    return r.stdout


# ---- item 3: unchecked indices in the backward and combine kernels ---------------------------

def test_scatter_slot_values_bounds_every_index(cuda_ext):
    """dedup: an expert >= E (the CUDA static exchange defers that error and backward still
    runs) read send_map at column e / L, far outside it; pairs / dedup: a send row beyond
    first, a place beyond back; gather_slot_values: a map entry beyond values, a place beyond
    out_rows. Each is skipped (0), never read or written out of bounds."""
    _run_isolated("""
        E, R, T, K = 8, 2, 6, 3
        L = E // R
        idx = torch.tensor([[0, 5, -1], [7, 8, 1], [2**40, 3, 6], [4, -1, -1], [1, 2, 3],
                            [6, 2**40 + 5, 0]])
        back = torch.rand(9)
        first = torch.tensor([0, 2, 4, 8, -1])           # row 3: its second value lies past back
        smap = torch.tensor([[0, 1], [2, -1], [3, 4], [-1, 7], [1, 2**40], [4, 3]])

        def rank(t, k, d):
            return sum(1 for j in range(k) if 0 <= int(idx[t, j]) < E and int(idx[t, j]) // L == d)

        want = torch.zeros(T, K)
        for t in range(T):
            for k in range(K):
                e = int(idx[t, k])
                if 0 <= e < E:
                    r = int(smap[t, e // L])
                    if 0 <= r < first.shape[0] and int(first[r]) >= 0:
                        at = int(first[r]) + rank(t, k, e // L)
                        if at < back.shape[0]:
                            want[t, k] = back[at]
        got = C.scatter_slot_values(back.cuda(), smap.cuda(), idx.cuda(), first.cuda(), E, R, 1)
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), want), (got.cpu(), want)
        # pairs: send_map [T, K], one value per row
        pm = torch.tensor([[0, 1, -1], [2, 2**40, 3], [4, -1, 0], [2**40, -1, -1],
                           [9, -1, -1], [0, 0, 0]])
        pb, pf = torch.rand(5), torch.tensor([0, 1, 2, 7, -1])
        want = torch.zeros(T, K)
        for t in range(T):
            for k in range(K):
                e, r = int(idx[t, k]), int(pm[t, k])
                if 0 <= e < E and 0 <= r < 5 and 0 <= int(pf[r]) < 5:
                    want[t, k] = pb[int(pf[r])]
        got = C.scatter_slot_values(pb.cuda(), pm.cuda(), idx.cuda(), pf.cuda(), E, R, 0)
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), want)
        # gather_slot_values: values [6], rows whose entries name past values or land past out
        vals = torch.rand(6)
        rm = torch.tensor([[0, 2**40, 1], [5, -1, 6], [2, 3, 4], [-1, -1, -1]])
        fr = torch.tensor([0, 2, 3, -1])
        want = torch.zeros(5)
        for n in range(4):
            at = int(fr[n])
            for c in range(3):
                m = int(rm[n, c])
                if 0 <= m < 6:
                    if 0 <= at < 5:
                        want[at] = vals[m]
                    at += 1
        got = C.gather_slot_values(vals.cuda(), rm.cuda(), fr.cuda(), 5)
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), want), (got.cpu(), want)
        print("ok")
    """)


def test_combine_maps_bounded(cuda_ext):
    """gather_rows (dedup) with a recv_map row >= expert rows, reduce_tokens with a send_map row
    >= the returned rows: each is skipped like -1 (before: a read far out of bounds)."""
    _run_isolated("""
        y = torch.randn(6, 32)
        w = torch.rand(6)
        rm = torch.tensor([[0, 2**40], [1, -1], [5, 6], [2**41, 3]])
        clean = torch.where((rm >= 0) & (rm < 6), rm, torch.full_like(rm, -1))
        a = C.gather_rows(y.cuda(), rm.cuda(), w.cuda(), 1, True).cpu()
        b = C.gather_rows(y, clean, w, 1, True)
        assert torch.equal(sim.bits(a), sim.bits(b))
        back = torch.randn(4, 32)
        idx = torch.tensor([[0, 3], [1, 2], [3, 0]])
        tw = torch.rand(3, 2)
        for tr, sm in ((1, torch.tensor([[0, 2**40], [1, 3], [9, -1]])),
                       (0, torch.tensor([[0, 2**40], [1, 3], [2, 9]]))):
            clean = torch.where((sm >= 0) & (sm < 4), sm, torch.full_like(sm, -1))
            a = C.reduce_tokens(back.cuda(), sm.cuda(), idx.cuda(), tw.cuda(), 4, 2, tr, True,
                                torch.float32).cpu()
            b = C.reduce_tokens(back, clean, idx, tw, 4, 2, tr, True, torch.float32)
            assert torch.equal(sim.bits(a), sim.bits(b)), tr
        print("ok")
    """)


# ---- item 4: a plan / data mismatch in unpack is a deferred error, never garbage --------------

def _dirty_allocator(sizes):
    """Leave 0xFF bytes in the caching allocator's free blocks of these sizes, so an output
    that a kernel forgets to write shows up (at::empty reuses them)."""
    junk = [torch.full((max(n // 8, 1),), -1, dtype=torch.int64, device="cuda")
            for n in sizes for _ in range(2)]
    del junk


def _dispatch_one(transport, exchange, K=3):
    case = sim.make_case(1, 4, K, 16, [40], torch.float32, seed=5, unused=0.0)  # K slots a row
    out, _, hps = sim._dispatch(case, 1, None, transport, exchange, -1, "cuda")
    return out, hps[0], out["plans"][0]


def _slot_section(hp, B):
    """R = 1: byte offset of the dedup slot rows in the (single) chunk."""
    cap, tokcap = int(hp[ops.STATIC_CAP]), int(hp[ops.TOK_CAP])
    rows = tokcap if tokcap >= 0 else int(hp[ops.plan_slices(1, 4)["recv_counts"]][0])
    return rows * B + (8 if cap >= 0 else 0)


def _corruptions():
    P = 16 * 4

    def slot_j(recv, hp):  # one slot names another local expert: expert totals differ
        at = _slot_section(hp, P + 8)
        w = recv[at: at + 4].view(torch.int32)
        w[0] = (w[0] & ~0xFFFFFF) | ((w[0] & 0xFFFFFF) + 1) % 4
        return recv, None

    def row_n(recv, hp):  # a token row announces one slot fewer: slot count differs
        at = ((P + 8) if int(hp[ops.STATIC_CAP]) >= 0 else 0) + P + 4  # static: header row
        recv[at: at + 4].view(torch.int32)[0] -= 1  # row 0 has K slots
        return recv, None

    def inband(recv, hp):  # the static chunk's in-band count
        recv[0:8].view(torch.int64)[0] += 1
        return recv, None

    def longer(recv, hp):  # more bytes than the plan says
        return torch.cat([recv, torch.zeros(16, dtype=torch.uint8, device=recv.device)]), None

    def rows(recv, hp):  # expert_rows unlike the plan's
        return recv, int(hp[ops.EXPERT_ROWS]) + 4

    return [("dedup", "ragged", slot_j), ("dedup", "ragged", row_n), ("dedup", "static", slot_j),
            ("dedup", "static", inband), ("pairs", "static", inband), ("pairs", "ragged", longer),
            ("dedup", "ragged", rows), ("pairs", "padded", rows)]


@pytest.mark.parametrize("transport,exchange,corrupt", _corruptions(),
                         ids=lambda v: getattr(v, "__name__", v))
def test_unpack_mismatch_is_zero_filled_and_deferred(cuda_ext, monkeypatch, transport, exchange,
                                                     corrupt):
    from epkit.device import UnpackMismatch, check_static, unpack_status

    monkeypatch.delenv("EPKIT_CUDA_CHECKS", raising=False)  # the deferred path (gpu_check sets it)

    assert unpack_status() == 0
    out, hp, plan = _dispatch_one(transport, exchange)
    recv, M = corrupt(out["send"][0].clone(), hp)
    M = int(hp[ops.EXPERT_ROWS]) if M is None else M
    N, K = int(hp[ops.RECV_ROWS]), 3
    tr = ops.TRANSPORTS[transport]
    _dirty_allocator([M * 16 * 4, M * 24, M * 4, N * K * 8])
    ex, rs, rw, rm = C.unpack(recv, plan, tr, 16, torch.float32, K, N, M)
    torch.cuda.synchronize()
    assert not bool(ex.view(torch.int32).any()), "expert_x not zero-filled"
    assert bool((rs == -1).all()) and not bool(rw.view(torch.int32).any())
    assert bool((rm == -1).all())
    with pytest.raises(UnpackMismatch):
        check_static(plan)
    assert unpack_status() == 0  # check_static cleared it
    # a consistent unpack afterwards is untouched and sets nothing
    ex2, *_ = C.unpack(out["send"][0], plan, tr, 16, torch.float32, K, N,
                       int(hp[ops.EXPERT_ROWS]))
    assert torch.equal(sim.bits(ex2), sim.bits(out["expert_x"][0])) and unpack_status() == 0


def test_unpack_mismatch_raises_under_checks(cuda_ext, monkeypatch):
    from epkit.device import unpack_status

    out, hp, plan = _dispatch_one("dedup", "ragged")
    monkeypatch.setenv("EPKIT_CUDA_CHECKS", "1")
    with pytest.raises(RuntimeError, match="disagree with the plan"):
        C.unpack(out["send"][0], plan, 1, 16, torch.float32, 3, int(hp[ops.RECV_ROWS]),
                 int(hp[ops.EXPERT_ROWS]) + 1)
    assert unpack_status() != 0  # the sticky word has it too; read and cleared here


# ---- item 6: unpack's scratch has stride L, not E + 3R ----------------------------------------

def test_unpack_scratch_stride_l(cuda_ext):
    """R = 1, L = 512, 65536 received rows (1024 index chunks): the old jbase alone was
    chunks * (n - 25) / 2 words (5.3 MB); the whole scratch now stays below it."""
    R, L, K, H, T = 1, 512, 1, 8, 65536
    E = R * L
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, generator=g)
    idx = torch.randint(0, E, (T, K), device=dev, generator=g)
    w = torch.rand(T, K, device=dev, generator=g)
    words = C.prepare(x, idx, w, E, R, [0, 0, 0, 1, -1], 0).view(1, -1)
    plan = C.plan(words, 0, E, 1, -1, 1, 0, -1)
    hp = plan.cpu()
    send, _ = C.pack(x, idx, w, plan, 1, R, int(hp[ops.SEND_BYTES]))
    N, M = int(hp[ops.RECV_ROWS]), int(hp[ops.EXPERT_ROWS])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    outs = C.unpack(send, plan, 1, H, torch.float32, K, N, M)
    torch.cuda.synchronize()
    scratch = torch.cuda.max_memory_allocated() - before - sum(
        t.numel() * t.element_size() for t in outs)
    old_jbase = -(-N // 64) * ((plan.numel() - 25) // 2) * 4
    assert scratch < old_jbase, (scratch, old_jbase)
    cpu = C.unpack(send.cpu(), hp, 1, H, torch.float32, K, N, M)
    for a, b in zip(cpu, outs):
        assert torch.equal(sim.bits(a), sim.bits(b.cpu()))


# ---- item 7: quantize_mxfp8 keeps a NaN's sign as the CPU does ---------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_mxfp8_nan_sign(cuda_ext, dtype):
    x = torch.linspace(-3, 3, 4 * 64).view(4, 64).to(dtype)
    bits = x.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    pos, neg = (0x7FC0, -0x40) if dtype == torch.bfloat16 else (0x7FC00000, -0x400000)
    bits[0, 3], bits[0, 40], bits[1, 0] = pos, neg, neg  # +NaN, -NaN (0xFFC0.. / 0xFFC00000)
    bits[2, :32] = neg                                    # an all-NaN block: amax 0, code 0
    q_cpu, c_cpu = C.quantize_mxfp8(x)
    q_gpu, c_gpu = C.quantize_mxfp8(x.cuda())
    qb = q_gpu.cpu().view(torch.uint8)
    assert int(qb[0, 40]) == 0xFF and int(qb[1, 0]) == 0xFF and int(qb[0, 3]) == 0x7F
    assert torch.equal(q_cpu.view(torch.uint8), qb)
    assert torch.equal(c_cpu, c_gpu.cpu())
