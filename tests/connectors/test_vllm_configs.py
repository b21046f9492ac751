"""The shipped vLLM JSON configs parse and vLLM's own config classes accept them."""

import importlib
import json
from pathlib import Path

import pytest

CONFIGS = Path(__file__).parents[2] / "configs"
pytest.importorskip("vllm")


def test_speculative_config_is_accepted_by_vllm():
    from vllm.config import SpeculativeConfig

    raw = json.loads((CONFIGS / "vllm-speculative.json").read_text())
    cfg = SpeculativeConfig(**raw)
    assert cfg.method == "custom_class" and cfg.num_speculative_tokens == raw["num_speculative_tokens"]
    module, cls = cfg.model.rsplit(".", 1)  # what vLLM's create_custom_proposer imports
    assert callable(getattr(importlib.import_module(module), cls).propose)


def test_kv_transfer_config_is_accepted_and_matches_the_lmcache_server():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from lmcache_vericache.cli.lmcache_config import server_argv

    raw = json.loads((CONFIGS / "vllm-kv-transfer.json").read_text())
    cfg = KVTransferConfig(**raw)
    assert cfg.kv_connector in KVConnectorFactory._registry and cfg.is_kv_transfer_instance
    extra = cfg.kv_connector_extra_config
    # The port `vericache lmcache-config --format server` (configs/README.md) starts the server on.
    argv = server_argv(json.loads((CONFIGS / "lmcache-server-l2.json").read_text()))
    assert extra["lmcache.mp.port"] == int(argv[argv.index("--port") + 1])
    assert extra["lmcache.mp.host"] == "tcp://" + argv[argv.index("--host") + 1]


def test_vericache_connector_config_is_accepted_and_its_class_loads():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from lmcache_vericache.cli.serve import connector_config
    from lmcache_vericache.connectors.vericache_connector import VeriCacheConnector, parse_extra_config

    raw = json.loads((CONFIGS / "vllm-vericache-connector.json").read_text())
    assert raw == connector_config()  # the shipped file is what `vericache serve` passes by default
    cfg = KVTransferConfig(**raw)
    assert cfg.kv_load_failure_policy == "recompute" and cfg.is_kv_transfer_instance
    assert KVConnectorFactory.get_connector_class(cfg) is VeriCacheConnector
    opts, store = parse_extra_config(cfg.kv_connector_extra_config)
    assert store.capacity == "disk" and opts.chunk_size % 128 == 0
