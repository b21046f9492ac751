"""``vericache lmcache-config``: print the LMCache configuration that enables the dual-tier store.

LMCache 0.5.6 has no entry-point discovery for storage plugins, so this prints what to paste:

* ``--format yaml`` (default): the in-process engine's YAML (``storage_plugins`` +
  ``extra_config`` with ``vericache.*`` keys), for ``LMCACHE_CONFIG_FILE``;
* ``--format l2-json``: the ``--l2-adapter`` JSON for ``lmcache server`` (multiprocess mode);
* ``--format server``: the whole ``lmcache server`` command line with that adapter.

Store options are validated as the backend will validate them: a bad one exits with status 2
and a message naming it. See configs/README.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any

PLUGIN_NAME = "vericache"
INPROCESS_MODULE, INPROCESS_CLASS = "lmcache_vericache.backends.lmcache.plugin", "VeriCacheBackend"
L2_MODULE, L2_CLASS = "lmcache_vericache.backends.lmcache.l2_adapter", "VeriCacheL2Adapter"


def inprocess_config(params: dict[str, Any], *, chunk_size: int = 256, local_cpu_gb: float = 1) -> dict:
    """LMCache in-process engine config (what ``LMCacheEngineConfig.from_dict`` takes)."""
    extra = {
        f"storage_plugin.{PLUGIN_NAME}.module_path": INPROCESS_MODULE,
        f"storage_plugin.{PLUGIN_NAME}.class_name": INPROCESS_CLASS,
        **{f"{PLUGIN_NAME}.{k}": v for k, v in params.items()},
    }
    return {
        "chunk_size": chunk_size,
        # The prefix chain the engine and other hosts compute too (backends/keys.py); LMCache's
        # default (Python's hash) differs per process and would keep chunks private.
        "pre_caching_hash_algorithm": "sha256_cbor",
        "local_cpu": True,
        "max_local_cpu_size": local_cpu_gb,
        "storage_plugins": [PLUGIN_NAME],
        "extra_config": extra,
    }


def l2_adapter_spec(params: dict[str, Any]) -> dict:
    """The ``--l2-adapter`` object loading :class:`VeriCacheL2Adapter` with ``params``."""
    return {"type": "plugin", "module_path": L2_MODULE, "class_name": L2_CLASS, "adapter_params": params}


def server_argv(
    spec: dict,
    *,
    host: str = "127.0.0.1",
    port: int = 5555,
    http_port: int = 8080,
    chunk_size: int = 256,
    l1_size_gb: float = 1,
    skip_l1: bool = False,
) -> list[str]:
    """``lmcache server`` arguments for vLLM's ``LMCacheMPConnector`` on a CPU host as well as a
    GPU one (``engine_driven`` transfer is what works without CUDA IPC). ``skip_l1`` drops chunks
    from the server's memory once the adapter has them, so every hit is served by the adapter."""
    argv = ["lmcache", "server", "--host", host, "--port", str(port), "--http-host", host,
            "--http-port", str(http_port), "--chunk-size", str(chunk_size), "--l1-size-gb", str(l1_size_gb),
            "--eviction-policy", "LRU", "--supported-transfer-mode", "engine_driven",
            "--l2-adapter", json.dumps(spec)]  # fmt: skip
    return argv + (["--l2-store-policy", "skip_l1"] if skip_l1 else [])


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "lmcache-config",
        help="print the LMCache YAML / --l2-adapter JSON / lmcache server command for the store",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--format", choices=("yaml", "l2-json", "server"), default="yaml")
    s = p.add_argument_group("store (StoreConfig keys)")
    s.add_argument("--compressor", default="int8", help="compression method (default int8)")
    s.add_argument("--compressor-param", action="append", default=[], metavar="NAME=VALUE",
                   help="a method parameter; VALUE is parsed as JSON when it can be (repeatable)")  # fmt: skip
    s.add_argument("--capacity", choices=("disk", "redis", "redis_cluster", "memory"), default="disk")
    s.add_argument("--model-id", default=None,
                   help="model identity in chunk keys (default: the host's model name); set the same "
                        "value on every host that shares the store")
    s.add_argument("--disk-path", default="~/.cache/lmcache_vericache/kv",
                   help="private directory of the disk tier (default ~/.cache/lmcache_vericache/kv)")
    s.add_argument("--redis-url", default=None)
    s.add_argument("--redis-cluster-urls", default=None,
                   help="startup nodes of --capacity redis_cluster: redis://host:port,redis://host:port,...")
    s.add_argument("--hot-bytes", type=int, default=None, help="compressed chunks kept in memory")
    s.add_argument("--disk-max-bytes", type=int, default=None, help="byte cap of the disk tier (LRU eviction)")
    s.add_argument("--mac-key-env", default=None, metavar="VAR",
                   help="environment variable holding a shared secret: values are MAC-tagged and "
                        "values written without it are rejected")
    s.add_argument("--num-kv-heads", type=int, default=None,
                   help="the model's KV heads (required for --format l2-json/server; in-process reads the model)")  # fmt: skip
    lm = p.add_argument_group("LMCache")
    lm.add_argument(
        "--chunk-size", type=int, default=256, help="tokens per chunk (MP on CPU: a multiple of 128)"
    )
    lm.add_argument("--local-cpu-gb", type=float, default=1, help="in-process LocalCPU buffer (GB)")
    lm.add_argument("--host", default="127.0.0.1")
    lm.add_argument("--port", type=int, default=5555)
    lm.add_argument("--http-port", type=int, default=8080)
    lm.add_argument("--l1-size-gb", type=float, default=1)
    lm.add_argument("--skip-l1", action="store_true", help="server: serve every hit through the adapter")


def _params(args: argparse.Namespace) -> dict[str, Any]:
    cparams = {}
    for item in args.compressor_param:
        name, sep, raw = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--compressor-param {item!r}: expected NAME=VALUE")
        try:
            cparams[name] = json.loads(raw)
        except json.JSONDecodeError:
            cparams[name] = raw
    params: dict[str, Any] = {
        "compressor": args.compressor,
        "compressor_params": cparams,
        "capacity": args.capacity,
    }
    if args.capacity == "disk":
        params["disk_path"] = args.disk_path
    if args.redis_url is not None:
        params["redis_url"] = args.redis_url
    if args.redis_cluster_urls is not None:
        params["redis_cluster_urls"] = args.redis_cluster_urls
    for name in ("hot_bytes", "num_kv_heads", "model_id", "disk_max_bytes", "mac_key_env"):
        if getattr(args, name) is not None:
            params[name] = getattr(args, name)
    return params


def run(args: argparse.Namespace) -> int:
    import yaml

    from ..backends import StoreConfig

    try:
        params = _params(args)
        if args.format == "yaml":
            StoreConfig.parse(params, where="store options")  # num_kv_heads comes from the model
            cfg = inprocess_config(params, chunk_size=args.chunk_size, local_cpu_gb=args.local_cpu_gb)
            print(yaml.safe_dump(cfg, sort_keys=False), end="")
            return 0
        if "num_kv_heads" not in params:
            raise ValueError(
                "--num-kv-heads is required for the multiprocess server (it does not know the model)"
            )
        StoreConfig.parse(params, where="store options")
    except ValueError as e:
        print(f"vericache lmcache-config: {e}", file=sys.stderr)
        return 2
    spec = l2_adapter_spec(params)
    if args.format == "l2-json":
        print(json.dumps(spec))
    else:
        print(shlex.join(server_argv(spec, host=args.host, port=args.port, http_port=args.http_port,
                                     chunk_size=args.chunk_size, l1_size_gb=args.l1_size_gb,
                                     skip_l1=args.skip_l1)))  # fmt: skip
    return 0
