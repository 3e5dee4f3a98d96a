"""One scheduling loop with no separate prefill and decode phases (vLLM V1's shape).

Each step spends a token budget: running requests first (a decode costs one token, or 1 + k
with k speculative draft tokens to verify, an unfinished prefill its next chunk), then waiting
requests in order of service, their prompts chunked to what is left of the budget.
When KV blocks run out, a running request is preempted: its blocks are freed and it is
recomputed later (its prefix usually comes back from the prefix cache). A waiting request that
finds no free slot (`max_num_seqs`) or too few blocks preempts a running request of a lower
priority (vLLM's priority scheduling): a batch line gives its place to an interactive request at
once, instead of holding it until it finishes.

Order of service: priority first (lower first, as in vLLM). Within a priority, requests carry a
`tenant` (the API key that sent them): the waiting request of the tenant with the fewest requests
running goes first, FCFS within a tenant. So a key that queued a hundred requests does not make
another key's one request wait behind them; it waits for the next free slot. Preemption takes the
reverse order: lowest priority, then the tenant running the most, then the newest.
"""

import heapq
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

from raylane.engine.block_manager import BlockManager
from raylane.engine.lora import LoRASlots
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
    """Waiting requests in order of service (the module's docstring); `running` counts each tenant's
    running requests, which the queue reads when it chooses."""

    def __init__(self, running: Counter[str]):
        self._running = running
        # (priority, tenant) -> heap of (arrival, insertion, request)
        self._queues: dict[tuple[int, str], list[tuple[float, int, Request]]] = {}
        self._counter = itertools.count()
        self._len = 0

    def push(self, request: Request) -> None:
        queue = self._queues.setdefault((request.priority, request.tenant), [])
        heapq.heappush(queue, (request.arrival_time, next(self._counter), request))
        self._len += 1

    def _first(self) -> tuple[int, str]:
        """The queue served next: the tenant with the fewest running in the best priority, then the
        earliest arrival. Linear in the tenants waiting, which the gateway's admission bounds."""
        return min(self._queues, key=lambda k: (k[0], self._running[k[1]], self._queues[k][0][:2]))

    def peek(self) -> Request:
        return self._queues[self._first()][0][2]

    def pop(self) -> Request:
        key = self._first()
        queue = self._queues[key]
        request = heapq.heappop(queue)[2]
        if not queue:
            del self._queues[key]
        self._len -= 1
        return request

    def remove(self, request: Request) -> None:
        key = (request.priority, request.tenant)
        queue = [item for item in self._queues.get(key, ()) if item[2] is not request]
        self._len -= len(self._queues.get(key, ())) - len(queue)
        if queue:
            heapq.heapify(queue)
            self._queues[key] = queue
        else:
            self._queues.pop(key, None)

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        return (item[2] for queue in self._queues.values() for item in queue)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        lora_slots: LoRASlots | None = None,
    ):
        self.block_manager = block_manager
        self.lora_slots = lora_slots  # None: the engine serves no adapters
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.running_per_tenant: Counter[str] = Counter()
        self.waiting = WaitingQueue(self.running_per_tenant)
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
            victim = max(self.running, key=self._preemption_order)
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _preemption_order(self, request: Request) -> tuple[int, int, float]:
        return (request.priority, self.running_per_tenant[request.tenant], request.arrival_time)

    def _run(self, request: Request) -> None:
        if self.lora_slots is not None:
            self.lora_slots.pin(request.lora)
        self.running.append(request)
        self.running_per_tenant[request.tenant] += 1

    def _stop_running(self, request: Request) -> None:
        if self.lora_slots is not None:
            self.lora_slots.unpin(request.lora)
        self.running.remove(request)
        self.running_per_tenant[request.tenant] -= 1
        if not self.running_per_tenant[request.tenant]:
            del self.running_per_tenant[request.tenant]

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self._stop_running(request)
        if request in out.requests:
            i = out.requests.index(request)
            del out.requests[i], out.num_new_tokens[i]
        self.block_manager.free(request)
        request.spec_token_ids, request.spec_draft_probs = [], None
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        if request.trace is not None:
            request.trace.preemptions.append(time.monotonic())
        self.num_preemptions += 1
        out.preempted.append(request)
        self.waiting.push(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        # Requests whose adapter finds every slot pinned by running requests wait for one, set aside
        # for this step: the ones behind them that need no new slot go first (one tenant's adapter
        # must not hold up everyone's base-model requests), as vLLM's scheduler skips them.
        no_slot: list[Request] = []
        budget = self._admit(out, budget, no_slot)
        for request in no_slot:
            self.waiting.push(request)
        return budget

    def _admit(self, out: SchedulerOutput, budget: int, no_slot: list[Request]) -> int:
        while self.waiting and budget > 0:
            request = self.waiting.peek()
            if self.lora_slots is not None and not self.lora_slots.can_pin(request.lora):
                no_slot.append(self.waiting.pop())
                continue
            if len(self.running) >= self.max_num_seqs:
                freed = self._preempt_for(request, out)
                if freed is None:
                    break
                budget += freed
                continue  # the queue's order may have changed with the victim's tenant: look again
            computed = self.block_manager.get_computed_blocks(request)
            num_cached = len(computed) * self.block_manager.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.block_manager.allocate_slots(request, num_new, computed):
                freed = self._preempt_for(request, out)
                if freed is None:
                    break  # strict order: a lower-priority request never overtakes one that does not fit
                budget += freed
                continue
            self.waiting.pop()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self._run(request)
            out.requests.append(request)
            out.num_new_tokens.append(num_new)
            budget -= num_new
        return budget

    def _preempt_for(self, request: Request, out: SchedulerOutput) -> int | None:
        """Make room for waiting `request` by preempting one running request of a lower priority
        (a higher number), chosen in preemption order, as vLLM's priority policy does: a batch line
        never holds a slot or blocks that an interactive request is waiting for. The tokens the
        victim had been given this step (back to the budget), or None when none runs below it."""
        lower = [r for r in self.running if r.priority > request.priority]
        if not lower:
            return None
        victim = max(lower, key=self._preemption_order)
        freed = 0
        if victim in out.requests:
            freed = out.num_new_tokens[out.requests.index(victim)]
        self._preempt(victim, out)
        return freed

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request (finished or aborted) wherever it is, and free its blocks at once."""
        request.status = status
        if request in self.running:
            self._stop_running(request)
        else:
            self.waiting.remove(request)
        self.block_manager.free(request)
