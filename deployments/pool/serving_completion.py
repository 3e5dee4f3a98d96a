"""`/v1/completions` on one engine (vLLM's `OpenAIServingCompletion`): each prompt of a batch is its
own engine request (`{request_id}-{k}`), their outputs merged into one response or one SSE stream.
What a choice shows of its prompt (`echo`, with its tokens' logprobs; `max_tokens: 0`) is
`completion_echo.Echo`'s business."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from raylane import tracing
from raylane.deployments.pool.completion_echo import Echo
from raylane.deployments.pool.logprobs import joined, output_logprobs, vllm_prompt_logprobs
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
    usage,
)
from raylane.deployments.pool.tokenize_offload import tokenize_off_loop
from raylane.deployments.protocol.errors import OpenAIError, invalid
from raylane.deployments.protocol.openai_schemas import (
    Completion,
    CompletionChoice,
    CompletionRequest,
    PromptTokensDetails,
)
from raylane.deployments.protocol.sampling import grammar_param
from raylane.deployments.protocol.wire import DONE, PoolItem, ResumeState, StreamItem
from raylane.engine import EngineDeadError, RequestOutput, RequestOutputKind, SamplingParams
from raylane.engine.lora import LoRARequest

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
            with tracing.span("pool.tokenize"):
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
        texts = await tokenize_off_loop(echo_all, req.prompt if req.echo else "")
        echo = Echo.of(req, params, texts, self._token_string)
        streams = [gen for _, gen in started]
        try:
            if not req.stream:
                finals = await asyncio.gather(*(last(first, gen) for first, gen in started))
                body = self._completion_response(finals, echo, params, response_id, created, model)
                yield echo.counted(final_item(body.to_json(), streams))
                return
            report = StreamUsage.of(req.stream_options)
            shown = {}
            for k in running:
                shown |= self.resumed_texts(prompts[k], params, resume, range(k * n, (k + 1) * n))
            resumed = Resumed(resume, shown, running, sum(len(ids) for ids in prompts))
            async for chunk in self._completion_chunks(
                started, echo, params, response_id, created, model, report, resumed
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

    def _token_string(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    def _completion_response(
        self,
        finals: Sequence[RequestOutput],
        echo: Echo,
        params: SamplingParams,
        response_id: str,
        created: int,
        model: str,
    ) -> Completion:
        choices, prompt_tokens, completion_tokens = [], 0, []
        for k, final in enumerate(finals):
            prompt_tokens += len(final.prompt_token_ids)
            prompt_part = echo.prompt_logprobs(final)
            for comp in final.outputs:
                comp = echo.completion(comp)
                completion_tokens.append(len(comp.token_ids))
                logprobs = output_logprobs(comp, params.logprobs, len(echo.texts[k]), self._token_string)
                choice = CompletionChoice(
                    index=k * params.n + comp.index,
                    text=echo.texts[k] + comp.text,
                    logprobs=joined(prompt_part, logprobs),
                    finish_reason=comp.finish_reason,
                )
                if final.prompt_logprobs is not None:  # vLLM's field, beside the echo's `logprobs` too
                    choice.prompt_logprobs = vllm_prompt_logprobs(final.prompt_logprobs)
                choices.append(choice)
        body_usage = usage(prompt_tokens, completion_tokens, finals[0])
        body_usage.prompt_tokens_details = PromptTokensDetails(
            cached_tokens=sum(f.num_cached_tokens for f in finals)
        )
        return Completion(id=response_id, created=created, model=model, choices=choices, usage=body_usage)

    async def _completion_chunks(
        self,
        started: Started,
        echo: Echo,
        params: SamplingParams,
        response_id: str,
        created: int,
        model: str,
        report: StreamUsage,
        resumed: Resumed | None = None,
    ) -> AsyncIterator[PoolItem]:
        """Each item carries the token ids whose text it holds (`StreamItem`). The echo goes first, with
        its prompt's logprobs (the first output of each prompt carries them). A resumed stream sends
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
        offsets = [len(text) for text in echo.texts for _ in range(n)]
        num_tokens, finished = [0] * len(offsets), [False] * len(offsets)
        events = []
        prompts = list(range(len(started)))  # the prompt of each started engine request
        if resumed is None or resumed.state is None:
            for k, text in enumerate(echo.texts):
                prompt_part = echo.prompt_logprobs(started[k][0])  # a prompt's first output carries them
                if text or prompt_part is not None:
                    events += [chunk(k * n + j, text, prompt_part) for j in range(n)]
        else:
            prompts, state = resumed.running, resumed.state
            for index in range(len(offsets)):
                num_tokens[index] = len(state.token_ids.get(index, ()))
                finished[index] = index in state.finish_reasons
                # Offsets count token strings, as `output_logprobs` does (the text sent can hold
                # back a partial character): the same offsets however the tokens were chunked.
                offsets[index] += sum(len(self.tokenizer.decode([t])) for t in state.token_ids.get(index, ()))
        item = StreamItem("")
        async for position, out in _merge([chain(first, gen) for first, gen in started]):
            k = prompts[position]
            for comp in out.outputs:
                index = k * n + comp.index
                if finished[index]:
                    continue
                comp = echo.completion(comp)
                num_tokens[index] += len(comp.token_ids)
                item.token_ids.setdefault(index, []).extend(comp.token_ids)
                logprobs = output_logprobs(comp, params.logprobs, offsets[index], self._token_string)
                if logprobs is not None and logprobs.tokens:
                    offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                if comp.text or (logprobs is not None and logprobs.tokens):
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
        yield echo.counted(final_item("".join([*events, DONE]), [gen for _, gen in started]))


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
