"""One key scheme for three hosts: a prefix stored through one host is found, bit-exact, through
each of the others, on a real Redis server and on disk.

Hosts: the engine (``VeriCacheEngine``, keys from the tokens), the LMCache in-process plugin inside
a real ``LMCacheEngine`` (keys from LMCache's ``sha256_cbor`` chain, as the shipped YAML sets it),
and the L2 adapter fed the way the ``lmcache server`` feeds it (keys from LMCache's ``TokenHasher``,
``blake3`` by default). The engine speaks both chains (``hash_scheme``); LMCache in-process and the
LMCache server hash differently from each other (folded sha256 ints vs 32-byte digests), so that
pair gets different keys: the test shows the keys differ and nothing is served.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.multiprocess.token_hasher import TokenHasher

from lmcache_vericache.backends.lmcache.l2_adapter import VeriCacheL2Adapter, VeriCacheL2AdapterConfig
from lmcache_vericache.backends.lmcache.plugin import check_backend
from lmcache_vericache.engine import VeriCacheEngine
from lmcache_vericache.testing.lmcache_engine import Engines

YAML = Path(__file__).parents[2] / "configs" / "lmcache-vericache.yaml"
CHUNK, N_CHUNKS = 64, 3
MODEL_ID = "tiny-llama-seed0"  # the identity every host is configured with
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16  # tiny_llama
_ids = itertools.count()
SCHEME = {"plugin": "sha256_cbor", "l2": "blake3"}  # the chain each LMCache host computes


@pytest.fixture(params=["disk", "redis"])
def tier(request, tmp_path) -> dict:
    if request.param == "disk":
        return {"capacity": "disk", "disk_path": str(tmp_path / "kv")}
    server = request.getfixturevalue("redis_server")
    return {"capacity": "redis", "redis_url": server.url, "redis_prefix": f"xhost-{next(_ids)}:"}


@pytest.fixture
def lmcache_engines():
    harness = Engines(_metadata)
    yield harness
    harness.stop_all()


@pytest.fixture(scope="module")
def prompt_and_kv(tiny_model):
    """A prompt of 3 full chunks plus a tail, and the exact KV of its chunks ``[2, L, 3*C, H*D]``
    (computed by the engine itself into a private memory store)."""
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, 256, (N_CHUNKS * CHUNK + 17,), generator=g).tolist()
    with VeriCacheEngine(tiny_model, "int8", chunk_size=CHUNK) as eng:
        eng.generate([prompt], 2)
        chunks = [eng.store.get_full(k) for k in eng.chunk_keys(prompt)]
    assert len(chunks) == N_CHUNKS and all(c is not None for c in chunks)
    return prompt, torch.cat(chunks, dim=2)


def _metadata(cfg: LMCacheEngineConfig) -> LMCacheMetadata:
    return LMCacheMetadata(model_name="lmcache-name-not-used", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.float32,
                           kv_shape=(LAYERS, 2, cfg.chunk_size, KV_HEADS, HEAD_DIM), chunk_size=cfg.chunk_size)


class Host:
    """Stores a prompt's chunks through one host and finds them through it (``find`` returns the
    chunks it would serve, ``None`` for a miss)."""

    def __init__(self, name: str, tier: dict, peer: str, tiny_model, lmcache_engines: Engines) -> None:
        self.name, self.tier, self.model, self.engines = name, tier, tiny_model, lmcache_engines
        # The engine follows the LMCache host it shares with (it computes either chain).
        self.scheme = SCHEME.get(name) or SCHEME.get(peer, "blake3")

    # -- engine ---------------------------------------------------------------------------------
    def _engine(self) -> VeriCacheEngine:
        return VeriCacheEngine(self.model, "int8", chunk_size=CHUNK, draft_len=4,
                               store={**self.tier, "model_id": MODEL_ID, "hash_scheme": self.scheme})

    # -- LMCache in-process ---------------------------------------------------------------------
    def _lmcache(self, kv: torch.Tensor):
        cfg = LMCacheEngineConfig.from_file(str(YAML))
        cfg.chunk_size = CHUNK
        cfg.extra_config.update({f"vericache.{k}": v for k, v in self.tier.items()})
        cfg.extra_config["vericache.model_id"] = MODEL_ID
        engine, conn = self.engines.start(cfg, kv)
        return engine, conn, check_backend(engine)

    # -- LMCache server's L2 adapter ------------------------------------------------------------
    def _l2(self) -> VeriCacheL2Adapter:
        return VeriCacheL2Adapter(VeriCacheL2AdapterConfig.from_dict({**self.tier, "num_kv_heads": KV_HEADS}))

    @staticmethod
    def _object_keys(tokens: list[int]) -> list[ObjectKey]:
        hashes = TokenHasher(chunk_size=CHUNK, hash_algorithm="blake3").compute_chunk_hashes(tokens)
        return [ObjectKey(chunk_hash=h, model_name=MODEL_ID, kv_rank=0) for h in hashes]

    def store(self, prompt: list[int], kv: torch.Tensor) -> list[str]:
        """Store through this host; returns the store keys it used."""
        full = prompt[: N_CHUNKS * CHUNK]
        if self.name == "engine":
            with self._engine() as eng:
                [out] = eng.generate([prompt], 2)
                assert out.stats.cached_chunks == 0
                return eng.chunk_keys(prompt)
        if self.name == "plugin":
            engine, _, backend = self._lmcache(kv)
            engine.store(torch.tensor(full))
            backend.flush()
            assert backend.stats["put_chunks"] == N_CHUNKS
            keys = [backend.key(k) for _, _, k in engine.token_database.process_tokens(tokens=torch.tensor(full))]
            self.engines.stop_all()
            return keys
        adapter = self._l2()
        try:
            objs = [_memory_obj(kv[:, :, i * CHUNK:(i + 1) * CHUNK].clone()) for i in range(N_CHUNKS)]
            keys = self._object_keys(full)
            adapter._store(keys, objs)
            assert adapter.stats["stored_chunks"] == N_CHUNKS
            return [adapter.key(k, o.tensor.shape, o.tensor.dtype) for k, o in zip(keys, objs)]
        finally:
            adapter.close()

    def find(self, prompt: list[int], kv: torch.Tensor) -> list[torch.Tensor | None]:
        full = prompt[: N_CHUNKS * CHUNK]
        if self.name == "engine":
            with self._engine() as eng:
                found = [eng.store.get_full(k) for k in eng.chunk_keys(prompt)]
                if all(c is not None for c in found):  # and the engine really decodes from them
                    [out] = eng.generate([prompt], 8)
                    with VeriCacheEngine(self.model, "int8", chunk_size=CHUNK, store="resident") as ref:
                        [expected] = ref.reference([prompt], 8)
                    assert out.stats.cached_chunks == N_CHUNKS and out.stats.recomputed_chunks == 0
                    assert out.tokens == expected.tokens
                return found
        if self.name == "plugin":
            engine, conn, backend = self._lmcache(torch.zeros_like(kv))
            hit = engine.lookup(torch.tensor(full))
            if hit == 0:
                return [None] * N_CHUNKS
            assert hit == len(full) and bool(engine.retrieve(torch.tensor(full)).all())
            return [conn.out[:, :, i * CHUNK:(i + 1) * CHUNK].clone() for i in range(N_CHUNKS)]
        adapter = self._l2()
        try:
            keys = self._object_keys(full)
            desc = {0: MemoryLayoutDesc([torch.Size([2, LAYERS, CHUNK, KV_HEADS * HEAD_DIM])], [torch.float32])}
            hits = adapter._lookup(keys, desc).get_indices_list()
            dst = [_memory_obj(torch.zeros(2, LAYERS, CHUNK, KV_HEADS * HEAD_DIM)) for _ in keys]
            loaded = set(adapter._load(keys, dst).get_indices_list())
            assert set(hits) == loaded
            return [o.tensor if i in loaded else None for i, o in enumerate(dst)]
        finally:
            adapter.close()


def _memory_obj(t: torch.Tensor) -> TensorMemoryObj:
    meta = MemoryObjMetadata(t.shape, t.dtype, 0, t.numel() * t.element_size(), 1, fmt=MemoryFormat.KV_2LTD)
    return TensorMemoryObj(raw_data=t, metadata=meta, parent_allocator=None)


HOSTS = ("engine", "plugin", "l2")


@pytest.mark.parametrize("src,dst", [(a, b) for a in HOSTS for b in HOSTS if a != b])
def test_prefix_stored_by_one_host_is_found_by_another(src, dst, tier, tiny_model, lmcache_engines, prompt_and_kv):
    prompt, kv = prompt_and_kv
    writer = Host(src, tier, dst, tiny_model, lmcache_engines)
    reader = Host(dst, tier, src, tiny_model, lmcache_engines)
    written = writer.store(prompt, kv)
    found = reader.find(prompt, kv)
    if {src, dst} == {"plugin", "l2"}:
        # LMCache in-process (folded sha256 ints) and the LMCache server (blake3 digests) hash
        # the same tokens differently: different keys, so nothing, and nothing wrong, is served.
        assert all(c is None for c in found)
        other = Host(dst, tier, src, tiny_model, lmcache_engines)
        assert len(written) == N_CHUNKS and not set(written) & set(other.store(prompt, kv))
        return
    assert all(c is not None for c in found), f"{dst} missed chunks stored by {src}"
    for i, c in enumerate(found):
        assert torch.equal(c.view(torch.int32), kv[:, :, i * CHUNK:(i + 1) * CHUNK].contiguous().view(torch.int32))


def test_keys_bind_every_part_of_the_key_space(tiny_model):
    """Another model identity, dtype, chunk size, layout, hash scheme or compressor is another key."""
    from dataclasses import replace

    from lmcache_vericache.backends.keys import KeySpace

    base = KeySpace(model=MODEL_ID, dtype="float32", chunk_size=CHUNK, compressor="int8")
    variants = [replace(base, model="other"), replace(base, dtype="bfloat16"), replace(base, chunk_size=128),
                replace(base, layout="vllm_cpu_fused"), replace(base, scheme="sha256_cbor"),
                replace(base, compressor="int4"), replace(base, compressor_params={"group_size": 32})]
    keys = {space.key(b"\x01" * 32) for space in [base, *variants]}
    assert len(keys) == 1 + len(variants)
    engine_key = VeriCacheEngine(tiny_model, "int8", chunk_size=CHUNK).chunk_keys(list(range(CHUNK)))[0]
    other_model = VeriCacheEngine(tiny_model, "int8", chunk_size=CHUNK, model_id="x").chunk_keys(list(range(CHUNK)))[0]
    assert engine_key != other_model and engine_key.split("-")[1] == other_model.split("-")[1]


def test_fused_vllm_cpu_planes_are_never_served_to_the_engine(tier, tiny_model, prompt_and_kv):
    """vLLM-on-CPU's fused planes hold the same bytes under another layout: the L2 adapter files them
    under another key, so an engine with the same prompt finds nothing and recomputes."""
    prompt, kv = prompt_and_kv
    full = prompt[: N_CHUNKS * CHUNK]
    adapter = VeriCacheL2Adapter(VeriCacheL2AdapterConfig.from_dict({**tier, "num_kv_heads": KV_HEADS}))
    try:
        keys = Host._object_keys(full)
        fused = [kv[:, :, i * CHUNK:(i + 1) * CHUNK].permute(1, 2, 0, 3).reshape(LAYERS, CHUNK, -1).contiguous()
                 for i in range(N_CHUNKS)]
        adapter._store(keys, [_memory_obj(t) for t in fused])
        assert adapter.stats["stored_chunks"] == N_CHUNKS
    finally:
        adapter.close()
    with VeriCacheEngine(tiny_model, "int8", chunk_size=CHUNK, store={**tier, "model_id": MODEL_ID}) as eng:
        assert all(eng.store.get_full(k) is None for k in eng.chunk_keys(prompt))
        [out] = eng.generate([prompt], 4)
        assert out.stats.cached_chunks == 0
