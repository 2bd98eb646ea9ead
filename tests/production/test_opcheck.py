"""torch.library.opcheck on every op: schema, fake kernel, autograd registration, AOT dispatch."""

import rank_fns


def test_opcheck_every_op(group_pool):
    import torch

    import epkit.ops  # noqa: F401 - loads the library so its ops can be listed
    checked = group_pool.run(rank_fns.opcheck_all, 1)[0]
    ours = {n.replace("::", ".") for n in torch._C._dispatch_get_all_op_names()
            if n.startswith("epkit::")}
    assert len(ours) >= 16, sorted(ours)
    # an op without a tensor argument (release_cache) has nothing for opcheck to trace
    tensorless = {n for n in ours
                  if not any("Tensor" in str(a.type) for a in getattr(
                      torch.ops.epkit, n.split(".")[1]).default._schema.arguments)}
    assert tensorless == {"epkit.release_cache", "epkit.cached_bytes"}, tensorless
    assert ours - tensorless <= set(checked), (
        f"ops never opchecked: {sorted(ours - tensorless - set(checked))}")
