"""What one key keeps stored, of one kind, against its bounds (``lua/storage_account.lua``).

A key's files (bytes on the disk every key shares) and its stored responses (bytes
in Redis) each have an account: an object's room is reserved before it is written
(a refusal writes nothing, and concurrent writers cannot overshoot the bound), its
real size recorded once written, and released when it is deleted, never made, or
expires (each entry carries its expiry; an entry whose writer died expires too).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from serve_app.errors import OpenAIError
from serve_app.redis_store import lua_scripts


class StorageAccount:
    def __init__(
        self,
        redis,
        names: Callable[[str], list[str]],
        max_bytes: int,
        max_objects: int,
        retention_s: float,
        *,
        what: str,
        remedy: str,
        param: str,
        code: str,
    ):
        """``names(key_id)``: the account's two Redis keys; ``retention_s``: the
        longest an object is kept (the account's own keys outlive it by a day). A
        reservation past a bound is a 400 (``param``, ``code``) saying what the key's
        ``what`` hold, both bounds, and the ``remedy``."""
        self.max_bytes, self.max_objects = max_bytes, max_objects
        self._names, self._ttl_ms = names, int((retention_s + 24 * 3600) * 1000)
        self._what, self._remedy, self._param, self._code = what, remedy, param, code
        self._script = lua_scripts.register(redis, __package__, "storage_account") if redis else None

    def _refusal(self, total: int, count: int, size: int) -> OpenAIError:
        return OpenAIError(
            400,
            f"This key's {self._what} hold {total} bytes in {count} objects; the limit is {self.max_bytes} "
            f"bytes and {self.max_objects} objects per key, and this needs up to {size} bytes more. {self._remedy}",
            param=self._param,
            code=self._code,
        )

    async def _call(
        self, op: str, key_id: str, object_id: str, size: int = 0, expires_s: float = 0, now_s: float | None = None
    ) -> tuple[bool, int, int]:
        now_ms = int((time.time() if now_s is None else now_s) * 1000)
        if self._script is None:
            raise RuntimeError("a storage account without Redis keeps nothing")
        done, total, count = await self._script(
            keys=self._names(key_id),
            args=[op, object_id, size, int(expires_s * 1000), now_ms, self.max_bytes, self.max_objects, self._ttl_ms],
        )
        return bool(done), int(total), int(count)

    async def reserve(
        self, key_id: str, object_id: str, size: int, expires_s: float, now_s: float | None = None
    ) -> None:
        """Room for a new object of at most ``size`` bytes until ``expires_s`` (unless
        recorded or released before), or the account's refusal."""
        done, total, count = await self._call("reserve", key_id, object_id, size, expires_s, now_s)
        if not done:
            raise self._refusal(total, count, size)

    async def grow(self, key_id: str, object_id: str, size: int, expires_s: float, now_s: float | None = None) -> bool:
        """``size`` bytes more for ``object_id`` (made if new) until ``expires_s``, if the
        key's bounds hold them; False (nothing changed) if not."""
        done, _, _ = await self._call("grow", key_id, object_id, size, expires_s, now_s)
        return done

    async def record(
        self, key_id: str, object_id: str, size: int, expires_s: float, now_s: float | None = None
    ) -> None:
        await self._call("record", key_id, object_id, size, expires_s, now_s)

    async def release(self, key_id: str, object_id: str, now_s: float | None = None) -> None:
        await self._call("release", key_id, object_id, now_s=now_s)

    async def used(self, key_id: str, now_s: float | None = None) -> tuple[int, int]:
        """(bytes, objects) the key holds now."""
        _, total, count = await self._call("read", key_id, "", now_s=now_s)
        return total, count
