"""The programs around the library: the ``epkit`` command line (:mod:`.cli`), the benchmark
(:mod:`.bench`, whose rank processes run :mod:`.bench_group` and time kernels with
:mod:`.bench_kernels`), the traffic simulator (:mod:`.simulate`, NumPy only) and the process
plumbing that the bench and the verify pool share (:mod:`.procs`). Nothing in the library
(``epkit``) imports from here."""
