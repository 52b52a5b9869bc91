"""The one thread that owns the engine: HTTP handlers never run model code.

Handlers put commands in a queue (add these requests, abort those, call this function); the
thread drains it before every step, so an abort takes effect before the next step runs, runs
`engine.step()`, and hands each output to the asyncio queue of the HTTP call that asked for it.
While nothing is unfinished the thread sleeps on the command queue. A call runs between two
steps, so it never races the engine for the model; it holds every stream up for as long as it
runs, so the web page's passes are not calls but engine requests (probes, read a chunk per step).
"""
import asyncio
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from ..comm import GroupFailed
from ..engine import Request, StepOutput


class EngineStopped(Exception):
    """Sent to the HTTP calls still waiting when the engine thread stops or fails (a 503)."""
    status = 503


class RequestFailed(EngineStopped):
    """Sent to one HTTP call whose request the engine ended with an error (its constraint failed: a 500);
    the other requests go on."""
    status = 500


@dataclass
class Sink:
    """Where one request's outputs go: an HTTP call's asyncio queue, tagged with the choice index."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int
    request: Request

    def put(self, item):
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, item))
        except RuntimeError:   # the event loop is closed: nobody is listening any more
            pass


class EngineLoop:
    def __init__(self, engine, metrics=None):
        self.engine, self.metrics = engine, metrics
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.sinks: dict[str, Sink] = {}
        self.thread = threading.Thread(target=self.run, name="npqwen-engine", daemon=True)
        self.stopping = False
        self.on_failure = None   # called with the error when the engine cannot go on (a rank of the model is gone)

    # -- called from the HTTP side (the asyncio event loop) --

    def start(self):
        self.thread.start()

    def stop(self, timeout: float = 10.0):
        self.stop_soon()
        self.thread.join(timeout)

    def stop_soon(self):
        """Tell every open request that the server is shutting down, and stop (safe in a signal handler)."""
        self.stopping = True
        self.commands.put(("stop",))

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self.stopping

    def submit(self, requests: list[Request]) -> asyncio.Queue:
        """Queue requests (the choices of one HTTP call); their outputs arrive as (index, StepOutput),
        or an EngineStopped if the engine stops first."""
        if not self.alive:
            raise EngineStopped("the server is shutting down" if self.stopping else "the engine thread has stopped")
        outputs: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.commands.put(("add", [Sink(loop, outputs, i, r) for i, r in enumerate(requests)]))
        return outputs

    def abort(self, requests: list[Request]):
        """End these requests before the next step; their pages are freed then."""
        self.commands.put(("abort", [r.request_id for r in requests]))

    def call(self, fn) -> asyncio.Future:
        """Run fn() on the engine thread before its next step; the future gets its result or exception."""
        if not self.alive:
            raise EngineStopped("the server is shutting down" if self.stopping else "the engine thread has stopped")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.commands.put(("call", fn, future, loop))
        return future

    def queued(self) -> int:
        """Requests waiting for their first step: in the scheduler's queue or not yet handed to it."""
        return len(self.engine.scheduler.waiting) + self.commands.qsize()

    # -- the engine thread --

    def run(self):
        engine = self.engine
        while True:
            if not self.take_commands(block=not engine.has_unfinished()):
                return
            if not engine.has_unfinished():
                continue
            try:
                outputs = engine.step()
            except GroupFailed as e:   # tensor parallel: a rank is gone, the model with it; open requests get why
                self.fail_all(EngineStopped(str(e)))
                self.stopping = True
                if self.on_failure is not None:
                    self.on_failure(e)
                return
            except Exception:   # a bug, not a client's doing: fail what is running, keep serving
                traceback.print_exc(file=sys.stderr)
                self.fail_all(EngineStopped("the engine failed on this request's step; see the server log"))
                continue
            for out in outputs:
                self.deliver(out)

    def take_commands(self, block: bool) -> bool:
        """Carry out every queued command (waiting for one if `block`); False once told to stop."""
        try:
            command = self.commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if command[0] == "stop":
                self.fail_all(EngineStopped("the server is shutting down"))
                return False   # requests added after this are told by the HTTP side (alive is False)
            if command[0] == "add":
                for sink in command[1]:
                    self.sinks[sink.request.request_id] = sink
                    self.engine.add(sink.request)
                    if self.metrics:
                        self.metrics.prompt_tokens.inc(len(sink.request.prompt_ids))
            elif command[0] == "call":
                self.run_call(*command[1:])
            elif command[0] == "abort":
                for request_id in command[1]:
                    self.sinks.pop(request_id, None)
                    if request_id in self.engine.requests:
                        self.engine.abort(request_id)
                        if self.metrics:
                            self.metrics.finished.labels("abort").inc()
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return True

    def run_call(self, fn, future: asyncio.Future, loop: asyncio.AbstractEventLoop):
        """Run a handler's function; its result or exception goes back to the handler's event loop."""
        if future.cancelled():   # its client went away while it waited
            return
        try:
            result, error = fn(), None
        except Exception as e:   # handed to the HTTP call that asked, which answers it
            result, error = None, e

        def settle():
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(result)
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:     # the event loop is closed: nobody is listening any more
            pass

    def deliver(self, out: StepOutput):
        sink = self.sinks.get(out.request_id)
        now = time.perf_counter()
        if self.metrics and out.token_ids:
            self.metrics.generation_tokens.inc(len(out.token_ids))
            if sink is not None:
                first = len(sink.request.output_ids) == len(out.token_ids)
                self.metrics.observe_token(sink.request, first, now)
        if out.finished:
            self.sinks.pop(out.request_id, None)
            if self.metrics:
                self.metrics.finished.labels(out.finish_reason).inc()
                if sink is not None and sink.request.task is None:   # a generation (not an embedding, a score)
                    self.metrics.observe_finished(sink.request, now)
        if sink is not None:
            failed = out.finished and out.result is not None and out.result.error is not None
            sink.put(RequestFailed(out.result.error) if failed else out)

    def fail_all(self, error: Exception):
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
        for sink in self.sinks.values():
            sink.put(error)
        self.sinks.clear()
