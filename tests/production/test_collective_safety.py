"""Collective safety (docs/reliability.md, "The call header"): whatever one rank passes, every
rank raises the same epkit.InputError, no process dies, nothing hangs, and the group stays in
step: the next valid call equals the reference bit for bit.

Each case runs at world sizes 2, 3 and 4 with the fault on rank 0 and on a middle rank.
"""

import subprocess
import sys

import numpy as np
import pytest

import safety_fns
from epkit import reference as ref
from epkit.reference.errors import Reason

PLACES = [(R, f) for R in (2, 3, 4) for f in sorted({0, R // 2})]
IDS = [f"R{R}-rank{f}" for R, f in PLACES]


def reference_round(R):
    xs, idxs, ws = zip(*(safety_fns.valid_inputs(r, R) for r in range(R)))
    res = ref.dispatch(list(xs), list(idxs), list(ws), num_experts=safety_fns.E_PER_RANK * R)
    ys = [(r.expert_x * np.float32(2.0)).astype(np.float32) for r in res]
    return [(out, r.expert_x, r.row_src) for out, r in zip(ref.combine(ys, res), res)]


def differs_from_rank0(faulty):
    """The rank named when options differ: the lowest rank unlike rank 0."""
    return faulty if faulty else 1


def check(got, R, code, rank, text=None):
    want = reference_round(R)
    messages = {err[2] if err else None for err, _ in got}
    assert len(messages) == 1, f"the ranks raised different errors: {messages}"
    for r, (err, out) in enumerate(got):
        assert err is not None, f"rank {r} raised nothing"
        assert err[:2] == (rank, int(code)), (r, err)
        if text:
            assert text in err[2], err[2]
        for name, g, w in zip(("out", "expert_x", "row_src"), out, want[r]):
            np.testing.assert_array_equal(g, w, err_msg=f"rank {r}: the next valid call's {name}")


# (kind, reason, named rank given the faulty one, a text the message must hold)
DISPATCH_CASES = [
    ("typo_transport", Reason.OPTION, lambda f: f, "unknown transport"),
    ("typo_exchange", Reason.OPTION, lambda f: f, "unknown exchange"),
    ("meta_x", Reason.DEVICE, lambda f: f, "x is on a meta device"),
    ("meta_idx", Reason.DEVICE, lambda f: f, "topk_idx is on a meta"),
    ("list_x", Reason.NOT_A_TENSOR, lambda f: f, "x must be a torch.Tensor"),
    ("numpy_w", Reason.NOT_A_TENSOR, lambda f: f, "topk_weights must be a torch.Tensor (from a "
                                                 "NumPy array: torch.from_numpy(array))"),
    ("none_idx", Reason.NOT_A_TENSOR, lambda f: f, "topk_idx must be"),
    ("small_negative_experts", Reason.NUM_EXPERTS, lambda f: f, "num_experts must be in [1, "),
    ("negative_experts", Reason.NUM_EXPERTS, lambda f: f, "got -100"),
    ("float_experts", Reason.NUM_EXPERTS, lambda f: f, None),
    ("huge_align", Reason.ALIGN, lambda f: f, "align must be in [1, 1048576]"),
    ("uint16_index", Reason.INDEX_DTYPE, lambda f: f, "got uint16"),
    ("capacity_and_factor", Reason.CAPACITY_AND_FACTOR, lambda f: f, "not both"),
    ("zero_factor", Reason.CAPACITY_FACTOR, lambda f: f, "got 0.0"),
    ("other_factor", Reason.CAPACITY_FACTOR_MISMATCH, differs_from_rank0, "capacity_factor"),
    ("other_experts", Reason.NUM_EXPERTS_MISMATCH, differs_from_rank0, "differs from rank 0's"),
    ("other_align", Reason.ALIGN_MISMATCH, differs_from_rank0, "align"),
    ("other_capacity", Reason.CAPACITY_MISMATCH, differs_from_rank0, "capacity"),
    ("other_transport", Reason.TRANSPORT_MISMATCH, differs_from_rank0, "'pairs'"),
    ("other_exchange", Reason.EXCHANGE_MISMATCH, differs_from_rank0, "'padded'"),
    ("other_payload", Reason.PAYLOAD_MISMATCH, differs_from_rank0, "'mxfp8'"),
    ("other_max_tokens", Reason.MAX_TOKENS_MISMATCH, differs_from_rank0, "max_tokens_per_rank"),
    ("too_many_local_experts", Reason.TOO_MANY_LOCAL_EXPERTS, lambda f: 0, "24 bits"),
    ("align_2pow64", Reason.ALIGN, lambda f: f, "align must be in"),
    ("experts_2pow64", Reason.NUM_EXPERTS, lambda f: f, "num_experts must be in [1, 2147483647]"),
    ("factor_overflow", Reason.CAPACITY_FACTOR, lambda f: f, "capacity_factor"),
    ("other_ranks_per_node", Reason.RANKS_PER_NODE_MISMATCH, differs_from_rank0,
     "ranks_per_node"),
    ("zero_ranks_per_node", Reason.RANKS_PER_NODE, lambda f: f, "ranks_per_node must be >= 1"),
    ("hier_lazy", Reason.UNSUPPORTED, lambda f: f, "transport='hier' does not support "
                                                        "exchange='lazy'"),
]


@pytest.mark.parametrize("R,faulty", PLACES, ids=IDS)
@pytest.mark.parametrize("kind,code,named,text", DISPATCH_CASES, ids=[c[0] for c in DISPATCH_CASES])
def test_bad_dispatch_on_one_rank(group_pool, R, faulty, kind, code, named, text):
    got = group_pool.run(safety_fns.bad_dispatch, R, [faulty] * R, [kind] * R)
    check(got, R, code, named(faulty), text)


COMBINE_CASES = [
    ("dispatch_instead", Reason.CALL_MISMATCH, differs_from_rank0, "the ranks are out of step"),
    ("short_expert_x", Reason.EXPERT_Y_ROWS, lambda f: f, "rows but the dispatch produced"),
    ("short_row_weight", Reason.FOREIGN_DISPATCH, lambda f: f, "altered after dispatch"),
    ("foreign_group", Reason.FOREIGN_DISPATCH, lambda f: f, "another process group"),
    ("not_a_dispatch", Reason.FOREIGN_DISPATCH, lambda f: f, "is not an epkit.Dispatch"),
    ("list_y", Reason.NOT_A_TENSOR, lambda f: f, "expert_y must be a torch.Tensor"),
    ("other_dispatch", Reason.DISPATCH_MISMATCH, differs_from_rank0, "combines the dispatch"),
    ("weighted_unreadable", Reason.BAD_ARGUMENT, lambda f: f, "could not be read"),
    ("replaced_plan", Reason.FOREIGN_DISPATCH, lambda f: f, "altered after dispatch"),
    ("recv_map_written", Reason.FOREIGN_DISPATCH, lambda f: f, "altered after dispatch"),
    ("replaced_plan_host", Reason.FOREIGN_DISPATCH, lambda f: f, "altered after dispatch"),
    ("plan_host_written", Reason.FOREIGN_DISPATCH, lambda f: f, "altered after dispatch"),
]

# Refused over the default group (the only group such a call can name): the test group is
# the default one only at world size 4.
DEFAULT_GROUP_CASES = [
    (safety_fns.bad_dispatch, "group_string", Reason.BAD_GROUP, "must be a torch.distributed"),
    (safety_fns.bad_combine, "top_level_none", Reason.FOREIGN_DISPATCH, "is not an epkit.Dispatch"),
]


@pytest.mark.parametrize("faulty", [0, 2])
@pytest.mark.parametrize("fn,kind,code,text", DEFAULT_GROUP_CASES,
                         ids=[c[1] for c in DEFAULT_GROUP_CASES])
def test_refused_over_the_default_group(group_pool, faulty, fn, kind, code, text):
    got = group_pool.run(fn, 4, [faulty] * 4, [kind] * 4)
    check(got, 4, code, faulty, text)


@pytest.mark.parametrize("R,faulty", PLACES, ids=IDS)
def test_pending_dispatch_given_to_combine(group_pool, R, faulty):
    got = group_pool.run(safety_fns.pending_to_combine, R, [faulty] * R)
    check(got, R, Reason.FOREIGN_DISPATCH, faulty, "call its wait() first")


@pytest.mark.parametrize("R,faulty", PLACES, ids=IDS)
@pytest.mark.parametrize("kind,code,named,text", COMBINE_CASES, ids=[c[0] for c in COMBINE_CASES])
def test_bad_combine_on_one_rank(group_pool, R, faulty, kind, code, named, text):
    got = group_pool.run(safety_fns.bad_combine, R, [faulty] * R, [kind] * R)
    check(got, R, code, named(faulty), text)


@pytest.mark.parametrize("R,faulty", PLACES, ids=IDS)
def test_one_rank_skips_backward(group_pool, R, faulty):
    """The backward passes open with the call header too: a rank that moves on to its next
    dispatch while the others run backward is CALL_MISMATCH everywhere, not an abort."""
    got = group_pool.run(safety_fns.skip_backward, R, [faulty] * R)
    check(got, R, Reason.CALL_MISMATCH, differs_from_rank0(faulty), "the backward of epkit.combine")


@pytest.mark.parametrize("R,faulty", PLACES, ids=IDS)
@pytest.mark.parametrize("kind,text", [("unweighted", "an unweighted combine")])
def test_call_flags_differ(group_pool, R, faulty, kind, text):
    """What the ranks of one call must agree on beyond the options (Reason.CALL_FLAGS_MISMATCH):
    a weighted combine."""
    got = group_pool.run(safety_fns.flags_differ, R, [faulty] * R, [kind] * R)
    check(got, R, Reason.CALL_FLAGS_MISMATCH, differs_from_rank0(faulty), text)


EXCHANGE_CASES = [
    ("short_counts", Reason.SEND_COUNTS, lambda f: f),
    ("sum", Reason.SEND_COUNTS_SUM, lambda f: f),
    ("negative", Reason.SEND_COUNTS_NEGATIVE, lambda f: f),
    ("width", Reason.ROW_WIDTH_MISMATCH, differs_from_rank0),
    ("dtype", Reason.ROWS_DTYPE_MISMATCH, differs_from_rank0),
    ("meta_counts", Reason.BAD_ARGUMENT, lambda f: f),
    ("variant_list", Reason.OPTION, lambda f: f),
]


@pytest.mark.parametrize("R,faulty", PLACES, ids=IDS)
@pytest.mark.parametrize("kind,code,named", EXCHANGE_CASES, ids=[c[0] for c in EXCHANGE_CASES])
def test_bad_exchange_on_one_rank(group_pool, R, faulty, kind, code, named):
    got = group_pool.run(safety_fns.bad_exchange, R, [faulty] * R, [kind] * R)
    for r, (err, good) in enumerate(got):
        assert err is not None and err[:2] == (named(faulty), int(code)), (r, err)
        np.testing.assert_array_equal(good[:, 0], np.arange(R, dtype=np.float32))
    assert len({err[2] for err, _ in got}) == 1


OUT_OF_STEP = {int(Reason.CALL_MISMATCH), int(Reason.CALL_SEQUENCE),
               int(Reason.DISPATCH_MISMATCH), int(Reason.FOREIGN_DISPATCH)}


@pytest.mark.parametrize("R", [2, 4])
def test_two_threads_share_a_dispatcher(group_pool, R):
    """Two threads on one Dispatcher: no wrong result, no abort, no hang. Calls pair across
    ranks in each process's order, so where the threads interleave differently on different
    ranks the call is refused on every rank with an out-of-step InputError (FOREIGN_DISPATCH:
    the combine a thread still makes after its dispatch was refused)."""
    got = group_pool.run(safety_fns.two_threads, R, [4] * R)
    want = reference_round(R)
    for r, (errors, refused, outs) in enumerate(got):
        assert not errors, (r, errors)
        assert set(refused) <= OUT_OF_STEP, (r, refused)
        assert len(outs) + len(refused) >= 8, (r, len(outs), refused)
        for out in outs:
            np.testing.assert_array_equal(out, want[r][0])
    # Every refusal of a call is collective: each rank refused as many calls.
    assert len({len(refused) - refused.count(int(Reason.FOREIGN_DISPATCH))
                for _, refused, _ in got}) == 1, got


NO_GROUP = """
import torch, epkit
for call in (lambda: epkit.dispatch(torch.ones(2, 4), torch.zeros(2, 1, dtype=torch.long),
                                    torch.ones(2, 1), num_experts=2),
             lambda: epkit.exchange(torch.ones(2, 4), [2])):
    try:
        call()
    except RuntimeError as exc:
        print("RAISED:", exc)
"""


def test_no_process_group_says_how_to_make_one():
    out = subprocess.run([sys.executable, "-c", NO_GROUP], capture_output=True, text=True,
                         timeout=120)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RAISED:")]
    assert len(lines) == 2, out.stdout + out.stderr
    for ln in lines:
        assert "epkit: no process group" in ln and "init_process_group(" in ln, ln
        assert "world_size=1" in ln, ln  # how to make a group of one
