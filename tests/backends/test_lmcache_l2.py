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


# -- objects that are not KV (issue 45): stored whole, byte for byte -----------------------------------

#: Shapes / dtypes LMCache may hand an L2 adapter that are not this store's KV chunks: its own
#: ``lmcache bench l2`` objects (1-D uint8), other ranks and dtypes, KV-shaped objects of an integer
#: dtype or a width the head count (3) does not divide, empty and 0-d objects. The last is KV in a
#: dtype no compressor takes (fp8): stored as KV, full-only.
OPAQUE = [
    ((262144,), torch.uint8),
    ((3, 5), torch.float32),
    ((2, LAYERS, 7, 5), torch.bfloat16),
    ((2, LAYERS, 8, 6), torch.int8),
    ((LAYERS, 6, 10), torch.bool),
    ((17,), torch.int64),
    ((), torch.float64),
    ((0, 5), torch.float16),
]
FP8_KV = ((2, LAYERS, 4, 6), torch.float8_e4m3fn)


def random_object(shape: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes of ``shape``/``dtype`` (every bit pattern, NaNs included: compared as bytes)."""
    n = torch.empty(shape, dtype=dtype).element_size() * max(1, torch.Size(shape).numel())
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    return raw[: n if torch.Size(shape).numel() else 0].view(dtype).reshape(shape).clone()


def byte_obj(t: torch.Tensor) -> TensorMemoryObj:
    """``t`` as LMCache's allocators hand objects over: a 1-D byte buffer, viewed by the metadata's
    shape and dtype (``.tensor``)."""
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    meta = MemoryObjMetadata(t.shape, t.dtype, 0, raw.numel(), 1, fmt=MemoryFormat.KV_2LTD)
    return TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None)


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def store_all(adapter, batches: list[tuple[list[ObjectKey], list[torch.Tensor]]]) -> None:
    """Submit every batch at once (several store tasks in flight), then wait for all of them."""
    ids = {adapter.submit_store_task(keys, [byte_obj(t.clone()) for t in ts]) for keys, ts in batches}
    done: dict = {}
    deadline = time.monotonic() + 30
    while set(done) != ids and time.monotonic() < deadline:
        done.update(wait_for(adapter.get_store_event_fd(), adapter.pop_completed_store_tasks))
    assert set(done) == ids and all(r.is_successful() for r in done.values())


def lookup(adapter, keys: list[ObjectKey], desc: MemoryLayoutDesc | None = None) -> list[int]:
    """A lookup; with no ``desc`` the bench's placeholder layout (no shapes)."""
    tid = adapter.submit_lookup_and_lock_task(keys, {0: desc or MemoryLayoutDesc(shapes=[], dtypes=[])})
    return bits(wait_for(adapter.get_lookup_and_lock_event_fd(), lambda: adapter.query_lookup_and_lock_result(tid)),
                len(keys))


def load_all(adapter, batches: list[tuple[list[ObjectKey], list[TensorMemoryObj]]]) -> list[list[int]]:
    """Submit every load at once (several tasks in flight), then collect each task's bitmap."""
    ids = [adapter.submit_load_task(keys, objs) for keys, objs in batches]
    return [bits(wait_for(adapter.get_load_event_fd(), lambda t=t: adapter.query_load_result(t)), len(keys))
            for t, (keys, _) in zip(ids, batches)]


def sentinel(shape: tuple, dtype: torch.dtype) -> TensorMemoryObj:
    """A load buffer filled with a pattern no stored object has (0x5A bytes; bool: 0)."""
    t = torch.empty(shape, dtype=dtype)
    t.reshape(-1).view(torch.uint8).fill_(0 if dtype == torch.bool else 0x5A)
    return byte_obj(t)


def test_objects_that_are_not_kv_round_trip_byte_for_byte(adapter):
    objs = {i: random_object(shape, dtype, i) for i, (shape, dtype) in enumerate([*OPAQUE, FP8_KV])}
    ks = {i: key(100 + i) for i in objs}
    # Several store tasks in flight, several keys each, objects of different shapes mixed in a task.
    store_all(adapter, [([ks[i] for i in part], [objs[i] for i in part]) for part in ([0, 1, 2], [3, 4, 5], [6, 7, 8])])
    assert adapter.report_status()["stored_chunks"] == len(objs)
    assert adapter.report_status()["store"]["puts"] == 2 * len(OPAQUE) + 1  # each opaque object + its marker

    never = key(999)
    # No layout (as the bench looks up): the opaque objects' markers find them; KV needs its layout.
    assert lookup(adapter, [*ks.values(), never]) == [1] * len(OPAQUE) + [0, 0]
    for i, t in objs.items():  # with the layout, as LMCache's server looks up
        assert lookup(adapter, [ks[i], never], MemoryLayoutDesc([t.shape], [t.dtype])) == [1, 0]

    dst = {i: sentinel(t.shape, t.dtype) for i, t in objs.items()}
    results = load_all(adapter, [([ks[i] for i in part], [dst[i] for i in part])
                                 for part in ([8, 0], [1, 2, 3], [4, 5, 6, 7])])
    assert results == [[1, 1], [1, 1, 1], [1, 1, 1, 1]]
    for i, t in objs.items():
        assert as_bytes(dst[i].tensor) == as_bytes(t), OPAQUE[i] if i < len(OPAQUE) else FP8_KV

    # The store key binds shape and dtype: another object under the same ObjectKey is never served.
    src = objs[1]  # (3, 5) float32, 60 bytes
    for shape, dtype in [((5, 3), torch.float32), ((15,), torch.int32), ((60,), torch.uint8), ((3, 5), torch.int32)]:
        wrong = sentinel(shape, dtype)
        assert load_all(adapter, [([ks[1]], [wrong])]) == [[0]]
        assert as_bytes(wrong.tensor) == bytes([0x5A]) * 60
        assert lookup(adapter, [ks[1]], MemoryLayoutDesc([torch.Size(shape)], [dtype])) == [0]
    assert as_bytes(src) == as_bytes(objs[1])


def test_a_second_object_under_the_same_key_keeps_each_shape_apart(tmp_path):
    a = build_adapter(shipped_spec(disk_path=str(tmp_path / "kv")))
    try:
        small, big = random_object((64,), torch.uint8, 1), random_object((8, 8), torch.float32, 2)
        store_all(a, [([key(1)], [small])])
        store_all(a, [([key(1)], [big])])
        assert lookup(a, [key(1)]) == [1]  # the marker names the latest, which is stored
        out_small, out_big = sentinel((64,), torch.uint8), sentinel((8, 8), torch.float32)
        assert load_all(a, [([key(1)], [out_small]), ([key(1)], [out_big])]) == [[1], [1]]
        assert as_bytes(out_small.tensor) == as_bytes(small) and as_bytes(out_big.tensor) == as_bytes(big)
    finally:
        a.close()


DAMAGE = {
    "payload_bit": lambda d: d[:-40] + bytes([d[-40] ^ 0x01]) + d[-39:],
    "digest_bit": lambda d: d[:-1] + bytes([d[-1] ^ 0x80]),
    "truncated": lambda d: d[: len(d) // 2],
    "truncated_to_header": lambda d: d[:12],
    "empty": lambda d: b"",
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_object_on_disk_is_a_miss_never_wrong_bytes(tmp_path, damage):
    from lmcache_vericache.backends.store import FULL_SUFFIX

    a = build_adapter(shipped_spec(disk_path=str(tmp_path / "kv")))
    try:
        objs = [random_object((4096,), torch.uint8, 1), random_object((3, 33), torch.float16, 2)]
        store_all(a, [([key(1), key(2)], objs)])
        disk = a.store.capacity
        f = disk._file(a.key(key(1), objs[0].shape, objs[0].dtype) + FULL_SUFFIX)
        f.write_bytes(DAMAGE[damage](f.read_bytes()))

        dst = [sentinel((4096,), torch.uint8), sentinel((3, 33), torch.float16)]
        assert load_all(a, [([key(1), key(2)], dst)]) == [[0, 1]]
        assert as_bytes(dst[0].tensor) == bytes([0x5A]) * 4096  # untouched, not the damaged bytes
        assert as_bytes(dst[1].tensor) == as_bytes(objs[1])
        assert a.report_status()["store"]["corrupt"] == 1
        # The damaged value was deleted: lookups (with or without the layout) miss, a new store heals it.
        assert lookup(a, [key(1), key(2)]) == [0, 1]
        assert lookup(a, [key(1)], MemoryLayoutDesc([objs[0].shape], [objs[0].dtype])) == [0]
        store_all(a, [([key(1)], [objs[0]])])
        again = sentinel((4096,), torch.uint8)
        assert load_all(a, [([key(1)], [again])]) == [[1]] and as_bytes(again.tensor) == as_bytes(objs[0])

        # A damaged marker: the lookup without a layout misses; the object itself still loads.
        m = disk._file(a._mark_key(key(2)) + FULL_SUFFIX)
        m.write_bytes(DAMAGE[damage](m.read_bytes()))
        assert lookup(a, [key(1), key(2)]) == [1, 0]
        out = sentinel((3, 33), torch.float16)
        assert load_all(a, [([key(2)], [out])]) == [[1]] and as_bytes(out.tensor) == as_bytes(objs[1])
    finally:
        a.close()


def test_lookups_after_a_restart_find_what_the_disk_holds(tmp_path):
    spec = shipped_spec(disk_path=str(tmp_path / "kv"))
    objs = [random_object((262144,), torch.uint8, 1), random_object((5, 7), torch.int32, 2), chunk(3)]
    ks = [key(1), key(2), key(3)]
    first = build_adapter(spec)
    try:
        store_all(first, [(ks, objs)])
    finally:
        first.close()

    second = build_adapter(spec)  # a new adapter (a restarted server) over the same disk
    try:
        # Without a layout the markers find the opaque objects; the KV chunk needs its layout.
        assert lookup(second, [*ks, key(4)]) == [1, 1, 0, 0]
        for k, t in zip(ks, objs):
            assert lookup(second, [k, key(4)], MemoryLayoutDesc([t.shape], [t.dtype])) == [1, 0]
        dst = [sentinel(t.shape, t.dtype) for t in objs]
        assert load_all(second, [(ks, dst)]) == [[1, 1, 1]]
        for out, t in zip(dst, objs):
            assert as_bytes(out.tensor) == as_bytes(t)
    finally:
        second.close()


def test_lmcache_fault_inject_adapter_wraps_the_adapter(tmp_path):
    """LMCache's fault-injecting adapter (``type: fault_inject``) decorates a whole L2 adapter, not a
    capacity tier: built around this one by LMCache's parser, it drops the chosen loads and passes
    everything else through."""
    from lmcache.v1.distributed.l2_adapters.fault_inject_l2_adapter import FaultInjectL2Adapter

    spec = {"type": "fault_inject", "inner": shipped_spec(disk_path=str(tmp_path / "kv")), "gap_indices": [1]}
    a = build_adapter(spec)
    try:
        assert isinstance(a, FaultInjectL2Adapter) and isinstance(a._inner, VeriCacheL2Adapter)
        objs = [random_object((1024,), torch.uint8, i) for i in range(3)]
        ks = [key(i) for i in range(3)]
        store_all(a, [(ks, objs)])
        assert lookup(a, ks) == [1, 1, 1]  # lookups are not faulted
        dst = [sentinel((1024,), torch.uint8) for _ in ks]
        assert load_all(a, [(ks, dst)]) == [[1, 0, 1]]  # position 1 dropped: a miss to the caller
        assert as_bytes(dst[0].tensor) == as_bytes(objs[0]) and as_bytes(dst[2].tensor) == as_bytes(objs[2])
        status = a.report_status()
        assert status["fault_inject"]["gap_indices"] == [1] and status["loaded_chunks"] == 3
    finally:
        a.close()


def test_lmcache_bench_l2_stores_looks_up_and_loads_every_key(tmp_path):
    """LMCache's acceptance command for L2 adapters, as shipped, on the shipped JSON: every store,
    lookup and load succeeds and the loaded bytes are verified (``--no-skip-verify``)."""
    import subprocess
    import sys
    from pathlib import Path

    spec = shipped_spec(disk_path=str(tmp_path / "kv"))
    out = tmp_path / "bench.json"
    argv = [str(Path(sys.executable).with_name("lmcache")), "bench", "l2", "--l2-adapter", json.dumps(spec),
            "--num-keys", "4", "--in-flight", "2", "--rounds", "2", "--warmup-rounds", "1",
            "--data-size-kb", "16", "--lookup-max-hit-rate", "1.0", "--no-skip-verify",
            "--format", "json", "--output", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[Verify] All 8 keys data verified OK." in proc.stdout
    rounds = [line for line in proc.stdout.splitlines() if "Round" in line]
    assert len(rounds) == 9  # (1 warmup + 2) rounds of store, lookup, load
    for line in rounds:  # e.g. "  [Store] Round 1: 2.58 ms, success_keys=8/8"
        assert line.rstrip().endswith("=8/8"), line
    ops = {m["operation"]: m for name, m in json.loads(out.read_text())["metrics"].items() if name.startswith("op_")}
    assert set(ops) == {"Store", "Lookup", "Load"}
    for m in ops.values():
        assert m["total_keys"] == 16 and m["total_success"] == 16 and m["rounds_timed_out"] == 0
