"""Defects the old CUDA kernels had, kept as tests of the Triton kernels that replaced them:
every map entry out of range is skipped (never read or written out of bounds), a received chunk
that disagrees with its plan is an error (never garbage), and MXFP8 keeps a NaN's sign. Run on
CPU tensors in Triton's interpreter here (a read out of bounds would fault the process: each
case runs in a fresh one), against the C++ kernels or a plain Python model of the rule.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import sim
from epkit import ops
from epkit import plan as W

C = ops.C  # the C++ kernels
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def TR():
    return sim.Triton()


def _run_isolated(body: str, timeout=300):
    """Run `body` (Python, with torch, ops, sim, C (C++) and TR (Triton) at hand) in a fresh
    process on the device path (``EPKIT_KERNELS=triton``: CPU tensors are device memory there,
    so the kernels behave as on a GPU: no data-dependent error, entries out of range skipped)."""
    code = "import sys; sys.path.insert(0, %r)\n" % HERE + textwrap.dedent("""
        import torch
        from epkit import ops
        import sim
        C = ops.C
        TR = sim.Triton()
    """) + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=timeout, env=dict(os.environ, EPKIT_KERNELS="triton"))
    assert r.returncode == 0, (r.stdout[-4000:] + r.stderr[-4000:])
    return r.stdout


# ---- indices out of range in the backward and combine kernels: skipped, never followed -------

def test_scatter_slot_values_bounds_every_index():
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
        got = TR.scatter_slot_values(back, smap, idx, first, E, R, 1)
        assert torch.equal(got, want), (got, want)
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
        got = TR.scatter_slot_values(pb, pm, idx, pf, E, R, 0)
        assert torch.equal(got, want)
        # gather_slot_values: values [6], rows whose entries name past values or land past out
        vals = torch.rand(6)
        rm = torch.tensor([[0, 2**40, 1], [5, -1, 6], [2, 3, 4], [-1, -1, -1]])
        fr = torch.tensor([0, 2, 3, -1])
        want = torch.zeros(5)
        for n in range(4):
            at = int(fr[n])
            for c in range(3):
                m = int(rm[n, c])
                if m >= 0:  # a named entry takes its place; one past values writes nothing
                    if m < 6 and 0 <= at < 5:
                        want[at] = vals[m]
                    at += 1
        got = TR.gather_slot_values(vals, rm, fr, 5)
        assert torch.equal(got, want), (got, want)
        print("ok")
    """)


def test_combine_maps_bounded():
    """gather_rows (dedup) with a recv_map row >= expert rows, reduce_tokens with a send_map row
    >= the returned rows: each is skipped like -1 (before: a read far out of bounds)."""
    _run_isolated("""
        y = torch.randn(6, 32)
        w = torch.rand(6)
        rm = torch.tensor([[0, 2**40], [1, -1], [5, 6], [2**41, 3]])
        clean = torch.where((rm >= 0) & (rm < 6), rm, torch.full_like(rm, -1))
        a = TR.gather_rows(y, rm, w, 1, True)
        b = C.gather_rows(y, clean, w, 1, True)
        assert torch.equal(sim.bits(a), sim.bits(b))
        back = torch.randn(4, 32)
        idx = torch.tensor([[0, 3], [1, 2], [3, 0]])
        tw = torch.rand(3, 2)
        for tr, sm in ((1, torch.tensor([[0, 2**40], [1, 3], [9, -1]])),
                       (0, torch.tensor([[0, 2**40], [1, 3], [2, 9]]))):
            clean = torch.where((sm >= 0) & (sm < 4), sm, torch.full_like(sm, -1))
            a = TR.reduce_tokens(back, sm, idx, tw, 4, 2, tr, True, torch.float32)
            b = C.reduce_tokens(back, clean, idx, tw, 4, 2, tr, True, torch.float32)
            assert torch.equal(sim.bits(a), sim.bits(b)), tr
        print("ok")
    """)


# ---- a plan / data mismatch in unpack is an error, never garbage -------------------------------

def _dispatch_one(transport, exchange, K=3):
    case = sim.make_case(1, 4, K, 16, [40], torch.float32, seed=5, unused=0.0)  # K slots a row
    out, _, hps = sim._dispatch(sim.CPP, case, 1, None, transport, exchange, -1, "cpu")
    return out, hps[0], out["plans"][0]


def _slot_section(hp, B):
    """R = 1: byte offset of the dedup slot rows in the (single) chunk."""
    cap, tokcap = int(hp[W.STATIC_CAP]), int(hp[W.TOK_CAP])
    rows = tokcap if tokcap >= 0 else int(hp[W.plan_slices(1, 4)["recv_counts"]][0])
    return rows * B + (8 if cap >= 0 else 0)


def _corruptions():
    P = 16 * 4

    def slot_j(recv, hp):  # one slot names another local expert: expert totals differ
        at = _slot_section(hp, P + 8)
        w = recv[at: at + 4].view(torch.int32)
        w[0] = (w[0] & ~0xFFFFFF) | ((w[0] & 0xFFFFFF) + 1) % 4
        return recv, None

    def row_n(recv, hp):  # a token row announces one slot fewer: slot count differs
        at = ((P + 8) if int(hp[W.STATIC_CAP]) >= 0 else 0) + P + 4  # static: header row
        recv[at: at + 4].view(torch.int32)[0] -= 1  # row 0 has K slots
        return recv, None

    def inband(recv, hp):  # the static chunk's in-band count
        recv[0:8].view(torch.int64)[0] += 1
        return recv, None

    def longer(recv, hp):  # more bytes than the plan says
        return torch.cat([recv, torch.zeros(16, dtype=torch.uint8, device=recv.device)]), None

    def rows(recv, hp):  # expert_rows unlike the plan's
        return recv, int(hp[W.EXPERT_ROWS]) + 4

    return [("dedup", "ragged", slot_j), ("dedup", "ragged", row_n), ("dedup", "static", slot_j),
            ("dedup", "static", inband), ("pairs", "static", inband), ("pairs", "ragged", longer),
            ("dedup", "ragged", rows), ("pairs", "padded", rows)]


@pytest.mark.parametrize("transport,exchange,corrupt", _corruptions(),
                         ids=lambda v: getattr(v, "__name__", v))
def test_unpack_mismatch_raises_as_the_cpp_kernel(TR, transport, exchange, corrupt):
    """On CPU tensors the Triton unpack reads its status word (free there) and raises what the
    C++ unpack raises; a consistent unpack afterwards is untouched."""
    out, hp, plan = _dispatch_one(transport, exchange)
    recv, M = corrupt(out["send"][0].clone(), hp)
    M = int(hp[W.EXPERT_ROWS]) if M is None else M
    N, K = int(hp[W.RECV_ROWS]), 3
    tr = W.TRANSPORTS[transport]
    with pytest.raises(RuntimeError) as cpp:
        C.unpack(recv, plan, tr, 16, torch.float32, K, N, M)
    with pytest.raises(RuntimeError) as tri:
        TR.unpack(recv, plan, tr, 16, torch.float32, K, N, M)
    assert "epkit.unpack" in str(tri.value), (str(cpp.value), str(tri.value))
    got = TR.unpack(out["send"][0], plan, tr, 16, torch.float32, K, N, int(hp[W.EXPERT_ROWS]))
    for a, b in zip(got, (out["expert_x"][0], out["row_src"][0], out["row_weight"][0],
                          out["recv_map"][0])):
        assert torch.equal(sim.bits(a), sim.bits(b))


# ---- quantize_mxfp8 keeps a NaN's sign as the C++ kernel does ----------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_mxfp8_nan_sign(TR, dtype):
    x = torch.linspace(-3, 3, 4 * 64).view(4, 64).to(dtype)
    bits = x.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    pos, neg = (0x7FC0, -0x40) if dtype == torch.bfloat16 else (0x7FC00000, -0x400000)
    bits[0, 3], bits[0, 40], bits[1, 0] = pos, neg, neg  # +NaN, -NaN (0xFFC0.. / 0xFFC00000)
    bits[2, :32] = neg                                    # an all-NaN block: amax 0, code 0
    q_cpu, c_cpu = C.quantize_mxfp8(x)
    q_tri, c_tri = TR.quantize_mxfp8(x)
    qb = q_tri.view(torch.uint8)
    assert int(qb[0, 40]) == 0xFF and int(qb[1, 0]) == 0xFF and int(qb[0, 3]) == 0x7F
    assert torch.equal(q_cpu.view(torch.uint8), qb)
    assert torch.equal(c_cpu, c_tri)
