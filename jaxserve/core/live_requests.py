"""LiveRequests: the scheduler's record of its live (unfinished) requests, in arrival order, and
the order the scheduling policy puts their sequences in: "fcfs" by arrival (add_request order),
then fork; "priority" by request.priority (lower first), then the same. It makes their sequences
(sequence 0, and the forks of n > 1), counts the running seats a request takes, and keeps the
requests finished outside update() (schedule() or admission found they can never fit) until the
next update() reports them. WaitingQueue: the waiting sequences in that order. Host-only, no JAX."""

from __future__ import annotations

import collections
import heapq

from jaxserve.core.sequence import Request, Sequence, SequenceStatus


class LiveRequests:
    def __init__(self, policy: str):
        self.policy = policy
        self._requests: dict[str, Request] = {}
        self._arrival: dict[str, int] = {}
        self._num_arrivals = 0
        self._next_seq_id = 0
        self._unreported: list[Request] = []

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def has_unfinished(self) -> bool:
        """Anything left to run or to report."""
        return bool(self._requests) or bool(self._unreported)

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def add(self, request: Request) -> Sequence:
        """A request arrives; returns its sequence 0 (of its prompt)."""
        seq = Sequence(seq_id=self._new_seq_id(), request=request,
                       token_ids=list(request.prompt_token_ids),
                       num_prompt_tokens=len(request.prompt_token_ids))
        request.sequences.append(seq)
        self._requests[request.request_id] = request
        self._arrival[request.request_id] = self._num_arrivals
        self._num_arrivals += 1
        return seq

    def fork(self, seq: Sequence, fork_index: int) -> Sequence:
        """A running copy of sequence 0 at the end of its prompt (n > 1), added to its request."""
        child = Sequence(seq_id=self._new_seq_id(), request=seq.request,
                         token_ids=list(seq.token_ids), num_prompt_tokens=seq.num_prompt_tokens,
                         fork_index=fork_index, status=SequenceStatus.RUNNING,
                         num_cached_tokens=seq.num_cached_tokens)
        seq.request.sequences.append(child)
        return child

    @staticmethod
    def seats(seq: Sequence) -> int:
        """Running slots a sequence takes: all n of a request not yet forked."""
        request = seq.request
        if seq.fork_index == 0 and len(request.sequences) < request.sampling_params.n:
            return request.sampling_params.n
        return 1

    def lora_ids(self) -> set[int]:
        """The LoRA adapters (lora_int_id; 0: the base) the live requests run under."""
        return {r.lora_int_id for r in self._requests.values()}

    def count_under(self, lora_int_id: int) -> int:
        """How many live requests run under that LoRA adapter."""
        return sum(r.lora_int_id == lora_int_id for r in self._requests.values())

    def remove(self, request: Request) -> bool:
        """A finished request leaves; False if it already had."""
        if request.request_id not in self._requests:
            return False
        del self._requests[request.request_id]
        del self._arrival[request.request_id]
        return True

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def sequences(self) -> list[Sequence]:
        """Every unfinished sequence of a live request."""
        return [s for r in self._requests.values() for s in r.sequences if not s.is_finished]

    def key(self, seq: Sequence) -> tuple:
        """The policy's order: smaller first."""
        key = (self._arrival[seq.request.request_id], seq.fork_index)
        return (seq.request.priority,) + key if self.policy == "priority" else key

    def unreported(self, request: Request) -> None:
        """Finished outside update(): the next update() reports it."""
        self._unreported.append(request)

    def take_unreported(self) -> list[Request]:
        taken, self._unreported = self._unreported, []
        return taken


class WaitingQueue:
    """The waiting sequences: arrivals at the back, preempted ones back at the front; the head is
    the front under "fcfs", the smallest LiveRequests.key under "priority". Adding, removing any
    one and finding the head cost O(1) (O(log n) under "priority"), so aborting or admitting
    many is linear in their count (a list's remove made a 700 000-prompt abort quadratic)."""

    def __init__(self, live: LiveRequests):
        self._live = live
        self._seqs: collections.OrderedDict[Sequence, None] = collections.OrderedDict()
        # "priority": (key, seq_id, seq); entries of sequences no longer waiting are skipped
        self._heap: list[tuple] = []

    def __len__(self) -> int:
        return len(self._seqs)

    def __iter__(self):
        return iter(self._seqs)

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self._seqs

    def append(self, seq: Sequence) -> None:
        self._seqs[seq] = None
        self._push(seq)

    def push_front(self, seq: Sequence) -> None:
        self.append(seq)
        self._seqs.move_to_end(seq, last=False)

    def remove(self, seq: Sequence) -> None:
        """Take seq out (nothing if it is not waiting)."""
        self._seqs.pop(seq, None)

    def head(self) -> Sequence:
        """The waiting sequence admitted next (the queue must not be empty)."""
        if self._live.policy != "priority":
            return next(iter(self._seqs))
        while self._heap[0][2] not in self._seqs:
            heapq.heappop(self._heap)
        return self._heap[0][2]

    def _push(self, seq: Sequence) -> None:
        if self._live.policy == "priority":  # (key, seq_id) is one sequence's alone: ties
            # are a re-added sequence's old entry, the same object (equal, never ordered)
            heapq.heappush(self._heap, (self._live.key(seq), seq.seq_id, seq))
