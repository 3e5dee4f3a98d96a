"""One scheduling loop with no separate prefill and decode phases (vLLM V1's shape).

Each step spends a token budget: running requests first (a decode costs one token, or 1 + k
with k speculative draft tokens to verify, an unfinished prefill its next chunk), then waiting
requests in (priority, arrival) order, their prompts chunked to what is left of the budget.
When KV blocks run out, the running request that is lowest in priority and newest is
preempted: its blocks are freed and it is recomputed later (its prefix usually comes back
from the prefix cache).
"""

import heapq
import itertools
from dataclasses import dataclass, field

from raylane.engine.block_manager import BlockManager
from raylane.engine.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class WaitingQueue:
    """Waiting requests by (priority, arrival); ties broken by insertion order."""

    def __init__(self):
        self._heap: list[tuple[tuple[int, float], int, Request]] = []
        self._counter = itertools.count()

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.sort_key, next(self._counter), request))

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        self._heap = [item for item in self._heap if item[2] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (item[2] for item in self._heap)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.push(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for request in list(self.running):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = self._trim_drafts(request, budget)
            if not self._allocate_or_preempt(request, num_new, out):
                continue
            out.requests.append(request)
            out.num_new_tokens.append(num_new)
            budget -= num_new
        if not out.preempted:  # after a preemption, memory is too tight to admit more
            budget = self._schedule_waiting(out, budget)
        return out

    @staticmethod
    def _trim_drafts(request: Request, budget: int) -> int:
        """Tokens to compute: what is left plus the draft tokens, the drafts cut to fit the budget."""
        num_left = request.num_tokens - request.num_computed_tokens
        num_new = min(num_left + len(request.spec_token_ids), budget)
        num_drafts = max(0, num_new - num_left)
        if num_drafts < len(request.spec_token_ids):
            del request.spec_token_ids[num_drafts:]
            if request.spec_draft_probs is not None:
                request.spec_draft_probs = request.spec_draft_probs[:num_drafts]
        return num_new

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.block_manager.allocate_slots(request, num_new):
            victim = max(self.running, key=lambda r: r.sort_key)
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        if request in out.requests:
            i = out.requests.index(request)
            del out.requests[i], out.num_new_tokens[i]
        self.block_manager.free(request)
        request.spec_token_ids, request.spec_draft_probs = [], None
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(request)
        self.waiting.push(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            computed = self.block_manager.get_computed_blocks(request)
            num_cached = len(computed) * self.block_manager.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.block_manager.allocate_slots(request, num_new, computed):
                break  # strict order: a lower-priority request never overtakes one that does not fit
            self.waiting.pop()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.requests.append(request)
            out.num_new_tokens.append(num_new)
            budget -= num_new
        return budget

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request (finished or aborted) wherever it is, and free its blocks at once."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.block_manager.free(request)
