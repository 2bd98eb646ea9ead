"""Reading a result's attribute on a pending lazy result (``exchange="lazy"``) names ``wait()``
instead of a bare AttributeError; the pending objects' own attributes are untouched."""

from __future__ import annotations

import copy
import pickle

import pytest

from epkit.lazy import PendingCombine, PendingDispatch


@pytest.mark.parametrize("cls,name,var", [(PendingDispatch, "expert_x", "d"),
                                          (PendingDispatch, "tokens_per_expert", "d"),
                                          (PendingCombine, "shape", "out")])
def test_result_attribute_names_wait(cls, name, var):
    pending = cls.__new__(cls)  # no exchange behind it: only its attribute lookup is tested
    with pytest.raises(AttributeError, match=rf"call its wait\(\) first.*{var} = pending.wait\(\); "
                                             rf"{var}\.{name}$"):
        getattr(pending, name)


def test_own_and_private_attributes_unchanged():
    pending = PendingDispatch.__new__(PendingDispatch)
    pending._done = "the dispatch"
    assert pending.wait() == "the dispatch" and callable(pending.wait)
    with pytest.raises(AttributeError) as e:
        pending._missing
    assert "wait()" not in str(e.value)
    assert not hasattr(pending, "__missing__")  # protocols probing dunders see plain misses
    copy.copy(pending)
    pickle.dumps(pending)
