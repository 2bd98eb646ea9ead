"""epkit.triton.pack (pack, pack_into, scatter_rows, scatter_rows_into) against the C++ CPU
kernels, byte for byte: whole send buffers (every variant's chunks, in-band counts and gaps
included), send maps, scattered rows; argument errors of the same kind; byte offsets past
2**31."""


import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from epkit import plan as W
from epkit.triton import byterows
from epkit.triton import pack as tp
from wire_cases import check_launches, make_group


@pytest.fixture(autouse=True)
def _one_writer_per_byte():
    remove = check_launches()
    yield
    remove()

EXCHANGES = ("ragged", "padded", "equal", "static")
TRANSPORTS = ("pairs", "dedup")


def _garbage(n, dtype=torch.uint8):
    """A buffer whose every byte is 0xAB: a byte the kernel forgets to write shows."""
    return torch.full((n,), 0xAB, dtype=torch.uint8).view(dtype)


def check_group(cpp, g):
    """Every rank's pack and pack_into (into garbage) equal the C++ pack, whole buffers."""
    for r in range(g.R):
        SB = g.word(r, "SEND_BYTES")
        args = (g.rows[r], g.idxs[r], g.ws[r], g.plans[r], g.transport, g.R)
        send, smap = cpp.pack(*args, SB)
        got, gmap = tp.pack(*args, SB)
        assert got.dtype == torch.uint8 and got.shape == send.shape
        assert torch.equal(got, send), f"rank {r}: bytes {(got != send).nonzero()[:8].tolist()}"
        assert torch.equal(gmap, smap), f"rank {r}: send_map"
        buf = _garbage(SB)
        assert torch.equal(tp.pack_into(*args, buf), smap)
        assert torch.equal(buf, send), f"rank {r}: pack_into left bytes unwritten"


@pytest.mark.parametrize("payload", [None, "mxfp8", "fp8_block128"])
@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pack_variants_payloads(cpp, transport, exchange, payload):
    """A zero-token rank, unused slots, every exchange variant, every payload's wire rows."""
    H = 128 if payload else 11  # 11 bfloat16: rows of 22 bytes, moved as bytes
    Ts = [6, 6, 6] if exchange == "equal" else [5, 0, 7]
    g = make_group(cpp, 3, 2, 3, Ts, H, transport, exchange, payload=payload, seed=3,
                   unused=0.0 if exchange == "equal" else 0.25)
    check_group(cpp, g)


@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pack_capacity_drops(cpp, transport, exchange):
    """Expert 0 in every row and a capacity of 2: slots dropped on every rank (dedup: token
    rows whose slots on a rank were all dropped do not travel)."""
    g = make_group(cpp, 3, 2, 3, [6, 4, 7], 8, transport, exchange, capacity=2, hot=True,
                   align=4, seed=5)
    assert sum(g.section(r, "dropped")[0] for r in range(3)) > 0  # drops happened
    check_group(cpp, g)


@pytest.mark.parametrize("exchange", ("ragged", "static"))
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pack_wide_topk(cpp, transport, exchange):
    """K = 130 (dedup's k in the slot word's top 8 bits: k >= 128 sets its sign bit)."""
    g = make_group(cpp, 2, 66, 130, [4, 3], 4, transport, exchange, seed=7, unused=0.1)
    check_group(cpp, g)


def test_pack_int32_routing_and_one_rank(cpp):
    for tr in TRANSPORTS:
        check_group(cpp, make_group(cpp, 1, 4, 2, [9], 6, tr, "ragged", seed=2,
                                    idx_dtype=torch.int32, dtype=torch.float32))


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(R=st.integers(1, 3), L=st.integers(1, 3), K=st.integers(0, 4), H=st.integers(1, 9),
       transport=st.sampled_from(TRANSPORTS), exchange=st.sampled_from(("ragged", "padded",
                                                                       "static")),
       capacity=st.sampled_from([None, 0, 1, 3]), seed=st.integers(0, 1000),
       Tmax=st.integers(0, 6))
def test_pack_property(cpp, R, L, K, H, transport, exchange, capacity, seed, Tmax):
    K = min(K, R * L)
    Ts = [(seed + 3 * r) % (Tmax + 1) for r in range(R)]
    g = make_group(cpp, R, L, K, Ts, H, transport, exchange, capacity=capacity, seed=seed,
                   hot=capacity is not None)
    check_group(cpp, g)


def test_pack_erroneous_device_plan_sends_nothing(cpp):
    """A static plan carrying an error on the device (its host mirror, a routing-free
    template, does not): the whole buffer zeros, send_map -1, as the CUDA path did."""
    for tr in TRANSPORTS:
        g = make_group(cpp, 2, 2, 2, [4, 3], 8, tr, "static", seed=1)
        plan = g.plans[0].clone()
        mirror = g.plans[0].clone()
        plan[W.ERR_CODE] = 20
        SB = g.word(0, "SEND_BYTES")
        send, smap = tp.pack(g.rows[0], g.idxs[0], g.ws[0], plan, g.transport, 2, SB, mirror)
        assert not bool(send.any()) and bool((smap == -1).all())
        buf = _garbage(SB)
        tp.pack_into(g.rows[0], g.idxs[0], g.ws[0], plan, g.transport, 2, buf, mirror)
        assert not bool(buf.any())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8,
                                   torch.float8_e4m3fn])
def test_scatter_rows(cpp, dtype):
    gen = torch.Generator().manual_seed(11)
    T, C, H, S = 9, 3, 5, 30
    src = torch.randint(0, 256, (T, H * torch.empty((), dtype=dtype).element_size()),
                        generator=gen, dtype=torch.uint8).view(dtype)
    m = torch.full((T * C,), -1, dtype=torch.int64)
    used = torch.randperm(T * C, generator=gen)[:14]
    m[used] = torch.randperm(S, generator=gen)[:14]
    m = m.view(T, C)
    want = cpp.scatter_rows(src, m, S)
    got = tp.scatter_rows(src, m, S)
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    out = _garbage(S * H * src.element_size()).view(dtype).view(S, H)
    tp.scatter_rows_into(src, m, out)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
    assert tp.scatter_rows(src, torch.full_like(m, -1), 0).shape == (0, H)
    empty = tp.scatter_rows(src[:0], m[:0], 4)
    want = cpp.scatter_rows(src[:0], m[:0], 4)
    assert torch.equal(empty.view(torch.uint8), want.view(torch.uint8))


def test_offsets_past_2_31(cpp):
    """x of 2**31 + bytes from torch.empty (pages never touched but the few rows routed):
    pack and scatter_rows read rows past byte 2**31 exactly as the C++ kernels do; the row
    writer writes rows past byte 2**31 of its output."""
    H = 4096
    P = 2 * H
    T = (1 << 31) // P + 64
    x = torch.empty((T, H), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    tail = [T - 1, T - 7, T - 40]
    for t in tail:
        x[t] = torch.randn(H, generator=g).to(torch.bfloat16)
    idx = torch.full((T, 1), -1, dtype=torch.int64)
    idx[tail, 0] = torch.tensor([1, 0, 1])
    w = torch.ones(T, 1)
    for tr in (W.PAIRS, W.DEDUP):
        words = cpp.prepare(x, idx, w, 2, 1, [0, 0, 0, 2, -1], 0).view(1, -1)
        plan = cpp.plan(words, 0, 2, 1, -1, tr, 0, -1)
        SB = int(plan[W.SEND_BYTES])
        send, smap = cpp.pack(x, idx, w, plan, tr, 1, SB)
        got, gmap = tp.pack(x, idx, w, plan, tr, 1, SB)
        assert torch.equal(got, send) and torch.equal(gmap, smap)
    m = torch.full((T, 1), -1, dtype=torch.int64)
    m[tail, 0] = torch.tensor([2, 0, 1])
    want = cpp.scatter_rows(x, m, 3)
    assert torch.equal(tp.scatter_rows(x, m, 3).view(torch.int16), want.view(torch.int16))
    assert want.view(torch.int16).any()
    # The writer: three rows at byte offsets past 2**31 of a buffer never touched elsewhere.
    out = torch.empty(((1 << 31) + 3 * P,), dtype=torch.uint8)
    at = torch.tensor([(1 << 31) + 2 * P, (1 << 31), (1 << 31) + P], dtype=torch.int64)
    src = x[tail].contiguous()
    byterows.write_rows(out, at, P, src, torch.arange(3, dtype=torch.int64) * P, P)
    for n in range(3):
        a = int(at[n])
        assert torch.equal(out[a: a + P], src[n].view(torch.uint8))


@pytest.mark.parametrize("P", [0, 5, 8, 12])  # P % 4 == 0: int32 units, else bytes
@pytest.mark.parametrize("NW", [0, 2, 4])
def test_row_writer_fields(P, NW):
    """The writer's three parts against a byte-level model: payload rows or zeros, metadata
    words little-endian (every byte value), whole int64 headers (every byte distinct)."""
    gen = torch.Generator().manual_seed(P * 10 + NW)
    Q, width = 7, P + 4 * NW
    if width == 0:
        return
    src = torch.randint(0, 256, (5 * P + 4,), generator=gen, dtype=torch.uint8)
    src_off = torch.tensor([0, -1, 2 * P, -1, 4 * P, P, -1], dtype=torch.int64)
    meta = torch.randint(-2**31, 2**31, (Q, max(NW, 1)), generator=gen,
                         dtype=torch.int64).to(torch.int32)[:, :NW]
    hdr = torch.tensor([-1, 0x0123456789ABCDEF, -1, 7, -1, -1, 0x7EDCBA9876543210])
    if width < 8:  # a header row holds its 8 bytes: none here
        hdr = torch.full((Q,), -1)
    src_off[hdr >= 0] = -1  # a header row has no payload and zero metadata
    meta[hdr >= 0] = 0
    out_off = torch.randperm(Q, generator=gen) * width
    out = torch.full((Q * width,), 0xAB, dtype=torch.uint8)
    byterows.write_rows(out, out_off, width, src, src_off, P, meta if NW else None,
                        hdr if width >= 8 else None, align=width if width % 4 == 0 else 1)
    for q in range(Q):
        row = bytearray(width)
        if src_off[q] >= 0:
            row[:P] = bytes(src[src_off[q]: src_off[q] + P].tolist())
        for f in range(NW):
            row[P + 4 * f: P + 4 * f + 4] = int(meta[q, f]).to_bytes(4, "little", signed=True)
        if hdr[q] >= 0:
            row[:8] = int(hdr[q]).to_bytes(8, "little")
        a = int(out_off[q])
        assert bytes(out[a: a + width].tolist()) == bytes(row[:width]), q
