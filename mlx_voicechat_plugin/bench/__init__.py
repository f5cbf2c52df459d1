"""Benchmarks: this package against the upstream reference, in one process, same weights.

``python -m mlx_voicechat_plugin.bench`` (see ``--help``) measures streaming stage times
and host round trips, offline wall time versus input length, peak memory and the cost of
f32 pinning, and the memory-bandwidth floor; it prints a table and writes JSON, Markdown
(``docs/performance.md``) and a PNG plot. Not part of the test suite.
"""
