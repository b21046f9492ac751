"""Prometheus metrics of the store, the engine and the LMCache adapters (docs/operations.md#metrics).

Every metric lives in :data:`registry`, this package's own ``CollectorRegistry`` (not the
process-global default one), so several stores or engines in one process share each metric and
are told apart by labels (``tier``), never by registering duplicates. Values are process-wide
totals since import: read deltas when comparing with one object's ``stats``.

>>> from lmcache_vericache import metrics
>>> server = metrics.serve(9400)           # GET http://127.0.0.1:9400/metrics
>>> print(metrics.render())                # the same text exposition
>>> server.shutdown(); server.server_close()
"""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import MetricsHandler

registry = CollectorRegistry()

_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TOKENS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def _counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
    return Counter(name, doc, labels, registry=registry)


# -- dual-tier store (backends/store.py), labelled by the capacity tier's name -------------------
STORE_HITS = _counter("vericache_store_hits_total", "Store reads that returned a verified chunk, by path "
                      "(compressed_hot, compressed_tier, full).", ("tier", "path"))
STORE_MISSES = _counter("vericache_store_misses_total", "Store reads that returned nothing (absent, "
                        "unreadable or rejected), by path (compressed, full).", ("tier", "path"))
STORE_REJECTED = _counter("vericache_store_rejected_total", "Stored values rejected on read, by reason "
                          "(corrupt, unauthenticated, invalid).", ("tier", "reason"))
STORE_CANCELLED = _counter("vericache_store_cancelled_reads_total", "Prefetch reads cancelled before they ran.",
                           ("tier",))
STORE_PUTS = _counter("vericache_store_puts_total", "Chunks written to the store.", ("tier",))
STORE_PUT_ERRORS = _counter("vericache_store_put_errors_total", "Capacity-tier writes that failed.", ("tier",))
STORE_BYTES_READ = _counter("vericache_store_read_bytes_total", "Bytes read from the capacity tier.", ("tier",))
STORE_BYTES_WRITTEN = _counter("vericache_store_written_bytes_total", "Bytes written to the capacity tier.",
                               ("tier",))
STORE_FULL_READ_SECONDS = Histogram("vericache_store_full_read_seconds", "Latency of one full-chunk read "
                                    "(tier read, verification, decoding).", ("tier",), buckets=_SECONDS,
                                    registry=registry)
STORE_PUT_SECONDS = Histogram("vericache_store_put_seconds", "Latency of one put that writes (compression "
                              "and capacity-tier writes).", ("tier",), buckets=_SECONDS, registry=registry)
STORE_PREFETCH = Gauge("vericache_store_prefetch_reads", "Prefetch reads of full chunks now queued or "
                       "reading (state).", ("tier", "state"), registry=registry)

# -- engine (engine/rounds.py), once per round --------------------------------------------------
ENGINE_REQUESTS = _counter("vericache_engine_requests_total", "Requests decoded with draft/verify.")
ENGINE_ROUNDS = _counter("vericache_engine_rounds_total", "Draft/verify rounds committed.")
ENGINE_ACCEPTED = Histogram("vericache_engine_accepted_tokens", "Drafts accepted per round.",
                            buckets=_TOKENS, registry=registry)
ENGINE_DRAFTED = _counter("vericache_engine_drafted_tokens_total", "Draft tokens proposed for verification.")
ENGINE_EMITTED = _counter("vericache_engine_emitted_tokens_total", "Tokens emitted (accepted drafts, the "
                          "target's own tokens and each request's first token).")
ENGINE_SWAP_WAIT = Histogram("vericache_engine_swap_wait_seconds", "Per round, time verification waited "
                             "for the full prefix swap (unhidden swap time).", buckets=_SECONDS, registry=registry)
ENGINE_SWAP_SECONDS = _counter("vericache_engine_swap_seconds_total", "Time spent swapping full prefixes in; "
                               "hidden fraction = 1 - swap_wait_seconds_sum / this.")
ENGINE_RECOMPUTED = _counter("vericache_engine_recomputed_chunks_total", "Full prefix chunks the store missed "
                             "(or served damaged), recomputed from tokens.")
ENGINE_CACHED = _counter("vericache_engine_cached_chunks_total", "Prompt chunks taken from the store instead "
                         "of prefilled (shared prefix).")

# -- LMCache adapters (backends/lmcache/), named after their ``stats`` keys -----------------------
L2 = {k: _counter(f"vericache_l2_{k}_total", doc) for k, doc in {
    "stored_chunks": "L2 adapter: chunks stored.",
    "store_failures": "L2 adapter: chunks whose store failed.",
    "lookups": "L2 adapter: chunks looked up.",
    "lookup_hits": "L2 adapter: chunks found by lookups.",
    "loaded_chunks": "L2 adapter: chunks loaded into LMCache buffers.",
    "load_misses": "L2 adapter: chunks a load could not serve.",
}.items()}
PLUGIN = {k: _counter(f"vericache_lmcache_{k}_total", doc) for k, doc in {
    "put_chunks": "LMCache plugin: chunks written to the store.",
    "put_errors": "LMCache plugin: chunk writes that failed.",
    "put_dropped": "LMCache plugin: chunk puts dropped (writer queue full).",
    "get_chunks": "LMCache plugin: chunks served to LMCache.",
    "get_misses": "LMCache plugin: chunk reads that missed.",
}.items()}


def render() -> str:
    """All metrics in the Prometheus text exposition format."""
    return generate_latest(registry).decode()


def serve(port: int, addr: str = "127.0.0.1") -> ThreadingHTTPServer:
    """Serve :data:`registry` on ``http://addr:port/metrics`` from a daemon thread; returns the
    server (``server.server_address`` has the port when ``port=0``; ``server.shutdown()`` stops it,
    ``server.server_close()`` releases the port).
    Raises ``OSError`` if the address cannot be bound."""
    server = ThreadingHTTPServer((addr, port), MetricsHandler.factory(registry))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="vericache-metrics", daemon=True).start()
    return server
