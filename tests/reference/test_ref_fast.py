"""The vectorized tier equals the clear tier bit for bit."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from epkit import reference as ref
from refcases import assert_lists_bitwise, assert_results_bitwise, cases


@settings(max_examples=80, deadline=None)
@given(cases(payloads=(None, None, "mxfp8", "fp8_block128")), st.booleans(), st.booleans())
def test_fast_equals_clear(case, weighted, rank_major):
    kw = case.kw(rank_major=rank_major)
    a = ref.dispatch(case.xs, case.idx, case.ws, **kw)
    b = ref.fast.dispatch(case.xs, case.idx, case.ws, **kw)
    assert_results_bitwise(a, b)
    ys = case.rows_like([r.expert_x.shape for r in a], case.dtype, salt=3)
    go = case.rows_like([x.shape for x in case.xs], np.float32, salt=4)
    assert_lists_bitwise(ref.combine(ys, a, weighted), ref.fast.combine(ys, b, weighted), "combine")
    assert_lists_bitwise(ref.dispatch_backward(ys, a), ref.fast.dispatch_backward(ys, b), "dispatch_backward")
    ga, gb = ref.combine_backward(go, ys, a, weighted), ref.fast.combine_backward(go, ys, b, weighted)
    assert_lists_bitwise(ga[0], gb[0], "grad expert_y")
    assert_lists_bitwise(ga[1], gb[1], "grad weights")
    la, lb = ref.layout(case.idx, case.E), ref.fast.layout(case.idx, case.E)
    for p, q in zip(la, lb):
        for f in ("tokens_per_expert", "tokens_per_rank", "slots_per_rank", "is_token_in_rank",
                  "recv_tokens_per_expert"):
            assert_lists_bitwise([getattr(p, f)], [getattr(q, f)], f)


@settings(max_examples=40, deadline=None)
@given(cases(), st.sampled_from(("pairs", "dedup")), st.sampled_from(("ragged", "padded", "static", "auto")))
def test_fast_transport_bytes(case, tr, ex):
    mt = max(x.shape[0] for x in case.xs)
    kw = case.kw(transport=tr, exchange=ex, max_tokens_per_rank=mt)
    a = ref.dispatch(case.xs, case.idx, case.ws, **kw)
    b = ref.fast.dispatch(case.xs, case.idx, case.ws, **kw)
    assert_results_bitwise(a, b, fields=("expert_x", "row_src", "row_weight", "bytes_sent"))
    bkw = dict(num_experts=case.E, hidden=case.H, dtype=case.dtype, transport=tr, exchange=ex,
               capacity=case.capacity, max_tokens_per_rank=mt)
    assert np.array_equal(ref.dispatch_bytes(case.idx, **bkw), ref.fast.dispatch_bytes(case.idx, **bkw))
    assert np.array_equal(ref.combine_bytes(case.idx, **bkw), ref.fast.combine_bytes(case.idx, **bkw))
