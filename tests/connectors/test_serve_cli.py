"""``vericache serve --dry-run``: the vllm serve line it would exec, and option errors."""

import json

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


def test_serve_rejects_bad_options_naming_the_key(capsys):
    assert main(["serve", "--dry-run", "--model", "/m", "--window", "-3"]) == 2
    assert "vericache_proposer.window" in capsys.readouterr().err
    assert main(["serve", "--dry-run", "--model", "/m", "--max-draft", "9"]) == 2
    assert "max_draft" in capsys.readouterr().err
