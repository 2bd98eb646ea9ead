"""epkit.verify: prove an expert-parallel dispatcher against the reference, on a real group.

- :func:`cases` (hypothesis strategy) draws whole-group :class:`Case` s;
- :class:`Pool` runs them on ``R`` persistent worker ranks of one gloo group
  (:class:`TorchrunGroup` under ``torchrun``, NCCL on GPUs);
- :func:`check_case` compares every rank's outputs and gradients with ``epkit.reference``;
- :class:`Suite` runs hypothesis over every mode and tallies the closing table;
- :func:`epkit.verify.cli.main` is ``epkit verify`` / ``python -m epkit.verify``.

Adapters (``--impl module:factory``) are described in :mod:`epkit.verify.adapters` and
docs/verify.md. Importing this package does not import torch; the names below load lazily.
"""

_LAZY = {
    "Case": "epkit.verify.cases",
    "ModeSpec": "epkit.verify.cases",
    "cases": "epkit.verify.strategies",
    "Pool": "epkit.verify.pool",
    "TorchrunGroup": "epkit.verify.pool",
    "check_case": "epkit.verify.check",
    "Verdict": "epkit.verify.check",
    "PROPERTIES": "epkit.verify.check",
    "Suite": "epkit.verify.runner",
    "SuiteResult": "epkit.verify.runner",
    "DEFAULT_IMPL": "epkit.verify.runner",
    "modes_of": "epkit.verify.runner",
    "load_factory": "epkit.verify.adapters",
}

__all__ = [*_LAZY, "replay"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'epkit.verify' has no attribute {name!r}")


def replay(case, impl=None, mode="default", *, pool=None, timeout=60.0, reference=None,
           quiet=False):
    """Run one case (e.g. from a failure report) and print what the checks say.

    ``mode`` is a mode name of ``impl`` (or a :class:`ModeSpec`). Returns the
    :class:`Verdict`. A pool of ``case.world_size`` ranks is started unless one is given."""
    from epkit.verify.cases import ModeSpec
    from epkit.verify.check import check_case
    from epkit.verify.pool import Pool
    from epkit.verify.runner import DEFAULT_IMPL, modes_of

    impl = impl or DEFAULT_IMPL
    if not isinstance(mode, ModeSpec):
        found = [m for m in modes_of(impl) if m.name == mode]
        if not found:
            raise ValueError(f"{impl} has no mode {mode!r}")
        mode = found[0]
    own = pool is None
    pool = pool or Pool(case.world_size, timeout=timeout)
    try:
        verdict = check_case(case, mode, pool.run(case, impl, mode), impl, reference)
    finally:
        if own:
            pool.close()
    if not quiet:
        print(verdict.report() if verdict.failed else
              "passed: " + ", ".join(f"{p} {s}" for p, s in verdict.status.items()))
    return verdict
