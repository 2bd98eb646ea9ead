"""The CUDA kernels' index arithmetic (emulate.py, a step-by-step transcription) against the CPU
kernels' send_map / recv_map. Runs without a GPU: it checks the algorithm (chunked counting
sorts, closed forms, the static row space), not the device code, which test_kernels.py checks
on a GPU."""

import numpy as np
import pytest
import torch

import emulate
import sim

CASES = [(1, 4, 2, [5]), (3, 2, 3, [40, 9, 1]), (4, 8, 8, [150, 70, 3, 0]), (2, 24, 40, [70, 3]),
         (5, 1, 5, [66] * 5)]  # (R, L, K, tokens per rank): chunks, K > 32, L = 1, T = 0


@pytest.mark.parametrize("R,L,K,Ts", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("transport", ["pairs", "dedup"])
@pytest.mark.parametrize("exchange,capacity,align", [("ragged", None, 1), ("static", 2, 4),
                                                     ("padded", 3, 2)])
def test_index_passes_match_cpu(R, L, K, Ts, transport, exchange, capacity, align):
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
