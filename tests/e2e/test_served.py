"""End to end as a user serves it: ``vericache serve`` (both flags: the VeriCache KV connector over a
private disk store, and the compressed-KV proposer) answering an OpenAI-style client.

A long prompt is sent twice, vLLM's own prefix cache emptied in between (``/reset_prefix_cache``,
a dev-mode route), so the second answer is served from the store: both answers equal plain vLLM's
greedy answer, and the server's ``/metrics`` shows the connector's counters (the hit, the loaded
chunks) beside vLLM's own. A few minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from lmcache_vericache.testing.servers import free_port
from lmcache_vericache.testing.vllm_harness import run_engine

pytestmark = pytest.mark.e2e
CHUNK, PROMPT, NEW = 256, 1100, 24


def _http(url: str, body: dict | None = None, timeout: float = 300) -> str:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def _metric(text: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (over its labels) in a ``/metrics`` page."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoTokenizer

    from lmcache_vericache.data import prompt_ids, stdlib_source
    from lmcache_vericache.models import ensure_smollm2

    tmp = tmp_path_factory.mktemp("served")
    model = str(ensure_smollm2())
    prompt = prompt_ids(AutoTokenizer.from_pretrained(model), stdlib_source("argparse.py"), PROMPT).tolist()
    port = free_port()
    store = {"capacity": "disk", "disk_path": str(tmp / "kv"), "chunk_size": CHUNK}
    cmd = [str(Path(sys.executable).parent / "vericache"), "serve", "--port", str(port), "--num-speculative-tokens",
           "8", "--store-config", json.dumps(store), "--", "--enforce-eager", "--max-num-seqs", "4", "--seed", "0"]
    log = open(tmp / "server.log", "wb")
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "TOKENIZERS_PARALLELISM": "false"}
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            assert server.poll() is None, (tmp / "server.log").read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "server not up in 900 s"
            try:
                _http(url + "/health", timeout=5)
                break
            except OSError:
                time.sleep(2)
        body = {"model": model, "prompt": prompt, "max_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
        first = json.loads(_http(url + "/v1/completions", body))["choices"][0]["text"]
        _http(url + "/reset_prefix_cache", {})  # vLLM forgets the prefix; the store still has it
        second = json.loads(_http(url + "/v1/completions", body))["choices"][0]["text"]
        time.sleep(2)  # stats reach the metrics on the engine's next report
        metrics = _http(url + "/metrics")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(30)
        log.close()
    plain = run_engine({"llm": {"model": model, "dtype": "float32", "max_model_len": 4096, "seed": 0,
                                "enforce_eager": True, "max_num_seqs": 4},
                        "jobs": [{"name": "p", "prompts": [prompt],
                                  "sampling": {"temperature": 0.0, "max_tokens": NEW, "ignore_eos": True}}]},
                       tmp / "plain")
    from transformers import AutoTokenizer as Tok

    want = Tok.from_pretrained(model).decode(plain["jobs"]["p"]["tokens"][0])
    return {"first": first, "second": second, "want": want, "metrics": metrics, "log": tmp / "server.log"}


def test_both_answers_equal_plain_vllm(served):
    assert served["first"] == served["want"]
    assert served["second"] == served["want"]  # served from the store, drafted and verified


def test_metrics_show_the_connectors_hit(served):
    m = served["metrics"]
    hit = _metric(m, "vllm:vericache_hit_tokens_total")
    assert hit >= (PROMPT - 1) // CHUNK * CHUNK, [ln for ln in m.splitlines() if "vericache" in ln][:40]
    assert _metric(m, "vllm:vericache_loaded_chunks_total") >= (PROMPT - 1) // CHUNK
    assert _metric(m, "vllm:vericache_saved_chunks_total") >= PROMPT // CHUNK  # the first answer stored it
    assert _metric(m, "vllm:vericache_failed_chunks_total") == 0
    assert _metric(m, "vllm:prompt_tokens_total") > 0  # beside vLLM's own
