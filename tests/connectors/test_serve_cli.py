"""``vericache serve --dry-run``: the vllm serve line it would exec, and option errors."""

import json
from pathlib import Path

from lmcache_vericache.cli import main


def _argv(capsys, *args):
    assert main(["serve", "--dry-run", "--model", "/m", *args]) == 0
    import shlex

    return shlex.split(capsys.readouterr().out.strip().splitlines()[-1])


def test_serve_builds_the_vllm_command(capsys):
    argv = _argv(capsys, "--compressor", "kivi", "--compressor-params", '{"bits": 2}', "--lmcache",
                 "--lmcache-port", "6000", "--", "--max-num-seqs", "4")
    assert argv[argv.index("-m") + 1:argv.index("-m") + 4] == ["vllm.entrypoints.openai.api_server", "--model", "/m"]
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "custom_class" and spec["model"].endswith("CompressedKVProposer")
    extra = json.loads(argv[argv.index("--additional-config") + 1])["vericache_proposer"]
    assert extra["compressor"] == "kivi" and extra["compressor_params"] == {"bits": 2}
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "LMCacheMPConnector" and kv["kv_connector_extra_config"]["lmcache.mp.port"] == 6000
    assert argv[-2:] == ["--max-num-seqs", "4"]
    # the proposer reads the store of the shipped L2 adapter JSON (the server's)
    l2 = json.loads((Path(__file__).parents[2] / "configs" / "lmcache-server-l2.json").read_text())
    assert extra["lmcache_store"] == l2["adapter_params"] and extra["lmcache_chunk_size"] == 256


def test_serve_rejects_a_bad_l2_json_or_store_key(capsys, tmp_path):
    bad = tmp_path / "l2.json"
    bad.write_text("{}")
    assert main(["serve", "--dry-run", "--model", "/m", "--lmcache", "--lmcache-l2", str(bad)]) == 2
    assert "--lmcache-l2" in capsys.readouterr().err
    bad.write_text(json.dumps({"adapter_params": {"capacity": "tape"}}))
    assert main(["serve", "--dry-run", "--model", "/m", "--lmcache", "--lmcache-l2", str(bad)]) == 2
    assert "vericache_proposer.lmcache_store.capacity" in capsys.readouterr().err


def test_serve_rejects_bad_options_naming_the_key(capsys):
    assert main(["serve", "--dry-run", "--model", "/m", "--window", "-3"]) == 2
    assert "vericache_proposer.window" in capsys.readouterr().err
    assert main(["serve", "--dry-run", "--model", "/m", "--max-draft", "17"]) == 2
    assert "max_draft" in capsys.readouterr().err


def test_serve_puts_connector_and_proposer_on_one_command_line(capsys):
    argv = _argv(capsys, "--store-config", '{"capacity": "redis", "redis_url": "redis://127.0.0.1:6379", "draft_tokens": 24}')
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "VeriCacheConnector" and kv["kv_load_failure_policy"] == "recompute"
    assert kv["kv_connector_extra_config"]["draft_tokens"] == 24
    assert "--speculative-config" in argv  # both flags
    assert json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"] == 16
    plain = _argv(capsys, "--no-connector", "--no-proposer")
    assert "--kv-transfer-config" not in plain and "--speculative-config" not in plain


def test_serve_rejects_a_bad_store_key_before_starting_vllm(capsys):
    assert main(["serve", "--dry-run", "--model", "/m", "--store-config", '{"capacity": "disk", "disk_pth": "/x"}']) == 2
    err = capsys.readouterr().err
    assert "kv_connector_extra_config: unknown key 'disk_pth'" in err and "disk_path" in err
