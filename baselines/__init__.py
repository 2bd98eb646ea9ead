"""Dispatchers epkit is measured and gated against, in one place that `epkit bench` and
`epkit.verify` both import.

- :mod:`.plain_torch`: permute + all-to-all + a bit-exact combine in the spec's two-level order
  (the harness's known-good second implementation; slower than what people run).
- :mod:`.megatron_style`: what Megatron-Core / torchtitan-style code runs: argsort permute,
  ``all_to_all_single``, chunk sort, one float32 ``index_add_`` combine (meets ``bounded``, not
  ``exact``).
"""
