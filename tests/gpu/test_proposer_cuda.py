"""The proposer's draft path on a GPU without vLLM: a real runtime (SmolLM2's layout: 3 KV heads x
64, random weights) on CUDA, vLLM's paged KV in its CUDA layout with 16-token kernel blocks of
64-token blocks (``layout_caches``), the block table handed over each step as vLLM's input batch
holds it. With the ``none`` (identity) compressor a draft cache is the exact KV, so drafts must be
the model's own greedy continuation; a request moved to other blocks between steps is read there."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from packaging.version import Version

from lmcache_vericache.connectors import vllm_version
from lmcache_vericache.connectors.draft_sync import BlockTables
from lmcache_vericache.connectors.kv_layout import LogicalLayout
from lmcache_vericache.connectors.proposer import CompressedKVProposer
from lmcache_vericache.engine import Runtime
from lmcache_vericache.models import tiny_llama
from lmcache_vericache.testing.paged_caches import layout_caches
from lmcache_vericache.testing.paged_target import PagedTarget

K, VLLM_BLOCK, KERNEL_BLOCK = 4, 64, 16
SHAPE = dict(hidden_size=576, intermediate_size=384, num_hidden_layers=4, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, vocab_size=256)


def Target(rt: Runtime, layout, blocks: list[int], prompt: list[int]) -> PagedTarget:
    return PagedTarget(rt, layout, blocks, prompt, VLLM_BLOCK, capacity=2048)


def check_drafts(device: str, monkeypatch) -> None:
    monkeypatch.setattr(vllm_version, "vllm_version", lambda: Version("0.32.0"))
    torch.manual_seed(0)
    rt = Runtime(tiny_llama(seed=0, **SHAPE).to(device))
    caches = layout_caches("LBNHC", layers=rt.num_layers, heads=rt.num_kv_heads, head_size=rt.head_dim,
                           block_size=VLLM_BLOCK, num_blocks=32, kernel_block=KERNEL_BLOCK, device=device)
    layout = LogicalLayout(caches)
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=K),
                          model_config=SimpleNamespace(max_model_len=2048),
                          scheduler_config=SimpleNamespace(max_num_seqs=4),
                          additional_config={"vericache_proposer": {"compressor": "none", "adaptive": False}})
    p = CompressedKVProposer(cfg)
    table = np.zeros((4, 128), dtype=np.int32)
    p.attach(rt, lambda: BlockTables(table, KERNEL_BLOCK), layout)
    g = torch.Generator().manual_seed(1)
    a = Target(rt, layout, [1, 2, 3, 4], torch.randint(3, 256, (200,), generator=g).tolist())
    b = Target(rt, layout, [9, 10, 11, 12], torch.randint(3, 256, (150,), generator=g).tolist())

    def step(targets):
        rows = np.zeros((4, 2048), dtype=np.int32)
        table[:] = 0
        r = VLLM_BLOCK // KERNEL_BLOCK  # the input batch's table holds kernel block ids
        for i, t in enumerate(targets):
            rows[i, :len(t.tokens)] = t.tokens
            kb = [blk * r + j for blk in t.blocks for j in range(r)]
            table[i, :len(kb)] = kb
        n = np.array([len(t.tokens) for t in targets] + [0] * (4 - len(targets)), dtype=np.int32)
        return p.propose([[t.tokens[-1]] for t in targets], n, rows)

    assert step([a, b]) == [a.greedy(K), b.greedy(K)]
    a.accept(2)
    b.accept(K)
    assert step([a, b]) == [a.greedy(K), b.greedy(K)]
    for c in caches:  # a's old blocks hold garbage now: a step reading them drafts wrong tokens
        c[[kb for blk in a.blocks for kb in range(blk * 4, blk * 4 + 4)]] = 0
    a.move([20, 21, 22, 23])
    a.accept(1)
    assert step([b, a]) == [b.greedy(K), a.greedy(K)]


def test_drafts_on_a_cuda_block_table_with_kernel_blocks(compute, monkeypatch):
    check_drafts("cuda", monkeypatch)
