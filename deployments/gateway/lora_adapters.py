"""The LoRA adapters a gateway names to its pools: the config's (`pools[].adapters`) and those loaded
at run time with vLLM's `POST /v1/load_lora_adapter` (removed with `/v1/unload_lora_adapter`).

Run-time adapters live in Ray's GCS (its internal KV, one key per pool and name, written only if
absent: of two gateway replicas loading one name at once, one wins and the other answers 400), so
every gateway replica serves them and they outlive gateway restarts and `raylane apply`. Each
replica re-reads them every `REFRESH_S`, the replica that made a change at once. A pool replica
keeps no list: each request carries its adapter's directory (`AdapterRef`), and the replica loads
it into a slot on first use, so a load restarts nothing. An unloaded adapter is no longer served;
its slots are freed by the engine's LRU as other adapters need them (slots are allocated up front,
so an unload frees no memory, as it would not in vLLM's preallocated slots either).

Who may change them: keys of a tier with `admin: true`; in open mode (no keys) anyone, when
`gateway.allow_runtime_lora_updating` is set (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), else no one.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from raylane.config import ClusterConfig
from raylane.deployments.live_config import NAMESPACE
from raylane.deployments.protocol.errors import OpenAIError, invalid, model_not_found
from raylane.deployments.protocol.wire import AdapterRef

logger = logging.getLogger(__name__)
REFRESH_S = 2.0  # how soon another gateway replica serves an adapter loaded through this one


def _kv():
    from ray.experimental import internal_kv

    return internal_kv


class LoRAAdapters:
    def __init__(self, app: str, config: ClusterConfig, on_change: Callable[[], None]):
        """`on_change()`: the adapters changed (the router's model names follow them)."""
        self.app, self.config, self.on_change = app, config, on_change
        self.loaded: dict[str, dict[str, str]] = {}  # pool -> name -> directory, loaded at run time
        self._watch: asyncio.Task | None = None

    def by_pool(self) -> dict[str, dict[str, str]]:
        """Pool -> served name -> directory: the config's adapters, then those loaded at run time
        into pools of this config (a config name wins: it cannot be loaded over)."""
        adapters = {pool.name: dict(pool.adapters) for pool in self.config.pools}
        for pool, loaded in self.loaded.items():
            if pool in adapters:
                adapters[pool] = loaded | adapters[pool]
        return adapters

    def ref(self, name: str, pools: tuple[str, ...]) -> AdapterRef:
        """The adapter `name` as the candidate `pools` (the resolver's: those serving it) run it."""
        adapters = self.by_pool()
        if any(name not in adapters.get(pool, {}) for pool in pools):
            raise model_not_found(name)  # unloaded since the request was resolved
        return AdapterRef(name, tuple((pool, adapters[pool][name]) for pool in pools))

    # -- the GCS record ----------------------------------------------------------------------------

    def _prefix(self) -> bytes:
        return f"lora:{self.app}:".encode()

    def _key(self, pool: str, name: str) -> bytes:
        return self._prefix() + f"{pool}:{name}".encode()

    def read(self) -> dict[str, dict[str, str]]:
        loaded: dict[str, dict[str, str]] = {}
        for key in _kv()._internal_kv_list(self._prefix(), namespace=NAMESPACE):
            raw = _kv()._internal_kv_get(key, namespace=NAMESPACE)
            if raw is not None:  # (unloaded between the list and the read)
                entry = json.loads(raw)
                loaded.setdefault(entry["pool"], {})[entry["name"]] = entry["path"]
        return loaded

    async def refresh(self) -> None:
        loaded = await asyncio.to_thread(self.read)
        if loaded != self.loaded:
            self.loaded = loaded
            self.on_change()

    def watch(self) -> None:
        """Re-read the record every REFRESH_S from now on (started by the first request: the
        replica's event loop runs by then)."""
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # the GCS away for a moment: the adapters stay as they were
                logger.warning("could not read the run-time LoRA adapters", exc_info=True)
            await asyncio.sleep(REFRESH_S)

    # -- changes (the gateway checked the caller and the adapter) -----------------------------------

    def target(self, pool: str | None, lora_name: str) -> tuple[str, str]:
        """(pool, adapter name) a load or unload means: the pool is `pool`, the pool part of
        `lora_name` (`<pool>:<name>`), or the only pool serving adapters (400 naming the field when
        none fits)."""
        enabled = [p.name for p in self.config.pools if p.engine.enable_lora]
        prefix, _, name = lora_name.rpartition(":")
        pool = pool or prefix or None
        if pool is None:
            if len(enabled) != 1:
                message = f"Name the pool: pools serving adapters here: {enabled}." if enabled else ""
                raise invalid("pool", f"No single pool serves LoRA adapters. {message}".strip())
            return enabled[0], name
        if pool not in enabled:
            raise invalid(
                "pool",
                f"The pool {pool!r} serves no LoRA adapters: pools that do: {enabled} "
                "(a pool serves them with `adapters` or `engine.enable_lora: true`).",
            )
        return pool, name

    def _check_not_in_config(self, pool: str, name: str) -> None:
        if name in self.config.pool(pool).adapters:
            raise invalid(
                "lora_name",
                f"The lora adapter '{name}' is in the cluster config (pools[].adapters): change it "
                "there (raylane apply).",
            )

    async def load(self, pool: str, name: str, path: str, inplace: bool = False) -> None:
        """`inplace` (vLLM's `load_inplace`): a run-time adapter of that name takes the new directory
        (its new id: replicas load the new weights into another slot); never a config adapter."""
        self._check_not_in_config(pool, name)
        if not inplace and name in self.loaded.get(pool, {}):
            raise invalid("lora_name", f"The lora adapter '{name}' has already been loaded.")
        entry = json.dumps({"pool": pool, "name": name, "path": path}).encode()
        key = self._key(pool, name)
        put = _kv()._internal_kv_put
        if await asyncio.to_thread(put, key, entry, overwrite=inplace, namespace=NAMESPACE) and not inplace:
            raise invalid("lora_name", f"The lora adapter '{name}' has already been loaded.")
        self.loaded.setdefault(pool, {})[name] = path
        self.on_change()

    async def unload(self, pool: str, name: str) -> None:
        self._check_not_in_config(pool, name)
        deleted = await asyncio.to_thread(_kv()._internal_kv_del, self._key(pool, name), namespace=NAMESPACE)
        self.loaded.get(pool, {}).pop(name, None)
        if not deleted:
            raise OpenAIError(
                f"The lora adapter '{name}' cannot be found.", status=404, param="lora_name", code="not_found"
            )
        self.on_change()
