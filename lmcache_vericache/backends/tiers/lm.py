"""LMCache's own cache server (``python -m lmcache.v1.server HOST PORT cpu``, URL ``lm://host:port``)."""

from __future__ import annotations

import hashlib
import logging
import socket
import struct
import threading
from dataclasses import replace
from urllib.parse import urlparse

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.protocol import ClientCommand, ClientMetaMessage, ServerMetaMessage, ServerReturnCode

from .base import Blob, CapacityTier, ErrorLog, TierError, check_key, redact

logger = logging.getLogger(__name__)

_KEY_LEN = struct.Struct("<H")


class LMServerTier(CapacityTier):
    """Values on an LMCache server, spoken to with LMCache's wire messages (``lmcache.v1.protocol``).

    The server keys values by ``CacheEngineKey``, so a tier key maps to one under the model name
    ``namespace`` with ``chunk_hash`` = 64 bits of blake2b(key); each value starts with its own key,
    checked on read, so a hash collision is a miss, never another chunk. The server replaces a
    value only after receiving all of it (atomic puts); it has no delete, so ``delete`` stores an
    empty value that reads as a miss (``contains`` may still report it). One socket per calling
    thread; a failed socket is dropped and the next call reconnects. Not built on LMCache's
    ``LMCServerConnector`` for the reasons given in ``RedisTier``: it needs a ``LocalCPUBackend``
    and moves fixed-shape ``MemoryObj``\\ s.
    """

    name = "lm"

    def __init__(self, url: str, *, namespace: str = "vericache", timeout: float = 5.0) -> None:
        u = urlparse(url)
        if u.scheme != "lm" or not u.hostname or not u.port:
            raise TierError(f"lm tier: bad url {redact(url)!r}, expected lm://host:port")
        self.url, self.namespace, self.timeout = url, namespace, timeout
        self._shown = redact(url)
        self._addr = (u.hostname, u.port)
        self._local = threading.local()
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._errors = ErrorLog(logger)
        self._closed = False
        try:
            self._request(ClientCommand.HEALTH, "health")
        except OSError as e:
            raise TierError(f"lm tier: cannot reach {self._shown}: {e}") from e

    # -- wire ---------------------------------------------------------------------------------------
    def _cache_key(self, key: str) -> CacheEngineKey:
        h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
        return CacheEngineKey(self.namespace, 1, 0, h, torch.uint8)

    def _sock(self) -> socket.socket:
        s = getattr(self._local, "sock", None)
        if s is None:
            s = socket.create_connection(self._addr, timeout=self.timeout)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local.sock = s
            with self._lock:
                self._socks.add(s)
        return s

    def _drop(self) -> None:
        s = getattr(self._local, "sock", None)
        self._local.sock = None
        if s is not None:
            with self._lock:
                self._socks.discard(s)
            s.close()

    def _recv(self, s: socket.socket, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            r = s.recv_into(view[got:])
            if r == 0:
                raise ConnectionError("server closed the connection")
            got += r
        return buf

    def _request(self, cmd: ClientCommand, key: str, payload: bytes = b"") -> ServerMetaMessage:
        """One exchange on this thread's socket; raises OSError (socket dropped) on any failure."""
        meta = ClientMetaMessage(cmd, self._cache_key(key), len(payload), MemoryFormat.BINARY, torch.uint8,
                                 torch.Size([len(payload), 0, 0, 0]))
        try:
            s = self._sock()
            s.sendall(meta.serialize())
            if cmd == ClientCommand.PUT:
                # The server does not answer a PUT; an EXIST on the same connection is answered only
                # after the PUT was stored, which gives read-after-write from any other connection.
                s.sendall(payload)
                s.sendall(replace(meta, command=ClientCommand.EXIST, length=0).serialize())
            return ServerMetaMessage.deserialize(self._recv(s, ServerMetaMessage.packlength()))
        except (OSError, struct.error, ValueError) as e:
            self._drop()
            raise OSError(str(e)) from e

    # -- contract -------------------------------------------------------------------------------
    def put(self, key: str, data: Blob) -> None:
        check_key(key)
        if self._closed:
            raise TierError(f"lm tier {self._shown}: put {key!r} after close")
        k = key.encode()
        self._store(key, b"".join((_KEY_LEN.pack(len(k)), k, data)), len(data))

    def _store(self, key: str, payload: bytes, size: int) -> None:
        try:
            ack = self._request(ClientCommand.PUT, key, payload)
            if ack.code != ServerReturnCode.SUCCESS:
                raise OSError("server did not store the value")
        except OSError as e:
            raise TierError(f"lm tier {self._shown}: PUT {key!r} ({size} bytes) failed: {e}") from e

    def get(self, key: str) -> bytes | None:
        check_key(key)
        if self._closed:
            return None
        try:
            reply = self._request(ClientCommand.GET, key)
            if reply.code != ServerReturnCode.SUCCESS:
                return None
            value = self._recv(self._sock(), reply.length)
        except OSError as e:
            self._drop()
            self._errors("lm tier %s: GET %r failed: %s", self._shown, key, e)
            return None
        k = key.encode()
        head = _KEY_LEN.size + len(k)
        if len(value) < head or value[_KEY_LEN.size:head] != k:
            return None  # deleted (empty) or a 64-bit hash collision: not this key's value
        return value[head:]

    def contains(self, key: str) -> bool:
        check_key(key)
        if self._closed:
            return False
        try:
            reply = self._request(ClientCommand.EXIST, key)
        except OSError as e:
            self._errors("lm tier %s: EXIST %r failed: %s", self._shown, key, e)
            return False
        return reply.code == ServerReturnCode.SUCCESS

    def delete(self, key: str) -> None:
        check_key(key)
        try:
            self._store(key, b"", 0)  # unframed empty value: reads as a miss
        except TierError as e:
            self._errors("lm tier %s: delete %r failed: %s", self._shown, key, e)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            socks, self._socks = self._socks, set()
        for s in socks:
            s.close()
