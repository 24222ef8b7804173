"""The engine's request table: one record per live request (the Request, its prompt text), the
requests that failed on their own since the last step returned, and their RequestOutput
snapshots. Records leave the table when their request finishes or is aborted."""

from __future__ import annotations

import dataclasses
import logging

from jaxserve.core.output_processor import OutputProcessor
from jaxserve.core.outputs import RequestMetrics, RequestOutput
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.sequence import Request

log = logging.getLogger("jaxserve.engine")


@dataclasses.dataclass
class RequestRecord:
    request: Request
    prompt: str | None  # the prompt's text when it came as text


class RequestTable:
    def __init__(self, scheduler: Scheduler, outputs: OutputProcessor):
        self.scheduler, self.outputs = scheduler, outputs
        self._records: dict[str, RequestRecord] = {}
        self._failed: list[Request] = []  # failed on their own, not reported yet

    def add(self, request: Request, prompt: str | None) -> None:
        self._records[request.request_id] = RequestRecord(request, prompt)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._records

    def remove(self, request_id: str) -> None:
        """Forget an aborted request (its outputs' state included)."""
        record = self._records.pop(request_id, None)
        if record is not None:
            self.outputs.release(record.request)

    def fail(self, request_id: str, error: str) -> None:
        """Fail one request alone (the scheduler frees it); reported by the next take_failed."""
        record = self._records.get(request_id)
        if self.scheduler.abort(request_id, error) and record is not None:
            log.warning("request %s failed: %s", request_id, error)
            self._failed.append(record.request)

    def failed_with_the_pool(self, requests: list[Request]) -> None:
        """Requests failed by a step that lost the KV pool, to report like fail's."""
        self._failed += [r for r in requests if r.request_id in self._records]

    def take_failed(self, now: float) -> list[RequestOutput]:
        failed, self._failed = self._failed, []
        return self.snapshots(failed, now)

    def snapshots(self, changed: list[Request], now: float) -> list[RequestOutput]:
        """A RequestOutput of each request; finished ones leave the table."""
        results = []
        for request in changed:
            if request.is_finished and request.finished_time is None:
                request.finished_time = now
            record = self._records.get(request.request_id)
            try:
                results.append(self.outputs.snapshot(request, record.prompt if record else None))
            except Exception as e:  # noqa: BLE001 - fails this request alone
                self.scheduler.abort(request.request_id, f"building its output failed: {e!r}")
                results.append(RequestOutput(
                    request.request_id, None, list(request.prompt_token_ids), [], finished=True,
                    metrics=RequestMetrics(request.arrival_time), error=request.error))
            if request.is_finished:
                self._records.pop(request.request_id, None)
                self.outputs.release(request)
        return results
