"""epkit.verify: prove an expert-parallel dispatcher against the reference, on a real group.

- :func:`cases` (hypothesis strategy) draws whole-group :class:`Case` s;
- :class:`Pool` runs them on ``R`` persistent worker ranks of one gloo group
  (:class:`TorchrunGroup` under ``torchrun``, NCCL on GPUs);
- :func:`check_case` compares every rank's outputs and gradients with ``epkit.reference``
  under a contract (``exact``, ``reordered``, ``bounded``);
- :class:`Suite` runs hypothesis over every mode and tallies the closing table;
- :func:`check` is the pytest entry point (a whole run; raises ``AssertionError`` on failure);
- :mod:`epkit.verify.adapt` helps write an adapter (``row_src`` from a permutation, a shim for
  ``-1`` slots);
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
    "check_case": "epkit.verify.checks",
    "Verdict": "epkit.verify.verdict",
    "PROPERTIES": "epkit.verify.verdict",
    "CONTRACTS": "epkit.verify.verdict",
    "Capabilities": "epkit.verify.capabilities",
    "row_src_from_slots": "epkit.verify.adapt",
    "exchange_row_src": "epkit.verify.adapt",
    "FullTopK": "epkit.verify.adapt",
    "Suite": "epkit.verify.runner",
    "SuiteResult": "epkit.verify.runner",
    "DEFAULT_IMPL": "epkit.verify.runner",
    "modes_of": "epkit.verify.runner",
    "load_factory": "epkit.verify.adapters",
}

__all__ = [*_LAZY, "check", "replay"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'epkit.verify' has no attribute {name!r}")


def check(impl, *, examples=20, contract="exact", world_size=4, seed=0, supports=None,
          accumulate=None, modes=None, pool=None, timeout=60.0, max_tokens=24,
          max_hidden=72, shrink_seconds=10.0, check_errors=None):
    """Run the whole harness on ``impl`` (``"module:factory"``, ``"path.py:factory"``, or the
    factory itself when it lives in an importable module) and raise ``AssertionError`` with the
    report unless every mode passed ``contract`` for ``examples`` examples per property::

        def test_my_dispatcher_conforms():
            epkit.verify.check("my_project.ep:make_adapter", examples=30, contract="bounded")

    ``supports``: capability declarations as on the command line (``["capacity=no"]`` or a
    dict); ``modes``: fnmatch patterns over mode names; ``accumulate``: as ``--accumulate``;
    ``check_errors``: as ``--check-errors``; ``max_tokens``, ``max_hidden``: as
    ``--max-tokens``, ``--max-hidden``. The group has ``world_size`` ranks (default 4) and
    every mode's corner cases run at each world size 1..4 within it, so 2, 3 and 4 are all
    checked; a world size from 2 up that no case reached (every one refused) is reported in
    the AssertionError. Returns the :class:`SuiteResult`."""
    from .pool import Pool
    from .runner import Suite, modes_of, select_modes

    if callable(impl) and not isinstance(impl, str):
        impl = f"{impl.__module__}:{impl.__qualname__}"
    chosen = select_modes(modes_of(impl), modes)
    if not chosen:
        raise ValueError(f"no mode of {impl} matches {modes!r}")
    own = pool is None
    pool = pool or Pool(world_size, timeout=timeout)
    try:
        result = Suite(pool, impl=impl, modes=chosen, examples=examples, seed=seed,
                       max_tokens=max_tokens, max_hidden=max_hidden,
                       shrink_seconds=shrink_seconds, contract=contract,
                       accumulate=accumulate, supports=supports,
                       check_errors=check_errors).run()
    finally:
        if own:
            pool.close()
    missing = [n for n in range(2, min(pool.world_size, 4) + 1)
               if n not in result.world_sizes_checked]
    if not result.ok or missing:
        reports = "\n\n".join(v.report() for v in result.failures)
        uncovered = (f"\nworld sizes never checked (every case refused there): "
                     f"{', '.join(map(str, missing))}" if missing else "")
        raise AssertionError(f"epkit verify: {impl} fails contract {contract}{uncovered}\n"
                             f"{result.table()}\n{reports}\n{result.summary()}")
    return result


def replay(case, impl=None, mode="default", *, pool=None, timeout=60.0, reference=None,
           quiet=False, contract="exact", supports=None, accumulate=None, after=()):
    """Run one case (e.g. from a failure report) and print what the checks say.

    ``mode`` is a mode name of ``impl`` (or a :class:`ModeSpec`). Returns the
    :class:`Verdict`. A pool of ``case.world_size`` ranks (enough for every case) is started
    unless one is given. ``after``: cases to run first on the same adapter, unchecked (a
    report whose failure needs earlier cases lists them)."""
    from .adapters import load_factory
    from .capabilities import resolve_capabilities
    from .cases import ModeSpec
    from .checks import check_case
    from .pool import Pool
    from .runner import DEFAULT_IMPL, modes_of

    impl = impl or DEFAULT_IMPL
    if not isinstance(mode, ModeSpec):
        found = [m for m in modes_of(impl) if m.name == mode]
        if not found:
            raise ValueError(f"{impl} has no mode {mode!r}")
        mode = found[0]
    own = pool is None
    pool = pool or Pool(max(c.world_size for c in (case, *after)), timeout=timeout)
    try:
        caps = resolve_capabilities(load_factory(impl), mode, supports)
        for earlier in after:
            pool.run(earlier, impl, mode)
        verdict = check_case(case, mode, pool.run(case, impl, mode), impl, reference,
                             contract=contract, capabilities=caps, accumulate=accumulate)
    finally:
        if own:
            pool.close()
    if not quiet:
        print(verdict.report() if verdict.failed else
              "passed: " + ", ".join(f"{p} {s}" for p, s in verdict.status.items()))
    return verdict
