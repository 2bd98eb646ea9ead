"""epkit.triton.unpack against the C++ CPU unpack, bit for bit (expert_x, row_src, row_weight,
recv_map), fed by the C++ pack's buffers and by the Triton pack's; the status word's cases:
received chunks that disagree with the plan (the C++ kernel raises; the Triton one raises on
CPU and, in its deferred form, writes every output as "nothing received")."""


import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from epkit import plan as W
from epkit.reference import abi
from epkit.triton import pack as tp
from epkit.triton import unpack as tu
from epkit.triton import wirechecks as wc
from wire_cases import check_launches, make_group


@pytest.fixture(autouse=True)
def _one_writer_per_byte():
    remove = check_launches()
    yield
    remove()

EXCHANGES = ("ragged", "padded", "equal", "static")
TRANSPORTS = ("pairs", "dedup")


def bits_of(t):
    return t.contiguous().view(torch.uint8) if t.dtype.is_floating_point else t


def unpack_args(g, d, recv, width, dtype):
    return (recv, g.plans[d], g.transport, width, dtype, g.K, g.word(d, "RECV_ROWS"),
            g.word(d, "EXPERT_ROWS"))


def check_group(cpp, g):
    """Each rank's unpack of the C++ pack's chunks equals the C++ unpack; the Triton pack's
    chunks give the same; no status bit is set."""
    rows = g.rows[0]
    width, dtype = rows.shape[1], rows.dtype
    sends = [cpp.pack(g.rows[r], g.idxs[r], g.ws[r], g.plans[r], g.transport, g.R,
                      g.word(r, "SEND_BYTES"))[0] for r in range(g.R)]
    tsends = [tp.pack(g.rows[r], g.idxs[r], g.ws[r], g.plans[r], g.transport, g.R,
                      g.word(r, "SEND_BYTES"))[0] for r in range(g.R)]
    for d, (recv, trecv) in enumerate(zip(g.recv(sends), g.recv(tsends))):
        want = cpp.unpack(*unpack_args(g, d, recv, width, dtype))
        got, status = tu.unpack_with_status(*unpack_args(g, d, recv, width, dtype))
        assert int(status) == 0, tu.describe(int(status))
        for name, a, b in zip(("expert_x", "row_src", "row_weight", "recv_map"), got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, (d, name)
            assert torch.equal(bits_of(a), bits_of(b)), (d, name)
        for a, b in zip(tu.unpack(*unpack_args(g, d, trecv, width, dtype)), want):
            assert torch.equal(bits_of(a), bits_of(b)), d


@pytest.mark.parametrize("payload", [None, "mxfp8", "fp8_block128"])
@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_unpack_variants_payloads(cpp, transport, exchange, payload):
    H = 128 if payload else 11  # 11 bfloat16: rows of 22 bytes, moved as bytes
    Ts = [6, 6, 6] if exchange == "equal" else [5, 0, 7]
    g = make_group(cpp, 3, 2, 3, Ts, H, transport, exchange, payload=payload, seed=4,
                   unused=0.0 if exchange == "equal" else 0.25, align=1 if payload else 4)
    check_group(cpp, g)


@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_unpack_capacity_drops(cpp, transport, exchange):
    g = make_group(cpp, 3, 2, 3, [6, 4, 7], 8, transport, exchange, capacity=2, hot=True,
                   align=4, seed=5, dtype=torch.float32)
    check_group(cpp, g)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_unpack_wide_topk(cpp, transport):
    g = make_group(cpp, 2, 66, 130, [4, 3], 4, transport, "static", seed=7, unused=0.1)
    check_group(cpp, g)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("R,Ts", [(1, [2]), (2, [0, 3])])
def test_unpack_topk_zero_padded_rows(cpp, transport, R, Ts):
    """Fixed example (found by test_unpack_property, issue 33): top-k 0 under the static
    exchange with align 2 has no slot at all, yet expert rows of padding (and static header
    rows) exist; the Triton unpack indexed the empty slot tables for them (IndexError) where the
    C++ unpack writes padding."""
    g = make_group(cpp, R, 1, 0, Ts, 1, transport, "static", seed=0, align=2)
    assert g.word(0, "EXPERT_ROWS") > 0 and g.word(0, "RECV_ROWS") > 0
    check_group(cpp, g)


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(R=st.integers(1, 3), L=st.integers(1, 3), K=st.integers(0, 4), H=st.integers(1, 9),
       transport=st.sampled_from(TRANSPORTS), exchange=st.sampled_from(("ragged", "padded",
                                                                       "static")),
       capacity=st.sampled_from([None, 0, 1, 3]), align=st.integers(1, 3),
       seed=st.integers(0, 1000), Tmax=st.integers(0, 6))
def test_unpack_property(cpp, R, L, K, H, transport, exchange, capacity, align, seed, Tmax):
    K = min(K, R * L)
    Ts = [(seed + 5 * r) % (Tmax + 1) for r in range(R)]
    g = make_group(cpp, R, L, K, Ts, H, transport, exchange, capacity=capacity, seed=seed,
                   hot=capacity is not None, align=align)
    check_group(cpp, g)


# ---- the status word: chunks that disagree with the plan ---------------------------------------

def _slot_section(g, d, B):
    """Byte offset of the first slot row of the chunk from rank 0 in rank d's buffer."""
    cap, tokcap = g.word(d, "STATIC_CAP"), g.word(d, "TOK_CAP")
    rows = tokcap if tokcap >= 0 else g.section(d, "recv_counts")[0]
    return rows * B + (abi.SLOT_ROW_BYTES if cap >= 0 else 0)


def _i32(recv, at):
    return recv[at: at + 4].view(torch.int32)


def slot_j(recv, g, d, P):  # a slot names another local expert: the experts' totals differ
    w = _i32(recv, _slot_section(g, d, P + 8))
    w[0] = (w[0] & ~0xFFFFFF) | ((w[0] & 0xFFFFFF) + 1) % 2
    return wc.ST_EXPERT_TOTAL


def slot_k_range(recv, g, d, P):  # a slot names k = topk
    w = _i32(recv, _slot_section(g, d, P + 8))
    w[0] = (w[0] & 0xFFFFFF) | (g.K << abi.SLOT_K_SHIFT)
    return wc.ST_SLOT_ROW


def repeat_k(recv, g, d, P):  # the second slot of a two-slot token row repeats the first's k
    B, hdr = P + 8, 1 if g.word(d, "STATIC_CAP") >= 0 else 0
    sec, first = _slot_section(g, d, B), 0
    for i in range(g.section(d, "recv_counts")[0]):
        n = int(_i32(recv, (hdr + i) * B + P + 4)[0])
        if n >= 2:
            a, b = _i32(recv, sec + 8 * first), _i32(recv, sec + 8 * first + 8)
            b[0] = (a[0] & ~0xFFFFFF) | (b[0] & 0xFFFFFF)
            return wc.ST_EXPERT_ROW
        first += n
    raise AssertionError("no token row with two slots")


def row_n(recv, g, d, P):  # the first token row announces one slot fewer
    hdr = 1 if g.word(d, "STATIC_CAP") >= 0 else 0
    _i32(recv, hdr * (P + 8) + P + 4)[0] -= 1
    return wc.ST_SLOTS


def inband(recv, g, d, P):  # the static chunk's in-band count
    recv[0:8].view(torch.int64)[0] += 1
    return wc.ST_INBAND


def inband_slots(recv, g, d, P):  # the static slot section's in-band count
    at = _slot_section(g, d, P + 8) - 8
    recv[at: at + 8].view(torch.int64)[0] += 1
    return wc.ST_SLOTS


CORRUPTIONS = [("dedup", "ragged", slot_j), ("dedup", "static", slot_j),
               ("dedup", "ragged", slot_k_range), ("dedup", "padded", repeat_k),
               ("dedup", "ragged", row_n), ("dedup", "static", inband),
               ("dedup", "static", inband_slots), ("pairs", "static", inband)]


def _group(cpp, transport, exchange):
    g = make_group(cpp, 2, 2, 3, [6, 5], 8, transport, exchange, seed=9, unused=0.0,
                   dtype=torch.float32)
    sends = [cpp.pack(g.rows[r], g.idxs[r], g.ws[r], g.plans[r], g.transport, 2,
                      g.word(r, "SEND_BYTES"))[0] for r in range(2)]
    return g, g.recv(sends)


def _assert_nothing_received(out):
    ex, rs, rw, rm = out
    assert not bool(ex.view(torch.uint8).any()), "expert_x not zero-filled"
    assert bool((rs == -1).all()) and not bool(rw.view(torch.int32).any())
    assert bool((rm == -1).all())


@pytest.mark.parametrize("transport,exchange,corrupt", CORRUPTIONS,
                         ids=lambda v: getattr(v, "__name__", v))
def test_unpack_mismatch(cpp, transport, exchange, corrupt):
    """The C++ unpack raises; the Triton unpack raises on CPU, and its deferred form sets the
    corruption's bit and writes every output as "nothing received"."""
    g, recvs = _group(cpp, transport, exchange)
    recv = recvs[0].clone()
    bit = corrupt(recv, g, 0, 32)
    args = unpack_args(g, 0, recv, 8, torch.float32)
    with pytest.raises(RuntimeError, match="epkit.unpack"):
        cpp.unpack(*args)
    with pytest.raises(RuntimeError, match="epkit.unpack: the received chunks disagree"):
        tu.unpack(*args)
    out, status = tu.unpack_with_status(*args)
    assert int(status) & bit, (int(status), bit)
    _assert_nothing_received(out)
    # the clean buffer afterwards: no bit (no false positive), the C++ outputs
    out, status = tu.unpack_with_status(*unpack_args(g, 0, recvs[0], 8, torch.float32))
    assert int(status) == 0
    for a, b in zip(out, cpp.unpack(*unpack_args(g, 0, recvs[0], 8, torch.float32))):
        assert torch.equal(bits_of(a), bits_of(b))


def test_unpack_mismatch_pairs_plan(cpp):
    """pairs: the plan's kept blocks (recv_kept) do not cover the rows received."""
    g, recvs = _group(cpp, "pairs", "ragged")
    plan = g.plans[0].clone()
    plan[W.plan_slices(2, 4)["recv_kept"].start] += 1
    args = (recvs[0], plan, 0, 8, torch.float32, 3, g.word(0, "RECV_ROWS"),
            g.word(0, "EXPERT_ROWS"))
    with pytest.raises(RuntimeError, match="epkit.unpack"):
        cpp.unpack(*args)
    with pytest.raises(RuntimeError, match="disagree"):
        tu.unpack(*args)
    out, status = tu.unpack_with_status(*args)
    assert int(status) & wc.ST_ROWS
    _assert_nothing_received(out)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_unpack_erroneous_device_plan(cpp, transport):
    """A static plan carrying an error on the device (its host mirror does not): nothing is
    received and no status bit is set (check_static raises the plan's error)."""
    g, recvs = _group(cpp, transport, "static")
    mirror, plan = g.plans[0].clone(), g.plans[0].clone()
    plan[W.ERR_CODE] = 20
    out, status = tu.unpack_with_status(recvs[0], plan, g.transport, 8, torch.float32, 3,
                                        g.word(0, "RECV_ROWS"), g.word(0, "EXPERT_ROWS"), mirror)
    assert int(status) == 0
    _assert_nothing_received(out)


def test_status_word_is_one_per_device():
    w = tu.status_word("cpu")
    assert w.dtype == torch.int32 and w.shape == (1,) and w is tu.status_word(torch.device("cpu"))


def test_status_bits_are_ored_not_added():
    """Two failed checks of one kind set their bit once: added, two ST_SHAPE bits (32 + 32)
    would read as ST_EXPERT_TOTAL (64), another failure."""
    from epkit.triton.wirechecks import status_bit, status_of

    yes, no = torch.tensor([True]), torch.tensor([False])
    bits = [status_bit(yes, wc.ST_SHAPE), status_bit(yes, wc.ST_SHAPE), status_bit(no, wc.ST_ROWS),
            status_bit(yes, wc.ST_INBAND)]
    assert int(status_of(bits)) == wc.ST_SHAPE | wc.ST_INBAND
    assert int(status_of(bits)) & wc.ST_EXPERT_TOTAL == 0
