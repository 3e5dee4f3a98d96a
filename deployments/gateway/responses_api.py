"""The gateway's side of stored responses: saving a finished response (whole or streamed), the
conversation a `previous_response_id` continues, GET and DELETE (deployments/gateway/response_store.py has
the store and why it is an actor)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi.responses import Response, StreamingResponse
from pydantic import TypeAdapter, ValidationError

from raylane.deployments.protocol.errors import OpenAIError
from raylane.deployments.protocol.responses_request import to_messages
from raylane.deployments.protocol.responses_schemas import InputItem, ResponseDeleted
from raylane.router import Principal

logger = logging.getLogger(__name__)
_OUTPUT_ITEMS = TypeAdapter(list[InputItem])  # a response's output items, read as input items
_FINAL_EVENTS = ("response.completed", "response.incomplete")


def not_found(response_id: str, param: str = "response_id") -> OpenAIError:
    return OpenAIError(
        f"Response with id '{response_id}' not found.", status=404, param=param, code="not_found"
    )


def owner(principal: Principal) -> str | None:
    """Who may read a stored response: its API key (by digest); anyone in open mode (no keys)."""
    return principal.key_id if principal.key_id.startswith("key-") else None


class StoredResponses:
    def __init__(self, store) -> None:
        """`store`: the `ResponseStore` actor handle."""
        self.store = store

    async def record(self, response_id: str, principal: Principal, param: str = "response_id") -> dict:
        """The record, for its owner only: a key's for that key, open mode's (no owner) for open mode
        only. One made in open mode and met once keys are on is dropped: it belongs to nobody now."""
        text = await self.store.get.remote(response_id)
        record = json.loads(text) if text is not None else None
        if record is not None and record["owner"] is None and owner(principal) is not None:
            await self.store.delete.remote(response_id)
        if record is None or record["owner"] != owner(principal):
            raise not_found(response_id, param)
        return record

    async def history(self, response_id: str, principal: Principal) -> list[dict[str, Any]]:
        """The chat messages of the conversation up to and including the response `response_id`."""
        record = await self.record(response_id, principal, "previous_response_id")
        try:
            output = _OUTPUT_ITEMS.validate_python(record["response"]["output"])
        except ValidationError:  # written by this code: cannot happen unless the format changed
            logger.exception("stored response %s has unreadable output", response_id)
            output = []
        return record["conversation"] + to_messages(output)

    async def delete(self, response_id: str, principal: Principal) -> Response:
        await self.record(response_id, principal)
        await self.store.delete.remote(response_id)
        return Response(ResponseDeleted(id=response_id).to_json(), media_type="application/json")

    async def keep(self, response: Response, conversation: list[dict], principal: Principal) -> Response:
        """Store the response `response` carries (a whole body now, a stream when its last event
        passes, before the client gets that event: a follow-up sent on it finds it stored)."""
        if isinstance(response, StreamingResponse):
            response.body_iterator = self._keep_streamed(response.body_iterator, conversation, principal)
        elif response.status_code == 200:
            await self._save(json.loads(response.body), conversation, principal)
        return response

    async def _keep_streamed(
        self, events: AsyncIterator, conversation: list[dict], principal: Principal
    ) -> AsyncIterator:
        async with aclosing(events):  # the relay's own clean-up runs when the client leaves
            async for chunk in events:
                text = chunk if isinstance(chunk, str) else bytes(chunk).decode()
                body = _final_event(text)
                if body is not None:
                    await self._save(body["response"], conversation, principal)
                yield chunk

    async def _save(self, response: dict, conversation: list[dict], principal: Principal) -> None:
        record = {"owner": owner(principal), "response": response, "conversation": conversation}
        try:
            kept = await self.store.put.remote(
                response["id"], json.dumps(record, ensure_ascii=False), principal.key_id
            )
            if not kept:
                logger.warning("response %s not stored: larger than a key's byte budget", response["id"])
        except Exception:  # the answer is out or about to be: a store that failed loses only a follow-up
            logger.exception("could not store response %s", response["id"])


def _final_event(text: str) -> dict | None:
    """The data of the `response.completed` / `response.incomplete` event in `text`, if it is there."""
    for kind in _FINAL_EVENTS:
        start = text.find(f"event: {kind}\ndata: ")
        if start >= 0:
            data = text[start:].split("\n", 2)[1].removeprefix("data: ")
            return json.loads(data)
    return None
