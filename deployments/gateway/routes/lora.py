"""vLLM's LoRA adapter admin, /v1/load_lora_adapter and /v1/unload_lora_adapter: adapters loaded at
run time on a pool, through every gateway replica (deployments/gateway/lora_adapters.py)."""

import json
import logging

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from raylane.deployments.gateway.core import GatewayCore
from raylane.deployments.gateway.openapi import route_docs
from raylane.deployments.gateway.request_body import parse_body
from raylane.deployments.gateway.request_record import router_timed
from raylane.deployments.protocol.errors import OpenAIError, client_error, invalid, unavailable
from raylane.deployments.protocol.lora_schemas import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

logger = logging.getLogger(__name__)
router = APIRouter()


class LoRAAdapterRoutes(GatewayCore):
    @router.post("/v1/load_lora_adapter", **route_docs(None, LoadLoRAAdapterRequest))
    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's: serve a PEFT adapter on a pool from now on, through every gateway replica. A
        replica of the pool checks it first (its files, rank and shapes against the pool's model),
        so a bad adapter is this call's 400, never a failed request later."""
        req = await self.admin_body(request, LoadLoRAAdapterRequest)
        pool, name = self.lora.target(req.pool, req.lora_name)
        roots = self.config.gateway.lora_adapter_roots
        if not roots:
            raise invalid(
                "lora_path", "No directory is open to run-time loads: set gateway.lora_adapter_roots."
            )
        checked = await self.call_pool(
            pool, [], lambda handle: handle.check_adapter.remote(req.lora_path, roots)
        )
        path = json.loads(checked.body)["path"]  # resolved where the files are
        await self.lora.load(pool, name, path, req.load_inplace)
        logger.info("LoRA adapter %s loaded on pool %s from %s", name, pool, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/v1/unload_lora_adapter", **route_docs(None, UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's: stop serving an adapter loaded at run time (requests running with it finish)."""
        req = await self.admin_body(request, UnloadLoRAAdapterRequest)
        pool, name = self.lora.target(req.pool, req.lora_name)
        await self.lora.unload(pool, name)
        logger.info("LoRA adapter %s unloaded from pool %s", name, pool)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def admin_body(self, request: Request, model):
        """The body of an adapter change, once the caller is found to be allowed one: a key of an
        `admin` tier, or anyone in open mode with `gateway.allow_runtime_lora_updating`."""
        principal = self.authenticate(request)
        self.router.check_rate(principal)
        if self.router.open_mode and not self.config.gateway.allow_runtime_lora_updating:
            raise OpenAIError(
                "Loading LoRA adapters at run time is off: configure API keys with an `admin` tier, or "
                "set gateway.allow_runtime_lora_updating (open mode).",
                status=403,
                code="permission_denied",
            )
        if not self.router.open_mode and not principal.tier.admin:
            raise OpenAIError(
                f"Only keys of an `admin` tier may load or unload LoRA adapters; this key's tier is "
                f"'{principal.tier.name}'.",
                status=403,
                code="permission_denied",
            )
        return await parse_body(request, model, self.config.gateway.max_request_body_bytes)

    async def call_pool(self, model: str, messages: list[dict], call) -> Response:
        """An admin's call (an adapter's check) to the pool `model` resolves to, whose JSON answer is
        the response; a client mistake the pool found is its 4xx."""
        resolution = await router_timed(self.router.resolve_async(model, messages))
        pool = resolution.pools[0]
        try:
            body = await call(self.pools[pool])
        except Exception as e:
            if (error := client_error(e)) is not None:
                raise error from None
            logger.warning("pool %s failed a %s request: %s", pool, "tokenize", e)
            raise unavailable(f"The pool {pool} could not answer: {type(e).__name__}.") from None
        return Response(body, media_type="application/json", headers={"x-raylane-pool": pool})
