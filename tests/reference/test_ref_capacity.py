"""The rules both tiers share one body for (capacity.kept_mask, layout.token_rows, the hier
counts), each against the rule written out slot by slot, as the spec states it."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from epkit import reference as ref
from epkit.reference.capacity import kept_mask
from epkit.reference.layout import token_rows
from epkit.reference.transports import hier
from refcases import cases


def kept_by_the_rule(idx, E, capacity):
    """capacity.py's rule: slot (s, t, k) to e is kept iff fewer than C used slots to e come
    before it in canonical order (s, then t)."""
    seen, out = np.zeros(E, np.int64), []
    for i in idx:
        mask = np.zeros(i.shape, bool)
        for t in range(i.shape[0]):
            for k in range(i.shape[1]):
                e = int(i[t, k])
                if e >= 0:
                    mask[t, k] = capacity is None or seen[e] < capacity
                    seen[e] += 1
        out.append(mask)
    return out


def kept_on(i, keep, t, L):
    """The ranks of token t's kept slots, one entry per slot."""
    return [int(e) // L for e, k in zip(i[t], keep[t]) if k]


@settings(max_examples=60, deadline=None)
@given(cases())
def test_kept_mask_and_token_rows_follow_the_rule(case):
    kept = kept_mask(case.idx, case.E, case.capacity)
    want = kept_by_the_rule(case.idx, case.E, case.capacity)
    assert all(np.array_equal(a, b) for a, b in zip(kept, want))
    R, L = case.R, case.L
    for i, keep in zip(case.idx, kept):
        rows, single = token_rows(i, keep, R, case.E)
        ranks = [kept_on(i, keep, t, L) for t in range(i.shape[0])]
        assert rows.tolist() == [sum(d in r for r in ranks) for d in range(R)]
        assert single.tolist() == [sum(r.count(d) == 1 for r in ranks) for d in range(R)]


@settings(max_examples=40, deadline=None)
@given(cases(), st.data())
def test_hier_node_counts_follow_the_rule(case, data):
    R, L = case.R, case.L
    G = data.draw(st.sampled_from([g for g in range(1, R + 1) if R % g == 0]), "G")
    kept = kept_mask(case.idx, case.E, case.capacity)
    c = hier.node_counts(case.idx, kept, R, case.E, G)
    for s in range(R):
        ranks = [kept_on(case.idx[s], kept[s], t, L) for t in range(case.idx[s].shape[0])]
        nodes = [[d // G for d in r] for r in ranks]
        assert c.tokens[s].tolist() == [sum(d in r for r in ranks) for d in range(R)]
        assert c.multi[s].tolist() == [sum(r.count(d) >= 2 for r in ranks) for d in range(R)]
        assert c.slots[s].tolist() == [sum(r.count(d) for r in ranks) for d in range(R)]
        assert c.node_tokens[s].tolist() == [sum(n in r for r in nodes) for n in range(R // G)]
        assert c.node_multi[s].tolist() == [sum(r.count(n) >= 2 for r in nodes)
                                            for n in range(R // G)]


def test_byte_functions_account_hier_as_dedup_from_the_count_words():
    """dispatch_bytes / combine_bytes know the one-stage transports; under hier they give
    dedup's plan from the count words alone (accounting.py), as they always have."""
    from epkit.reference import accounting
    from epkit.reference.transports import count_words

    idx = [np.array([[0, 1], [2, 3], [0, 2]]), np.array([[1, 3], [0, -1], [2, 1]])]
    kw = dict(num_experts=4, hidden=8, dtype="float32", capacity=2)
    group, i = accounting.bytes_group(idx, 4, 8, "float32", "dedup", "ragged", 2, None, None)
    loose = accounting.plan(group, count_words(i, 2, 4))
    assert not loose.exact
    assert np.array_equal(ref.dispatch_bytes(idx, transport="hier", **kw),
                          accounting.dispatch_bytes_of(group, loose))
    assert np.array_equal(ref.combine_bytes(idx, transport="hier", **kw),
                          accounting.combine_bytes_of(group, loose))


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 6).flatmap(lambda E: st.tuples(
    st.just(E), st.lists(st.integers(0, E), max_size=40),
    st.lists(st.integers(0, 8), min_size=E, max_size=E))))
def test_kept_slots_is_one_body_for_numpy_and_torch(draw):
    """capacity.kept_slots, the lines production runs on its device tensors (moves.kept_routing),
    gives the rule's mask with NumPy and the same mask with torch."""
    import torch

    E, experts, limit = draw
    e = np.array(experts, np.int64)
    lim = np.array(limit + [0], np.int64)
    seen, want = np.zeros(E + 1, np.int64), np.zeros(len(e), bool)
    for i, x in enumerate(e):  # the rule, slot by slot
        want[i] = seen[x] < lim[x]
        seen[x] += 1
    got = ref.capacity.kept_slots(np, e, lim)
    assert got.dtype == bool and np.array_equal(got, want)
    got_torch = ref.capacity.kept_slots(torch, torch.from_numpy(e), torch.from_numpy(lim))
    assert got_torch.dtype == torch.bool and np.array_equal(got_torch.numpy(), want)
