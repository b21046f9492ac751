"""The MP adapter: built exactly as ``lmcache server`` builds it (its argument parser and plugin
factory) from configs/lmcache-server-l2.json, driven through the submit / eventfd / poll contract
over real disk and Redis tiers, and loaded by a real ``lmcache server`` process.

The data path through a running server is exercised end to end with vLLM in
tests/e2e/test_lmcache_mp_vllm.py.
"""

from __future__ import annotations

import argparse
import json
import select
import time

import pytest
import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args, parse_args_to_l2_adapters_config
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform.event_notifier import consume_fd

from lmcache_vericache.backends.lmcache.l2_adapter import VeriCacheL2Adapter
from lmcache_vericache.testing.servers import LMCacheServer, shipped_spec

LAYERS, HEADS, HEAD_DIM, CHUNK = 2, 3, 8, 256


def build_adapter(spec: dict) -> VeriCacheL2Adapter:
    """As the server does: ``--l2-adapter`` parsing, then LMCache's adapter factory."""
    args = add_l2_adapters_args(argparse.ArgumentParser()).parse_args(["--l2-adapter", json.dumps(spec)])
    return create_l2_adapter(parse_args_to_l2_adapters_config(args).adapters[0])


def key(i: int) -> ObjectKey:
    return ObjectKey(chunk_hash=i.to_bytes(8, "big"), model_name="vericache-test", kv_rank=0)


def memory_obj(t: torch.Tensor) -> TensorMemoryObj:
    meta = MemoryObjMetadata(t.shape, t.dtype, 0, t.numel() * t.element_size(), 1, fmt=MemoryFormat.KV_2LTD)
    return TensorMemoryObj(raw_data=t, metadata=meta, parent_allocator=None)


def chunk(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, LAYERS, CHUNK, HEADS * HEAD_DIM, generator=g).to(torch.bfloat16)


def wait_for(fd: int, poll_result, timeout: float = 30.0):
    """Wait the way LMCache's controllers do: poll the eventfd, drain it, query."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if poller.poll(200):
            consume_fd(fd)
        result = poll_result()
        if result:  # None (not done) or an empty dict (no store task finished yet)
            return result
    raise TimeoutError("adapter task did not complete")


def bits(bitmap, n: int) -> list[int]:
    on = set(bitmap.get_indices_list())
    return [int(i in on) for i in range(n)]


@pytest.fixture(params=["disk", "redis"])
def adapter(request, tmp_path):
    if request.param == "disk":
        params = {"disk_path": str(tmp_path / "kv")}
    else:
        server = request.getfixturevalue("redis_server")
        params = {"capacity": "redis", "redis_url": server.url, "redis_prefix": f"l2-test-{tmp_path.name}:"}
    a = build_adapter(shipped_spec(**params))
    yield a
    a.close()


def test_shipped_json_builds_the_adapter_with_three_distinct_eventfds(tmp_path):
    a = build_adapter(shipped_spec(disk_path=str(tmp_path / "kv")))
    try:
        assert isinstance(a, VeriCacheL2Adapter)
        fds = {a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd()}
        assert len(fds) == 3
        assert a.report_status()["is_healthy"]
    finally:
        a.close()
    a.close()  # idempotent
    assert not a.report_status()["is_healthy"]


def test_store_lookup_load_round_trip_is_bit_exact(adapter):
    data = [chunk(0), chunk(1)]
    src = [memory_obj(t.clone()) for t in data]
    store_id = adapter.submit_store_task([key(0), key(1)], src)
    done = wait_for(adapter.get_store_event_fd(), adapter.pop_completed_store_tasks)
    assert list(done) == [store_id] and done[store_id].is_successful()
    assert done[store_id].bytes_transferred() == sum(o.get_size() for o in src)
    assert adapter.pop_completed_store_tasks() == {}  # handed out once
    for obj in src:  # the caller owns its buffers again: the store must hold a copy
        obj.tensor.fill_(0)

    keys = [key(0), key(1), key(2)]
    # The server always passes the group's layout (it skips L2 lookups without one).
    lookup_id = adapter.submit_lookup_and_lock_task(keys, {0: MemoryLayoutDesc([data[0].shape], [data[0].dtype])})
    found = wait_for(
        adapter.get_lookup_and_lock_event_fd(), lambda: adapter.query_lookup_and_lock_result(lookup_id)
    )
    assert bits(found, 3) == [1, 1, 0]
    assert adapter.query_lookup_and_lock_result(lookup_id) is None  # exactly once
    adapter.submit_unlock(keys)

    dst = [memory_obj(torch.zeros_like(data[0])) for _ in keys]
    load_id = adapter.submit_load_task(keys, dst)
    loaded = wait_for(adapter.get_load_event_fd(), lambda: adapter.query_load_result(load_id))
    assert bits(loaded, 3) == [1, 1, 0]
    assert adapter.query_load_result(load_id) is None
    for obj, t in zip(dst, data):
        assert torch.equal(obj.tensor.view(torch.int16), t.view(torch.int16))
    assert not dst[2].tensor.any()

    status = adapter.report_status()
    assert status["stored_chunks"] == 2 and status["loaded_chunks"] == 2 and status["load_misses"] == 1
    assert status["store"]["full_hits"] == 2


def test_fused_kv_plane_objects_round_trip_bit_exact(adapter):
    """LMCache's single-plane layout ``[L, T, 2*W]`` (vLLM on CPU) is stored and loaded exactly."""
    fused = chunk(5).permute(1, 2, 0, 3).reshape(LAYERS, CHUNK, 2 * HEADS * HEAD_DIM).contiguous()
    store_id = adapter.submit_store_task([key(5)], [memory_obj(fused.clone())])
    assert wait_for(adapter.get_store_event_fd(), adapter.pop_completed_store_tasks)[store_id].is_successful()
    dst = memory_obj(torch.zeros_like(fused))
    load_id = adapter.submit_load_task([key(5)], [dst])
    assert bits(wait_for(adapter.get_load_event_fd(), lambda: adapter.query_load_result(load_id)), 1) == [1]
    assert torch.equal(dst.tensor.view(torch.int16), fused.view(torch.int16))


def test_load_into_a_buffer_of_another_shape_is_a_miss(adapter):
    store_id = adapter.submit_store_task([key(7)], [memory_obj(chunk(7))])
    assert wait_for(adapter.get_store_event_fd(), adapter.pop_completed_store_tasks)[store_id].is_successful()
    wrong = memory_obj(torch.zeros(2, LAYERS, CHUNK // 2, HEADS * HEAD_DIM, dtype=torch.bfloat16))
    load_id = adapter.submit_load_task([key(7)], [wrong])
    assert bits(wait_for(adapter.get_load_event_fd(), lambda: adapter.query_load_result(load_id)), 1) == [0]
    assert not wrong.tensor.any()


@pytest.mark.parametrize(
    "params, named",
    [
        ({"bogus_key": 1}, "bogus_key"),
        ({"capacity": "tape"}, "capacity"),
        ({"hot_bytes": "lots"}, "hot_bytes"),
        ({"num_kv_heads": None}, "num_kv_heads"),
    ],
)
def test_bad_adapter_params_raise_naming_the_key(tmp_path, params, named):
    spec = shipped_spec(disk_path=str(tmp_path / "kv"), **params)
    spec["adapter_params"] = {k: v for k, v in spec["adapter_params"].items() if v is not None}
    with pytest.raises(ValueError, match=named):
        build_adapter(spec)


def test_lmcache_server_runs_the_adapter(tmp_path):
    server = LMCacheServer(shipped_spec(disk_path=str(tmp_path / "kv")), tmp_path / "server.log")
    try:
        status = server.wait_ready().adapter_status()
        assert status["is_healthy"] and status["stored_chunks"] == 0
    finally:
        server.stop()
    assert server.proc.returncode is not None


def test_lmcache_server_refuses_bad_adapter_params(tmp_path):
    server = LMCacheServer(shipped_spec(disk_path=str(tmp_path / "kv"), bogus_key=1), tmp_path / "server.log")
    try:
        rc = server.proc.wait(90)
    finally:
        server.stop()
    assert rc != 0
    assert "unknown key 'bogus_key'" in server.output()


def test_cli_l2_json_builds_the_adapter(tmp_path, capsys):
    from lmcache_vericache.cli import main

    argv = [
        "lmcache-config",
        "--format",
        "l2-json",
        "--num-kv-heads",
        "3",
        "--disk-path",
        str(tmp_path / "kv"),
    ]
    assert main(argv) == 0
    adapter = build_adapter(json.loads(capsys.readouterr().out))
    try:
        assert isinstance(adapter, VeriCacheL2Adapter) and adapter.store.num_kv_heads == 3
    finally:
        adapter.close()


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--format", "l2-json"], "--num-kv-heads"),
        (["--capacity", "redis"], "redis_url"),
        (["--compressor-param", "bogus=1"], "bogus"),
    ],
)
def test_cli_rejects_bad_store_options(capsys, argv, named):
    from lmcache_vericache.cli import main

    assert main(["lmcache-config", *argv]) == 2
    assert named in capsys.readouterr().err
