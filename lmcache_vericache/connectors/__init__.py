"""vLLM integration: the KV connector (:mod:`.vericache_connector`, the dual-tier store on vLLM's
data path), the compressed-KV drafting proposer (:mod:`.proposer`, ``--speculative-config``) and
the layout strategy both read vLLM's paged KV with (:mod:`.kv_layout`: the CPU backend's probed
tiles, :mod:`.paged_layout`, or vLLM's logical view on a GPU), and the host <-> device ordering
of the connector's copies (:mod:`.device_io`)."""

from __future__ import annotations

import logging


class _ToVllmLog(logging.Handler):
    """Hands each record to vLLM's ``vllm`` logger, whatever handlers vLLM configures later."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def _show_package_logs_in_vllm() -> None:
    """The host-independent loggers (``lmcache_vericache.*``: store, tiers) through vLLM's log, so
    a tier's failed reads show in it with their level and file (without a handler Python prints
    bare messages to stderr). Left alone if the application configured logging itself."""
    pkg = logging.getLogger("lmcache_vericache")
    if logging.getLogger().handlers or any(isinstance(h, _ToVllmLog) for h in pkg.handlers):
        return
    pkg.addHandler(_ToVllmLog())
    pkg.propagate = False  # vLLM's logger is the one place these records go


_show_package_logs_in_vllm()
