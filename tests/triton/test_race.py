"""The race checker (``race.py``, installed for every test here by ``conftest.py``): it fails a
launch whose programs write one byte twice or read what another program writes, names the
programs and the byte, and passes launches whose programs keep to their own bytes."""

import pytest
import race
import torch

from epkit.triton._runtime import launch, tl, triton

B = 16


@triton.jit
def copy_tile(x, o, n, SHIFT_OUT: tl.constexpr, SHIFT_IN: tl.constexpr, EXTRA: tl.constexpr,
              BLOCK: tl.constexpr):
    # program p writes o[p*SHIFT_OUT + i] and reads x[p*SHIFT_IN + i], i < BLOCK + EXTRA
    pid = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < BLOCK + EXTRA  # EXTRA < 0 masks the last lanes off
    v = tl.load(x + pid * SHIFT_IN + i, mask=m & (pid * SHIFT_IN + i < n), other=0.0)
    tl.store(o + pid * SHIFT_OUT + i, v + 1.0, mask=m & (pid * SHIFT_OUT + i < n))


@triton.jit
def shift_in_place(o, n, BLOCK: tl.constexpr):
    # program p reads its right neighbour's block of o and writes its own: reads another's output
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(o + i + BLOCK, mask=i + BLOCK < n, other=0.0)
    tl.store(o + i, v, mask=i < n)


@triton.jit
def own_round_trip(o, n, BLOCK: tl.constexpr):
    # a program reading back what it wrote itself is no race
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(o + i, i.to(tl.float32), mask=i < n)
    v = tl.load(o + i, mask=i < n)
    tl.store(o + i, v * 2.0, mask=i < n)


@triton.jit
def count(c, BLOCK: tl.constexpr):
    tl.atomic_add(c + tl.arange(0, BLOCK) * 0, 1, mask=tl.arange(0, BLOCK) < 1)


@triton.jit
def bytes_over_words(o, BLOCK: tl.constexpr):
    # program 0 writes a float32 word, program 1 one byte of it (through a uint8 view)
    pid = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    if pid == 0:
        tl.store(o + i, tl.zeros([BLOCK], tl.float32))
    else:
        tl.store(o.to(tl.pointer_type(tl.uint8)) + 4 * BLOCK - 1 + i, tl.zeros([BLOCK], tl.uint8), mask=i < 1)


def test_installed():
    from epkit.triton import _runtime

    assert race.check_races in _runtime.LAUNCH_HOOKS


def test_two_writers():
    x, o = torch.zeros(4 * B), torch.zeros(4 * B)
    with pytest.raises(race.RaceError, match=r"programs \(0, 0, 0\) and \(1, 0, 0\) both write byte 0 of argument 'o'"):
        launch(copy_tile, (4,), x, o, 4 * B, SHIFT_OUT=0, SHIFT_IN=B, EXTRA=0, BLOCK=B)


def test_two_writers_overlapping_by_one_element():
    # program p writes B + 1 elements from p * B: its last is the next program's first
    x, o = torch.zeros(8 * B), torch.zeros(8 * B)
    with pytest.raises(race.RaceError, match=f"both write byte {4 * B} of argument 'o'"):
        launch(copy_tile, (4,), x, o, 8 * B, SHIFT_OUT=B, SHIFT_IN=B, EXTRA=0, BLOCK=2 * B)


def test_masked_lanes_are_not_accesses():
    # the same tiles of 2B lanes with the second half masked off: disjoint
    x, o = torch.zeros(8 * B), torch.zeros(8 * B)
    launch(copy_tile, (4,), x, o, 8 * B, SHIFT_OUT=B, SHIFT_IN=B, EXTRA=-B, BLOCK=2 * B)
    assert torch.equal(o[:4 * B], torch.ones(4 * B)) and o[4 * B:].abs().sum() == 0


def test_read_of_another_programs_write():
    o = torch.arange(4 * B, dtype=torch.float32)
    with pytest.raises(race.RaceError, match=r"program \(0, 0, 0\) reads what program \(1, 0, 0\) writes: "
                                             f"byte {4 * B} of argument 'o'"):
        launch(shift_in_place, (4,), o, 4 * B, BLOCK=B)


def test_read_of_another_programs_write_through_an_alias():
    # the input is a view of the output shifted by one block: aliasing is seen through addresses
    buf = torch.zeros(5 * B)
    with pytest.raises(race.RaceError, match="reads what program"):
        launch(copy_tile, (4,), buf[B:], buf, 5 * B, SHIFT_OUT=B, SHIFT_IN=B, EXTRA=0, BLOCK=B)


def test_clean_launches_pass():
    x = torch.arange(4 * B, dtype=torch.float32)
    o = torch.zeros(4 * B)
    launch(copy_tile, (4,), x, o, 4 * B, SHIFT_OUT=B, SHIFT_IN=B, EXTRA=0, BLOCK=B)
    assert torch.equal(o, x + 1)
    # every program reading the same input is fine: only writes conflict
    launch(copy_tile, (4,), x, o, 4 * B, SHIFT_OUT=B, SHIFT_IN=0, EXTRA=0, BLOCK=B)
    assert torch.equal(o, (x[:B] + 1).repeat(4))
    r = torch.zeros(4 * B)
    launch(own_round_trip, (4,), r, 4 * B, BLOCK=B)
    assert torch.equal(r, 2 * torch.arange(4 * B, dtype=torch.float32))


def test_atomics_from_two_programs():
    c = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(race.RaceError, match="both write byte 0 of argument 'c'"):
        launch(count, (2,), c, BLOCK=B)


def test_byte_inside_another_programs_word():
    o = torch.zeros(B)
    with pytest.raises(race.RaceError, match=f"both write byte {4 * B - 1} of argument 'o'"):
        launch(bytes_over_words, (2,), o, BLOCK=B)


def test_off_without_the_interpreter(monkeypatch):
    # compiled kernels run on a GPU, where there is nothing to hook: the checker stands aside
    from epkit.triton import _runtime

    monkeypatch.setattr(_runtime, "INTERPRETED", False)
    with race.check_races(copy_tile, (4,), (), {}):
        pass


# ---- at a GPU launch's tile sizes --------------------------------------------------------------
# The interpreter's tiles are large (few programs: it pays per operation), so most launches are
# one program and the checker, which compares programs, has nothing to compare. Under
# _runtime.gpu_tiles() the same kernels launch with a GPU's tiles and program counts.

def _row_writer_with_two_writers_of_row_0():
    """byterows.write_rows (the row mover of pack, unpack and scatter_rows) with a planted
    defect: its last output row is row 0 again (an index map with a duplicate entry)."""
    from epkit.triton import byterows

    Q, W = 80, 64  # 16 int32 units a row: a GPU tile of 64 rows, so rows 0 and 79 are two programs
    src = torch.arange(Q * W, dtype=torch.int32).view(torch.uint8)[: Q * W].clone()
    out = torch.zeros(Q * W, dtype=torch.uint8)
    out_off = torch.arange(Q, dtype=torch.int64) * W
    out_off[-1] = 0
    src_off = torch.arange(Q, dtype=torch.int64) * W
    byterows.write_rows(out, out_off, W, src, src_off, W, align=4)


def test_two_writers_of_one_row_caught_at_gpu_tile_sizes():
    from epkit.triton import _runtime, byterows

    if _runtime.tiles() == "interpreter":  # (not under EPKIT_TILES=gpu)
        # interpreter tiles: one program owns all 80 rows; writing row 0 twice is its own business
        assert byterows.tile(16)[0] >= 80
        _row_writer_with_two_writers_of_row_0()
    with _runtime.gpu_tiles():
        assert _runtime.tiles() == "gpu" and byterows.tile(16) in byterows.GPU_TILES
        with pytest.raises(race.RaceError, match=r"_rows_kernel over grid \(2,\): programs \(0, 0, 0\) "
                                                 r"and \(1, 0, 0\) both write byte 0 of argument 'out'"):
            _row_writer_with_two_writers_of_row_0()


def test_gpu_tiles_switches_every_module_and_restores():
    from epkit.triton import _runtime, backward, combine

    before = (combine.ROWS, combine.BLOCK, backward.ROWS)
    with _runtime.gpu_tiles():
        assert (combine.ROWS, combine.BLOCK, backward.ROWS) == (4, 128, 8)
    assert (combine.ROWS, combine.BLOCK, backward.ROWS) == before


@pytest.mark.parametrize("transport,exchange", [("dedup", "static"), ("pairs", "ragged")])
def test_group_round_trip_at_gpu_tile_sizes(transport, exchange):
    """dispatch -> combine -> both backward passes of a small group, every kernel at a GPU
    launch's tiles (several programs a launch: rank 0's 70 tokens of 16 float32 are two or
    more programs of the row writer's 64-row tile, 18 of combine's reduce), race-checked, bit for bit against
    the C++ kernels."""
    import sim
    from epkit.triton import _runtime

    case = sim.make_case(2, 2, 3, 16, [70, 6], torch.float32, seed=3)
    kw = dict(align=2, capacity=None, transport=transport, exchange=exchange, y_dtype=torch.float32)
    want = sim.run(case, weighted=True, device="cpu", C=sim.CPP, **kw)
    with _runtime.gpu_tiles():
        got = sim.run(case, weighted=True, device="cpu", C=sim.Triton(), **kw)
    sim.assert_same(want, got)
