"""`/v1/completions` on one engine (vLLM's `OpenAIServingCompletion`): each prompt of a batch is its
own engine request (`{request_id}-{k}`), their outputs merged into one response or one SSE stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from raylane.deployments.pool.serving import (
    OpenAIServing,
    StreamUsage,
    chain,
    encode,
    engine_failure,
    engine_resumption,
    final_item,
    last,
    served_model,
    sse,
    token_text,
    usage,
)
from raylane.deployments.pool.tokenize_offload import tokenize_off_loop
from raylane.deployments.protocol.errors import OpenAIError, invalid
from raylane.deployments.protocol.openai_schemas import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    PromptTokensDetails,
)
from raylane.deployments.protocol.sampling import grammar_param
from raylane.deployments.protocol.wire import DONE, PoolItem, ResumeState, StreamItem
from raylane.engine import EngineDeadError, RequestOutput, RequestOutputKind, SamplingParams
from raylane.engine.lora import LoRARequest
from raylane.engine.outputs import CompletionOutput

Started = list[tuple[RequestOutput, AsyncIterator[RequestOutput]]]  # (first output, the rest) per prompt


class OpenAIServingCompletion(OpenAIServing):
    async def completion(
        self,
        req: CompletionRequest,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        resume: ResumeState | None = None,
        tenant: str = "",
        lora_request: LoRARequest | None = None,
        cache_salt: str = "",
    ) -> AsyncIterator[PoolItem]:
        """`resume`: continue a stream that a failed replica began (deployments/protocol/wire.py); a prompt
        whose choices had all ended is not run again."""
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        params = params.clone(output_kind=kind)
        started: Started = []
        n = params.n
        try:
            # A large prompt is encoded off the replica's event loop (deployments/pool/tokenize_offload.py).
            encode_all = lambda: [self._prompt_ids(p) for p in req.prompts()]  # noqa: E731
            prompts = await tokenize_off_loop(encode_all, req.prompt)
            for ids in prompts:
                self.check_length(len(ids), params.max_tokens, "prompt")
            await self._compile(params, grammar_param(req), tenant)
            running = [k for k in range(len(prompts)) if not _ended(resume, range(k * n, (k + 1) * n))]
            for k in running:
                resumed = engine_resumption(resume, n, k * n)
                started.append(
                    await self._start(
                        prompts[k],
                        params,
                        f"{request_id}-{k}",
                        "prompt",
                        priority,
                        resumed,
                        tenant,
                        lora_request,
                        cache_salt,
                    )
                )
        except OpenAIError as e:
            for _, gen in started:
                await gen.aclose()
            yield e
            return
        response_id = f"cmpl-{request_id}"
        created = resume.created if resume is not None else int(time.time())
        model = served_model(self.model_id, lora_request)
        # Token-id prompts are decoded for their echo off the loop when long.
        echo_all = lambda: [self._prompt_text(p) if req.echo else "" for p in req.prompts()]  # noqa: E731
        echoes = await tokenize_off_loop(echo_all, req.prompt if req.echo else "")
        streams = [gen for _, gen in started]
        try:
            if not req.stream:
                finals = await asyncio.gather(*(last(first, gen) for first, gen in started))
                body = self._completion_response(finals, echoes, params, response_id, created, model)
                yield final_item(body.to_json(), streams)
                return
            report = StreamUsage.of(req.stream_options)
            shown = {}
            for k in running:
                shown |= self.resumed_texts(prompts[k], params, resume, range(k * n, (k + 1) * n))
            resumed = Resumed(resume, shown, running, sum(len(ids) for ids in prompts))
            async for chunk in self._completion_chunks(
                started, echoes, params, response_id, created, model, report, resumed
            ):
                yield chunk
        except EngineDeadError as e:
            for gen in streams:  # every engine request ends first, so the summary covers them all
                await gen.aclose()
            yield engine_failure(e, bool(req.stream), streams)
        finally:
            for gen in streams:
                await gen.aclose()

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise invalid("prompt", f"{self.model_id} has no tokenizer; send token ids.")
        return encode(self.tokenizer, prompt, "prompt")

    def _prompt_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str) or self.tokenizer is None:
            return prompt if isinstance(prompt, str) else ""
        return self.tokenizer.decode(prompt)

    def _completion_response(
        self,
        finals: Sequence[RequestOutput],
        echoes: list[str],
        params: SamplingParams,
        response_id: str,
        created: int,
        model: str,
    ) -> Completion:
        choices, prompt_tokens, completion_tokens = [], 0, []
        for k, final in enumerate(finals):
            prompt_tokens += len(final.prompt_token_ids)
            for comp in final.outputs:
                completion_tokens.append(len(comp.token_ids))
                choices.append(
                    CompletionChoice(
                        index=k * params.n + comp.index,
                        text=echoes[k] + comp.text,
                        logprobs=_completion_logprobs(comp, params, len(echoes[k])),
                        finish_reason=comp.finish_reason,
                    )
                )
        body_usage = usage(prompt_tokens, completion_tokens, finals[0])
        body_usage.prompt_tokens_details = PromptTokensDetails(
            cached_tokens=sum(f.num_cached_tokens for f in finals)
        )
        return Completion(id=response_id, created=created, model=model, choices=choices, usage=body_usage)

    async def _completion_chunks(
        self,
        started: Started,
        echoes: list[str],
        params: SamplingParams,
        response_id: str,
        created: int,
        model: str,
        report: StreamUsage,
        resumed: Resumed | None = None,
    ) -> AsyncIterator[PoolItem]:
        """Each item carries the token ids whose text it holds (`StreamItem`). A resumed stream sends
        no echo again, its logprobs' text offsets carry on after the text sent before, and its usage
        counts the tokens sent before too."""

        # Prompts whose choices had all ended before a resumption are not started again: counted still.
        prompt_tokens = sum(len(first.prompt_token_ids) for first, _ in started)
        if resumed is not None:
            prompt_tokens = resumed.prompt_tokens

        def chunk(index: int, text: str, logprobs=None, finish_reason=None) -> str:
            choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason)
            body = Completion(id=response_id, created=created, model=model, choices=[choice])
            if report.final:
                body.usage = usage(prompt_tokens, num_tokens, started[0][0]) if report.every_chunk else None
            return sse(body)

        n = params.n
        offsets = [len(echoes[k]) for k in range(len(echoes)) for _ in range(n)]
        num_tokens, finished = [0] * len(offsets), [False] * len(offsets)
        events = [chunk(k * n + j, echo) for k, echo in enumerate(echoes) for j in range(n if echo else 0)]
        prompts = list(range(len(started)))  # the prompt of each started engine request
        if resumed is not None and resumed.state is not None:
            events, prompts, state = [], resumed.running, resumed.state
            for index in range(len(offsets)):
                num_tokens[index] = len(state.token_ids.get(index, ()))
                finished[index] = index in state.finish_reasons
                # Offsets count token strings, as `_completion_logprobs` does (the text sent can hold
                # back a partial character): the same offsets however the tokens were chunked.
                offsets[index] += sum(len(self.tokenizer.decode([t])) for t in state.token_ids.get(index, ()))
        item = StreamItem("")
        async for position, out in _merge([chain(first, gen) for first, gen in started]):
            k = prompts[position]
            for comp in out.outputs:
                index = k * n + comp.index
                if finished[index]:
                    continue
                num_tokens[index] += len(comp.token_ids)
                item.token_ids.setdefault(index, []).extend(comp.token_ids)
                logprobs = _completion_logprobs(comp, params, offsets[index])
                if logprobs is not None and logprobs.tokens:
                    offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                if comp.text or logprobs is not None:
                    events.append(chunk(index, comp.text, logprobs))
                if comp.finished:
                    finished[index] = True
                    item.finish_reasons[index] = comp.finish_reason
                    events.append(chunk(index, "", finish_reason=comp.finish_reason))
            if events and not all(finished):  # the last events go out with the closing ones
                item.text = "".join(events)
                yield item
                events, item = [], StreamItem("")
        if report.final:
            body = Completion(
                id=response_id,
                created=created,
                model=model,
                choices=[],
                usage=usage(prompt_tokens, num_tokens, started[0][0]),
            )
            events.append(sse(body))
        yield final_item("".join([*events, DONE]), [gen for _, gen in started])


@dataclass(slots=True)
class Resumed:
    """A completions stream resumed after a failed replica: `state` as the gateway sent it, the text
    each unfinished choice had sent, the prompts started again (the others had ended), and the
    request's prompt tokens."""

    state: ResumeState | None
    shown: dict[int, str]
    running: list[int]
    prompt_tokens: int


def _ended(resume: ResumeState | None, choices: range) -> bool:
    return resume is not None and all(i in resume.finish_reasons for i in choices)


def _completion_logprobs(
    comp: CompletionOutput, params: SamplingParams, offset: int
) -> CompletionLogprobs | None:
    if params.logprobs is None or comp.logprobs is None:
        return None
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, entry in zip(comp.token_ids, comp.logprobs, strict=False):
        sampled = entry[token_id]
        token = token_text(sampled.decoded_token)
        top = sorted(entry.values(), key=lambda lp: -lp.logprob)[: params.logprobs]
        tokens.append(token)
        token_logprobs.append(sampled.logprob)
        top_logprobs.append({token_text(lp.decoded_token): lp.logprob for lp in top})
        text_offset.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=text_offset
    )


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several streams as their items arrive, tagged with the stream's position."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for item in stream:
                await queue.put((k, item))
        except Exception as e:  # surface the failure in the consumer
            await queue.put((k, e))
        finally:
            await queue.put((k, done))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            k, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield k, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
