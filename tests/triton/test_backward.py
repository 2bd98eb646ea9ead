"""epkit.triton.backward (combine_backward_dest, gather_slot_values, scatter_slot_values)
against the C++ kernels, bit for bit (integer views), in Triton's interpreter: the weight
gradient in the C++ kernel's 16-lane order included."""

import numpy as np
import pytest
import torch

from test_combine import DTYPES, same, source_side, special

from epkit.triton import backward as tb

PAIRS, DEDUP = 0, 1
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def random_map(rng, N, C, M, used):
    """recv_map [N, C]: `used` distinct rows of M named once each, the rest -1."""
    rmap = np.full(N * C, -1, np.int64)
    rmap[rng.choice(N * C, used, replace=False)] = rng.choice(M, used, replace=False)
    return torch.from_numpy(rmap.reshape(N, C))


# ---- combine_backward_dest --------------------------------------------------------------------
@pytest.mark.parametrize("gdtype", DTYPES)
@pytest.mark.parametrize("ydtype", DTYPES)
@pytest.mark.parametrize("H", [1, 16, 37, 300])
def test_combine_backward_dest(cpp, gdtype, ydtype, H):
    rng = np.random.default_rng(H)
    N, C, M = 9, 3, 70  # 70 rows: two programs of the interpreter's 64; 50 used, 20 padding
    rmap = random_map(rng, N, C, M, 20)
    y = special(rng, (M, H), ydtype, finite=True)
    w = torch.from_numpy(rng.random(M).astype(np.float32))
    for finite in (True, False):  # every bit class (NaN payloads, inf, subnormal, ties) too
        g = special(rng, (N, H), gdtype, finite)
        for weighted in (True, False):
            got = tb.combine_backward_dest(g, rmap, w, y, weighted)
            want = cpp.combine_backward_dest(g, rmap, w, y, weighted)
            assert same(got[0], want[0]) and same(got[1], want[1]), (finite, weighted)


def test_combine_backward_dest_zero_rows(cpp):
    for M, N, H in [(0, 0, 8), (0, 3, 8), (5, 0, 3), (4, 2, 0)]:
        rmap = torch.full((N, 2), -1, dtype=torch.int64)
        args = (torch.ones(N, H), rmap, torch.ones(M), torch.ones(M, H), True)
        got, want = tb.combine_backward_dest(*args), cpp.combine_backward_dest(*args)
        assert same(got[0], want[0]) and same(got[1], want[1])


def test_combine_backward_dest_refuses_what_cpp_refuses(cpp):
    cases = [((torch.ones(2, 4), torch.tensor([[0, 1], [1, -1]]), torch.ones(3),
               torch.ones(3, 4), True), "entries 1 and 2 both name row 1"),
             ((torch.ones(2, 4), torch.tensor([[0, 7], [1, 1]]), torch.ones(3),
               torch.ones(3, 4), True), r"recv_map entry 1 is 7, outside \[-1, 3\)"),
             ((torch.ones(2, 4), torch.tensor([[0, 1], [-2, -1]]), torch.ones(3),
               torch.ones(3, 4), False), r"entry 2 is -2"),
             ((torch.ones(2, 5), torch.tensor([[0, 1], [2, -1]]), torch.ones(3),
               torch.ones(3, 4), True), "hidden of expert_y"),
             ((torch.ones(2, 4), torch.tensor([[0, 1], [2, -1]]), torch.ones(2),
               torch.ones(3, 4), True), "row_weight")]
    for args, match in cases:
        for impl in (cpp, tb):
            with pytest.raises(RuntimeError, match=match):
                impl.combine_backward_dest(*args)


def test_combine_backward_dest_past_2_31_bytes(cpp):
    """recv of 2**31 bytes and more (torch.empty, only the used rows written): the gradient rows
    read from past the int32 range are the ones the C++ kernel reads."""
    rng = np.random.default_rng(3)
    N, H = (1 << 19) + 8, 1030  # float32 rows of 4120 bytes
    recv = torch.empty((N, H))
    assert recv.numel() * 4 > 2**31
    recv[N - 4:] = special(rng, (4, H), torch.float32, finite=True)
    rmap = torch.full((N, 2), -1, dtype=torch.int64)
    rmap[N - 4:] = torch.tensor([[0, 3], [-1, 1], [4, -1], [2, 6]])
    y = special(rng, (8, H), torch.bfloat16, finite=True)
    w = torch.from_numpy(rng.random(8).astype(np.float32))
    got, want = tb.combine_backward_dest(recv, rmap, w, y, True), \
        cpp.combine_backward_dest(recv, rmap, w, y, True)
    assert same(got[0], want[0]) and same(got[1], want[1])
