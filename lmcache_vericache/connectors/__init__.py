"""vLLM integration: the compressed-KV drafting proposer (``--speculative-config``) and the
paged-cache layout helpers it reads vLLM's KV with. The KV connector side reuses LMCache's MP
connector with this package's L2 adapter (``lmcache_vericache.backends.lmcache.l2_adapter``)."""
