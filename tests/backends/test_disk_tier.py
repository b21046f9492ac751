"""The disk tier's private defaults, byte cap (LRU by access, shared directories), temp-file sweep and
fsync; and redaction of passwords in tier URLs. Real files, directories and servers throughout."""

from __future__ import annotations

import logging
import os
import stat
import time

import pytest

from lmcache_vericache.backends import StoreConfig
from lmcache_vericache.backends.tiers import DiskTier, TierError
from lmcache_vericache.backends.tiers.base import redact, scrub
from lmcache_vericache.backends.tiers.redis import RedisTier
from lmcache_vericache.testing.servers import ServerProcess, free_port, server_binary

TICK = 0.05  # more than a kernel timestamp tick, so file mtimes order like the operations


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def stored(path) -> dict[str, int]:
    """Sizes of the values on disk (temp files excluded)."""
    return {p.name: p.stat().st_size for p in path.iterdir() if p.suffix == ".kv" and not p.name.startswith(".")}


def test_created_directory_is_0700_and_files_0600_and_tilde_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    t = DiskTier("~/cache/kv")
    assert t.path == tmp_path / "cache" / "kv" and mode(t.path) == 0o700
    t.put("k", b"value")
    assert mode(t._file("k")) == 0o600 and bytes(t.get("k")) == b"value"


@pytest.mark.parametrize(("bits", "why"), [(0o777, "writable by others (mode 0777)"),
                                           (0o770, "writable by group (mode 0770)")])
def test_a_directory_others_can_write_is_refused(tmp_path, bits, why):
    d = tmp_path / "kv"
    d.mkdir()
    os.chmod(d, bits)
    with pytest.raises(TierError, match=rf"refusing directory {d}: {why.replace('(', '.').replace(')', '.')}"):
        DiskTier(d)
    os.chmod(d, 0o755)  # read-only for others: fine
    DiskTier(d).put("k", b"v")


def test_a_directory_owned_by_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("making a directory another user's needs root")
    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    os.chown(d, 12345, 12345)
    with pytest.raises(TierError, match=f"refusing directory {d}: owned by uid 12345"):
        DiskTier(d)


def test_puts_past_the_cap_evict_the_least_recently_used(tmp_path):
    t = DiskTier(tmp_path / "kv", max_bytes=300)
    for k in "abc":
        t.put(k, bytes(100))
    assert t.get("a") is not None  # a is now more recent than b and c
    t.put("d", bytes(100))
    assert t.get("b") is None and all(t.get(k) is not None for k in "acd")
    t.put("a", bytes(150))  # replacing a value: its old size is freed, c (now the oldest) goes
    assert t.get("c") is None and len(t.get("a")) == 150 and t.get("d") is not None
    assert sum(stored(t.path).values()) == 250
    with pytest.raises(TierError, match="301 bytes is larger than the tier's max_bytes 300"):
        t.put("huge", bytes(301))
    assert sorted(stored(t.path)) == sorted(t._file(k).name for k in "ad")  # a refused put evicts nothing
    for i in range(20):
        t.put(f"more{i}", bytes(70 + i))
        assert sum(stored(t.path).values()) <= 300


def test_restart_indexes_the_directory_and_evicts_by_mtime(tmp_path):
    t = DiskTier(tmp_path)
    now = time.time_ns()
    for age, k in enumerate("xyz"):
        t.put(k, bytes(100))
        os.utime(t._file(k), ns=(now - age * 10**9,) * 2)  # z oldest
    t2 = DiskTier(tmp_path, max_bytes=300)
    t2.put("w", bytes(100))
    assert t2.get("z") is None and all(t2.get(k) is not None for k in "xyw")


def test_a_second_tier_on_the_same_directory_sees_evictions_and_recency(tmp_path):
    a = DiskTier(tmp_path, max_bytes=300)  # never re-scans in this test: checks mtimes of its victims
    for k in "abc":
        a.put(k, bytes(100))
        time.sleep(TICK)
    b = DiskTier(tmp_path, max_bytes=300, sweep_s=0)  # re-scans on every put
    assert b.get("a") is not None  # bumps a's mtime, which a does not know
    time.sleep(TICK)
    a.put("d", bytes(100))  # a's oldest entry is "a", but it was used since: b is evicted
    assert b.get("b") is None and not b.contains("b")  # file gone = miss
    assert all(b.contains(k) for k in "acd") and a.get("b") is None  # (contains does not bump)
    time.sleep(TICK)
    b.put("e", bytes(100))  # b learns of d by its scan; c is now the least recently used
    assert a.get("c") is None and all(a.get(k) is not None for k in "ade")
    assert sum(stored(tmp_path).values()) == 300


def test_temp_files_are_not_values_and_stale_ones_are_swept_by_a_later_put(tmp_path):
    t = DiskTier(tmp_path, max_bytes=300, stale_tmp_s=5, sweep_s=0.5)
    stale, live = tmp_path / ".dead.kv.1.2.tmp", tmp_path / ".live.kv.3.4.tmp"
    for p in (stale, live):
        p.write_bytes(bytes(250))
    os.utime(stale, (time.time() - 60,) * 2)  # a crashed writer's, a minute old
    for k in "abc":  # temp files count against nothing and are never evicted
        t.put(k, bytes(100))
    assert stale.exists() and live.exists() and all(t.get(k) is not None for k in "abc")
    time.sleep(0.6)
    t.put("d", bytes(10))
    assert not stale.exists() and live.exists()


def test_fsync_puts_survive_a_restart(tmp_path):
    t = DiskTier(tmp_path, fsync=True, max_bytes=1000)
    t.put("k", b"durable")
    t.close()
    assert bytes(DiskTier(tmp_path, fsync=True).get("k")) == b"durable"


def test_store_config_passes_disk_max_bytes(tmp_path):
    cfg = StoreConfig.parse({"capacity": "disk", "disk_path": str(tmp_path), "disk_max_bytes": 300})
    tier = cfg.build_capacity()
    assert isinstance(tier, DiskTier) and tier.max_bytes == 300
    with pytest.raises(ValueError, match="^store config: disk_max_bytes must be > 0, got 0"):
        StoreConfig.parse({"capacity": "disk", "disk_path": str(tmp_path), "disk_max_bytes": 0})


# -- passwords in URLs ------------------------------------------------------------------------------
def test_redact():
    assert redact("redis://u:topsecret@h:6379/0") == "redis://u:***@h:6379/0"
    assert redact("rediss://:p@ss@[::1]:6/0?x=a@b") == "rediss://:***@[::1]:6/0?x=a@b"
    for url in ("redis://h:6379/0", "redis://user@h/0", "lm://h:1", "not a url"):
        assert redact(url) == url
    assert scrub(OSError("AUTH topsecret failed"), "redis://u:topsecret@h/0") == "AUTH *** failed"


def _no_secret(caplog, *texts: object) -> None:
    logged = [r.getMessage() for r in caplog.records] + [str(r.exc_info[1]) for r in caplog.records if r.exc_info]
    assert logged or texts
    for text in [*map(str, texts), *logged]:
        assert "topsecret" not in text, text


def test_a_failing_redis_connect_never_shows_the_password(caplog):
    url = f"redis://u:topsecret@127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.DEBUG), pytest.raises(TierError, match=r"cannot reach redis://u:\*\*\*@127") as e:
        RedisTier(url)
    _no_secret(caplog, e.value, StoreConfig(capacity="redis", redis_url=url))
    with pytest.raises(TierError) as bad:
        RedisTier("http://u:topsecret@127.0.0.1:1/0")
    _no_secret(caplog, bad.value)


def test_a_redis_server_going_away_never_shows_the_password(caplog):
    binary = server_binary()
    if binary is None:
        pytest.skip("no redis-server/valkey-server binary")
    port = free_port()
    server = ServerProcess([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                            "--requirepass", "topsecret"], port)
    try:
        tier = RedisTier(f"redis://default:topsecret@127.0.0.1:{port}/0", connect_timeout=0.5)
        tier.put("k", b"v")
        assert tier.get("k") == b"v" and "***" in repr(tier)
    finally:
        server.stop()
    with caplog.at_level(logging.DEBUG), pytest.raises(TierError, match="SET") as e:
        tier._errors._interval = 0  # log every failure, not one per 5 s
        assert tier.get("k") is None and not tier.contains("k")
        tier.delete("k")
        tier.put("k", b"v")
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) >= 3
    _no_secret(caplog, e.value, repr(tier))
    tier.close()
