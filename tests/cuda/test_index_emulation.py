"""The CUDA kernels' index arithmetic (emulate.py, a step-by-step transcription) against the CPU
kernels' send_map / recv_map. Runs without a GPU: it checks the algorithm (chunked counting
sorts, closed forms, the static row space), not the device code, which test_kernels.py checks
on a GPU."""

import numpy as np
import pytest
import torch

import emulate
import sim
from epkit import ops

CASES = [(1, 4, 2, [5]), (3, 2, 3, [40, 9, 1]), (4, 8, 8, [150, 70, 3, 0]), (2, 24, 40, [70, 3]),
         (5, 1, 5, [66] * 5)]  # (R, L, K, tokens per rank): chunks, K > 32, L = 1, T = 0
# Wide top-k (issue 12): the slot word's k >= 128 is a negative int32 (k must be decoded
# unsigned), several warp passes per row; the documented limit K = 255.
WIDE = [(1, 256, 129, [3]), (2, 128, 200, [2, 1]), (1, 255, 255, [2]), (4, 64, 255, [1, 0, 1, 1])]


def _check(R, L, K, Ts, transport, exchange, capacity, align):
    case = sim.make_case(R, L, K, 8, Ts, torch.float32, seed=R + K, hot=True)
    E = case[0]
    out, _, hps = sim._dispatch(case, align, capacity, transport, exchange, -1, "cpu")
    pairs = transport == "pairs"
    for r in range(R):
        got = emulate.pack_send_map(case[2][r].numpy(), hps[r].numpy(), R, E, pairs)
        assert np.array_equal(got, out["send_map"][r].numpy()), ("send_map", r)
    sizes = [hps[s][sim.SL(R, E)["send_bytes"]].tolist() for s in range(R)]
    for d in range(R):
        recv = torch.cat([sim._chunks(out["send"][s], sizes[s])[d] for s in range(R)])
        got = emulate.unpack_recv_map(recv.numpy(), hps[d].numpy(), K, 8 * 4, pairs)
        assert np.array_equal(got, out["recv_map"][d].numpy()), ("recv_map", d)


@pytest.mark.parametrize("R,L,K,Ts", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("transport", ["pairs", "dedup"])
@pytest.mark.parametrize("exchange,capacity,align", [("ragged", None, 1), ("static", 2, 4),
                                                     ("padded", 3, 2)])
def test_index_passes_match_cpu(R, L, K, Ts, transport, exchange, capacity, align):
    _check(R, L, K, Ts, transport, exchange, capacity, align)


@pytest.mark.parametrize("R,L,K,Ts", WIDE, ids=lambda v: str(v))
@pytest.mark.parametrize("transport", ["dedup", "pairs"])
@pytest.mark.parametrize("exchange,capacity,align", [("ragged", None, 1), ("static", 1, 4)])
def test_index_passes_wide_topk(R, L, K, Ts, transport, exchange, capacity, align):
    """K = 129..255: unpack's dedup ranks decode k unsigned (an arithmetic shift gave k - 256)."""
    _check(R, L, K, Ts, transport, exchange, capacity, align)


@pytest.mark.parametrize("R", range(1, 65))
def test_local_experts_bound(R):
    """The host's bound on L from the plan's length (unpack's scratch: jbase [chunks + 1, L]
    with stride L) holds for every (R, L), is exact at R = 1, and is below the old stride
    Eb = (n - 25) / 2 (issue 12, item 6)."""
    from epkit import ops

    for L in (1, 2, 3, 7, 8, 32, 255, 256):
        n = ops.plan_size(R, R * L)
        b = emulate.local_experts_bound(n)
        assert L <= b <= (n - 25) // 2, (R, L, b)
        if R == 1:
            assert b == L


@pytest.mark.parametrize("exchange,capacity", [("ragged", None), ("static", 2)])
def test_unpack_checks_catch_a_moved_slot(exchange, capacity):
    """unpack.cu's deferred checks, emulated: a slot word naming another local expert leaves
    that expert's total unlike the plan's tokens_per_expert (expert_total_kernel: status 64,
    then every output zero-filled), where the old passes left a row unwritten."""
    R, L, K = 1, 4, 3
    case = sim.make_case(R, L, K, 8, [20], torch.float32, seed=3, hot=True)
    out, _, hps = sim._dispatch(case, 1, capacity, "dedup", exchange, -1, "cpu")
    hp = hps[0].numpy()
    recv = out["send"][0].numpy().copy()
    emulate.unpack_recv_map(recv, hp, K, 8 * 4, False)  # consistent: no check fires
    B, cap = 8 * 4 + 8, int(hp[ops.STATIC_CAP])
    rows = int(hp[ops.TOK_CAP]) if int(hp[ops.TOK_CAP]) >= 0 else int(
        hp[ops.plan_slices(R, L)["recv_counts"]][0])
    at = rows * B + (8 if cap >= 0 else 0)  # the first slot row
    w = recv[at: at + 4].view(np.int32)
    w[0] = (w[0] & ~0xFFFFFF) | ((w[0] & 0xFFFFFF) + 1) % L
    with pytest.raises(AssertionError, match="expert totals"):
        emulate.unpack_recv_map(recv, hp, K, 8 * 4, False)
