"""What the server says of itself: /v1/models, /health, /metrics."""

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from raylane.deployments.gateway.core import GatewayCore
from raylane.deployments.gateway.openapi import route_docs
from raylane.deployments.metrics.gateway import render_cluster_metrics
from raylane.deployments.protocol.errors import model_not_found
from raylane.deployments.protocol.openai_schemas import ModelCard, ModelList

router = APIRouter()


class ServerRoutes(GatewayCore):
    created: int  # when this replica started: the `created` of its model cards

    @router.get("/v1/models", **route_docs(ModelList))
    async def list_models(self, request: Request) -> Response:
        self.authenticate(request)
        return Response(ModelList(data=self.model_cards()).to_json(), media_type="application/json")

    @router.get("/v1/models/{model_id:path}", **route_docs(ModelCard))
    async def retrieve_model(self, model_id: str, request: Request) -> Response:
        self.authenticate(request)
        card = next((c for c in self.model_cards() if c.id == model_id), None)
        if card is None:
            raise model_not_found(model_id)
        return Response(card.to_json(), media_type="application/json")

    @router.get("/health")
    async def health(self, request: Request) -> JSONResponse:
        """200 while every pool is up (`ok`, or `busy`: alive, too loaded to answer its probe in
        time), 503 naming the pools that are down. From the health loop's last check, so a call costs
        no round trip to the pools. With API keys configured, a caller without a valid key learns
        only the status; with one, each pool's load and this gateway replica's `router` view too."""
        self.pool_health.watch()
        self.drain.start()
        pools = await self.pool_health.current()
        healthy = all(p["status"] != "unavailable" for p in pools.values())
        status = "draining" if self.drain.draining else "ok" if healthy else "degraded"
        code = 200 if status == "ok" else 503
        if not self.may_see_internals(request):
            return JSONResponse({"status": status}, code)
        body = {
            "status": status,
            "pools": pools,
            "router": self.pool_health.router_state(),
            "gateway": {"in_flight": self.drain.in_flight, "asyncio_tasks": len(asyncio.all_tasks())},
        }
        return JSONResponse(body, code)

    @router.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        """Prometheus text format, aggregated over every gateway and pool replica of the app (behind an
        API key when `gateway.metrics_require_key`)."""
        from prometheus_client import CONTENT_TYPE_LATEST

        if self.config.gateway.metrics_require_key:
            self.router.authenticate(request.headers)
        return Response(await render_cluster_metrics(), media_type=CONTENT_TYPE_LATEST)

    def model_cards(self) -> list[ModelCard]:
        cards = [ModelCard(id=p.model_id, created=self.created) for p in self.config.pools]
        listed = {p.name for p in self.config.pools} | {c.id for c in cards}
        adapters = self.lora.by_pool()
        for pool in self.config.pools:  # an adapter by its own name, or `<pool>:<name>` where that is taken
            for name in adapters[pool.name]:
                model = name if name not in listed else f"{pool.name}:{name}"
                listed.add(model)
                cards.append(ModelCard(id=model, created=self.created, parent=pool.model_id))
        if self.config.embeddings.enabled:
            cards.append(ModelCard(id=self.config.embeddings.model_id, created=self.created))
        return cards
