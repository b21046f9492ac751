"""Real servers and harnesses shared by tests, benchmarks and scripts; none of them needs pytest.

* :mod:`.servers`: real Redis/Valkey (single or Cluster), LMCache ``lm://`` and ``lmcache server``
  processes;
* :mod:`.throttle`: a bandwidth-limited TCP link in front of such a server;
* :mod:`.lmcache_engine`: a real in-process ``LMCacheEngine`` on a CPU-only host;
* :mod:`.vllm_harness`: one offline vLLM engine run in its own process;
* :mod:`.fixtures`: the pytest fixtures that start the servers (imported by ``tests/conftest.py``;
  the one module that needs pytest, from the ``dev`` extra).
"""
