"""Server fixtures and harnesses shared by tests and benchmarks.

* :mod:`.servers`: real Redis/Valkey, LMCache ``lm://`` and ``lmcache server`` processes, and the
  pytest fixtures that start them;
* :mod:`.vllm_harness`: one offline vLLM engine run in its own process.

Needs the ``dev`` extra (``pip install -e '.[dev]'``): :mod:`.servers` imports ``pytest``.
"""
