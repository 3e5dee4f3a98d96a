"""One generation as a Responses object and as its typed server-sent events, in OpenAI's order.

The text streams through the pool's reasoning parser (deployments/pool/reasoning_parser.py) and then the
tool-call parser (deployments/protocol/tool_calls.py); each becomes output items:

    response.created, response.in_progress
    reasoning item:  output_item.added, content_part.added, reasoning_text.delta..., reasoning_text.done,
                     content_part.done, output_item.done
    message item:    output_item.added, content_part.added, output_text.delta..., output_text.done,
                     content_part.done, output_item.done
    function call:   output_item.added, function_call_arguments.delta..., function_call_arguments.done,
                     output_item.done
    response.completed (or response.incomplete when max_output_tokens cut it)

Every event carries a `sequence_number`. A non-streamed response is the same builder fed the whole
text at once, so it holds exactly the items its stream would have.

A stream resumed on another replica (deployments/gateway/resumption.py) is a new builder that `resume`s: it
is fed the text the client has, its events dropped, so the items it had opened, the parsers' held-back
text and the tokens counted carry on, and its events are numbered on from those the client got. So
that the items it reopens keep their ids, an item's id (and a function call's `call_id`) follows from
the response's id and the item's place in the output, not from chance.
"""

from __future__ import annotations

import json
import time
from typing import Any

from raylane.deployments.pool.reasoning_parser import ReasoningParser, reasoning_tokens
from raylane.deployments.protocol.tool_calls import ContentDelta, ToolCallStreamParser


class ResponseBuilder:
    def __init__(
        self,
        echo: dict[str, Any],
        model: str,
        parse_tools: bool,
        reasoning: str | None,
        tokenizer,
        forced_tools: bool = False,
    ) -> None:
        """`echo`: the request's fields the response repeats (deployments/protocol/responses_request.py)."""
        self.response = {**echo, "model": model, "status": "in_progress", "output": []}
        self.reasoning = ReasoningParser(reasoning) if reasoning else None
        self.tools = ToolCallStreamParser(forced_tools) if parse_tools else None
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.seq = 0
        self.item: dict[str, Any] | None = None  # the output item being written

    # -- events --------------------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        return [
            self.event("response.created", response=self.response),
            self.event("response.in_progress", response=self.response),
        ]

    def resume(self, text: str, token_ids: list[int], num_events: int) -> None:
        """Take up a stream after the `num_events` events that another replica sent, which held
        `text` (the tokens `token_ids`)."""
        self.feed(text, token_ids)
        self.seq = num_events

    def feed(self, text: str, token_ids: list[int]) -> list[str]:
        self.token_ids += token_ids
        if self.reasoning is None:
            return self._content(text, final=False)
        split = self.reasoning.feed(text)
        return self._reasoning(split.reasoning) + self._content(split.content, final=False)

    def finish(self, finish_reason: str | None, prompt_tokens: int, cached_tokens: int) -> list[str]:
        out = []
        if self.reasoning is not None:
            split = self.reasoning.finish()
            out += self._reasoning(split.reasoning)
            out += self._content(split.content, final=True)
        else:
            out += self._content("", final=True)
        if not self.response["output"] and self.item is None:  # nothing generated: an empty answer
            out += self._open_message()
        out += self._close()
        output_tokens = len(self.token_ids)
        thinking = reasoning_tokens(self.reasoning, self.tokenizer, self.token_ids) if self.reasoning else 0
        self.response["usage"] = {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": thinking},
            "total_tokens": prompt_tokens + output_tokens,
        }
        self.response["completed_at"] = int(time.time())
        if finish_reason == "length":
            self.response["status"] = "incomplete"
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
            return [*out, self.event("response.incomplete", response=self.response)]
        self.response["status"] = "completed"
        return [*out, self.event("response.completed", response=self.response)]

    # -- items ---------------------------------------------------------------------------------------

    def _reasoning(self, text: str) -> list[str]:
        if not text:
            return []
        out = []
        if self.item is None or self.item["type"] != "reasoning":
            out += self._close()
            item = {
                "id": self._id("rs"),
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            out += self._open(item, {"type": "reasoning_text", "text": ""})
        return [*out, self._delta("response.reasoning_text.delta", text)]

    def _content(self, text: str, final: bool) -> list[str]:
        if self.tools is None:
            return self._text(text)
        out = []
        for ev in self.tools.feed(text) + (self.tools.finish() if final else []):
            if isinstance(ev, ContentDelta):
                out += self._text(ev.text)
            elif ev.name is not None:  # a call begins
                out += self._close()
                item = {
                    "id": self._id("fc"),
                    "type": "function_call",
                    "call_id": self._id("call"),  # not the parser's: a resumed one would differ
                    "name": ev.name,
                    "arguments": "",
                    "status": "in_progress",
                }
                out += self._open(item, None)
                out += self._arguments(ev.arguments)
            else:
                out += self._arguments(ev.arguments)
        return out

    def _text(self, text: str) -> list[str]:
        if not text:
            return []
        out = []
        if self.item is None or self.item["type"] != "message":
            out += self._close() + self._open_message()
        return [*out, self._delta("response.output_text.delta", text, logprobs=[])]

    def _open_message(self) -> list[str]:
        item = {
            "id": self._id("msg"),
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        return self._open(item, {"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def _arguments(self, delta: str) -> list[str]:
        if not delta:
            return []
        assert self.item is not None
        self.item["arguments"] += delta
        return [self._at("response.function_call_arguments.delta", delta=delta)]

    def _open(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[str]:
        self.item = item
        out = [self.event("response.output_item.added", output_index=self._index(), item=item)]
        if part is not None:
            item["content"].append(part)
            out.append(self._at("response.content_part.added", content_index=0, part=part))
        return out

    def _delta(self, kind: str, text: str, **extra: Any) -> str:
        assert self.item is not None
        self.item["content"][0]["text"] += text
        return self._at(kind, content_index=0, delta=text, **extra)

    def _close(self) -> list[str]:
        item, out = self.item, []
        if item is None:
            return []
        item["status"] = "completed"
        if item["type"] == "function_call":
            out.append(
                self._at(
                    "response.function_call_arguments.done", name=item["name"], arguments=item["arguments"]
                )
            )
        else:
            part = item["content"][0]
            done = (
                "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            )
            extra = {"logprobs": []} if item["type"] == "message" else {}
            out.append(self._at(done, content_index=0, text=part["text"], **extra))
            out.append(self._at("response.content_part.done", content_index=0, part=part))
        out.append(self.event("response.output_item.done", output_index=self._index(), item=item))
        self.response["output"].append(item)
        self.item = None
        return out

    def _index(self) -> int:
        return len(self.response["output"])

    def _id(self, prefix: str) -> str:
        """The id of the item about to open: the same on any replica that writes this response."""
        return f"{prefix}_{self.response['id'].removeprefix('resp_')}_{self._index()}"

    def _at(self, kind: str, **fields: Any) -> str:
        """An event about the item being written."""
        assert self.item is not None
        return self.event(kind, item_id=self.item["id"], output_index=self._index(), **fields)
