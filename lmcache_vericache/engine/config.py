"""The engine's configuration: what :class:`~.vericache_engine.VeriCacheEngine` is built with.

:class:`EngineConfig` is frozen and validated when it is made, before any model work (a bad option
costs no kernel build and no weight hashing). :func:`resolve_store` turns the engine's ``store``
argument into the store config (compressor, key and decoding settings) and the store itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import compressors
from ..backends import DualTierStore, StoreConfig
from .horizon import DraftLen, check_draft_len
from .residency import check_residency

DECODING_KEYS = ("mode", "kvfetch_draft", "epsilon", "delta", "sketch_bits")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's own options (the store's are a :class:`StoreConfig`).

    ``chunk_size``: tokens per stored chunk. ``draft_len``: drafts per round (an int, or ``"auto"``:
    :class:`~.horizon.Horizon` chooses per round, at most ``max_draft_len``). ``stagger``: whether
    requests draft and verify on their own schedules (``"auto"``: only in offload). ``query_window``:
    newest exact tokens kept out of compression. ``full_kv``, ``kv_budget_bytes``, ``verify_buffers``:
    residency (:mod:`~.residency`). ``int8_draft``: int8 prefixes attended as codes by the CPU kernel,
    ``triton_draft``: prefixes kept as stored chunks, attended by the Triton kernels (GPU),
    ``codebook_draft``: TurboQuant prefixes attended as codes by the CPU kernel (``None``: where
    possible). ``model_id``: the key space's model identity (``None``: a digest of the weights).
    """

    chunk_size: int = 256
    draft_len: DraftLen = 16
    max_draft_len: int = 64
    stagger: bool | str = "auto"
    query_window: int = 32
    full_kv: str = "auto"
    kv_budget_bytes: int | None = None
    verify_buffers: int | None = None
    int8_draft: bool | None = None
    model_id: str | None = None
    triton_draft: bool | None = None
    codebook_draft: bool | None = None

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        check_draft_len(self.draft_len, self.max_draft_len)
        check_stagger(self.stagger)
        check_residency(self.full_kv, self.kv_budget_bytes, self.verify_buffers)
        for name in ("int8_draft", "triton_draft", "codebook_draft"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True, False or None (auto), got {getattr(self, name)!r}")
        if self.triton_draft and (self.int8_draft or self.codebook_draft):
            on = [n for n in ("int8_draft", "codebook_draft") if getattr(self, n)][0]
            raise ValueError(f"{on} and triton_draft are two ways to attend a draft prefix: set one")

    def capacity(self, prompt_len: int, max_new: int) -> int:
        """Cache entries one request needs: prompt, new tokens, the longest round's drafts and the
        verify block's extra token."""
        return prompt_len + max_new + self.max_draft_len + 2


def check_device(model: Any, device: Any) -> None:
    """Refuse a ``device`` the engine cannot run on: unknown, unavailable, or not where every weight
    of ``model`` is (``None``: wherever the model is, one device)."""
    import torch

    where = {p.device for p in model.parameters()}
    if len(where) > 1:
        raise ValueError(f"the model's weights are on several devices {sorted(map(str, where))}; the engine "
                         "runs on one")
    if device is None:
        return
    try:
        want = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}") from e
    if want.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: no CUDA device is available (torch.cuda.is_available() is False)")
    [have] = where or {torch.device("cpu")}
    if have.type != want.type or (want.index is not None and have.index != want.index):
        raise ValueError(f"device={device!r} but the model's weights are on {have}; move the model first "
                         f"(model.to({str(want)!r})) or pass device=None")


def check_stagger(stagger: Any) -> bool | str:
    if not (isinstance(stagger, bool) or stagger == "auto"):
        raise ValueError(f"stagger must be True, False or 'auto', got {stagger!r}")
    return stagger


def decoding_options(mode: str | None, verkv: Mapping[str, Any] | None) -> dict[str, Any]:
    """The store config's decoding keys from the engine's ``mode`` and ``verkv`` arguments."""
    if verkv is not None and not isinstance(verkv, Mapping):
        raise ValueError(f"verkv must be a mapping of VerKV options, got {type(verkv).__name__}")
    decoding = dict(verkv or {}) | ({} if mode is None else {"mode": mode})
    unknown = set(decoding) - set(DECODING_KEYS)
    if unknown:
        raise ValueError(f"verkv: unknown option(s) {sorted(unknown)}; known: {', '.join(DECODING_KEYS[1:])}")
    return decoding


def resolve_store(store: Any, compressor: str | None, params: dict[str, Any] | None, decoding: dict[str, Any],
                  heads: int) -> tuple[StoreConfig, DualTierStore | None, bool]:
    """``(config, store, owned)`` for the engine's ``store`` argument. The config names the
    compressor, key and decoding settings in every case; ``owned``: the engine made the store and
    closes it (a :class:`DualTierStore` passed in belongs to the caller)."""
    if isinstance(store, DualTierStore):
        ours = store.compressor
        given = compressors.get(compressor, **(params or {})) if compressor is not None else ours
        if (given.name, given.params()) != (ours.name, ours.params()):
            raise ValueError(f"compressor {compressor} {params or {}} differs from the store's {ours.name} "
                             f"{ours.params()}; pass compressor=None to use the store's")
        if store.num_kv_heads != heads:
            raise ValueError(f"store has num_kv_heads={store.num_kv_heads}, the model {heads}")
        config = StoreConfig.parse({"compressor": ours.name, "num_kv_heads": heads,
                                    "compressor_params": ours.params(), **decoding}, where="VeriCacheEngine")
        return config, store, False
    if isinstance(store, str) and store != "resident":
        raise ValueError(f"store must be a DualTierStore, a StoreConfig, a mapping or 'resident', got {store!r}")
    values = {} if store in (None, "resident") else store_fields(store)
    if compressor is not None:
        values["compressor"] = compressor
    if params is not None:
        values["compressor_params"] = params
    values.update(decoding)
    config = StoreConfig.parse(values, where="VeriCacheEngine store config").with_heads(heads)
    if store == "resident":
        return config, None, False
    return config, config.build(), True


def store_fields(config: StoreConfig | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(config, StoreConfig):
        return dict(vars(config))
    if not isinstance(config, Mapping):
        raise ValueError(f"store config must be a StoreConfig or a mapping, got {type(config).__name__}")
    return dict(config)
