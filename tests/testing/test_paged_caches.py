"""The vLLM-free cache builder equals vLLM's own ``allocate_kv_cache`` for every layout, kernel
block split and dtype: shape, strides, storage offset and the bytes each layer addresses."""

import pytest
import torch

from lmcache_vericache.testing.paged_caches import LAYOUTS, layout_caches, splittable, vllm_caches

pytest.importorskip("vllm")
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

CASES = [(name, kb) for name in LAYOUTS for kb in (None, 16) if kb is None or splittable(name)]


def test_layouts_are_vllms():
    assert {m.name: m.value for m in KVCacheLayout} == LAYOUTS


@pytest.mark.parametrize("layout,kernel_block", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_builder_equals_vllm_allocate_kv_cache(layout, kernel_block, dtype):
    shape = dict(layers=3, heads=2, head_size=32, block_size=64, num_blocks=5, kernel_block=kernel_block, dtype=dtype)
    ours = layout_caches(layout, **shape, seed=None)
    theirs = vllm_caches(KVCacheLayout[layout], **shape)
    for a, b in zip(ours, theirs):
        assert (a.shape, a.stride(), a.storage_offset()) == (b.shape, b.stride(), b.storage_offset())
        assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes()


@pytest.mark.parametrize("layout", [n for n in LAYOUTS if not splittable(n)])
def test_unsplittable_layout_is_refused_as_vllm_refuses_it(layout):
    shape = dict(layers=2, heads=2, head_size=32, block_size=64, num_blocks=2, kernel_block=16)
    with pytest.raises(ValueError):
        vllm_caches(KVCacheLayout[layout], **shape)
    with pytest.raises(ValueError, match="cannot be split"):
        layout_caches(layout, **shape)
