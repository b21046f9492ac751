"""LMCache glue: thin adapters that translate LMCache's calls into the store's API.

* :mod:`.plugin`: ``VeriCacheBackend``, an in-process ``StoragePluginInterface`` backend;
* :mod:`.l2_adapter`: ``VeriCacheL2Adapter``, an L2 adapter of the multiprocess ``lmcache server``.

Both name chunks with the shared key scheme (:mod:`lmcache_vericache.backends.keys`) and hold no
storage logic of their own. Each imports ``lmcache``; import the one you need.
"""
