"""The serving engine on a thread of its own, and the asyncio side's handle on one request.

The engine is single-threaded: only the engine thread calls it. The asyncio side (the HTTP
handlers) puts submissions and cancellations on a thread-safe queue; the engine thread takes
everything queued, runs one `engine.step()` while any request is active (blocking on the queue
when none is), and hands each event to its request's asyncio queue through
`loop.call_soon_threadsafe`.

    loop = EngineLoop(engine); loop.start()
    ticket = loop.submit(Request(...))          # on the event loop
    event = await ticket.next_event()           # Event(tokens, finished, error)
    loop.finish(ticket)                         # always, once: cancels it in the engine if unfinished
    loop.close()                                # after the last ticket: drains and joins the thread
"""

from __future__ import annotations

import asyncio
import queue
import threading


class EngineFailure(Exception):
    """engine.submit or engine.step raised: the engine thread stopped, every request fails."""


class Ticket:
    """One submitted request as the event loop sees it: its engine events arrive on `events`
    (an EngineFailure instead when the engine broke down)."""

    def __init__(self, request, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.request_id: int | None = None      # set by the engine thread on submission
        self.finished = False                   # the last event was taken

    async def next_event(self):
        """The next engine Event for this request; raises EngineFailure if the engine broke."""
        event = await self.events.get()
        if isinstance(event, EngineFailure):
            self.finished = True
            raise event
        self.finished = event.finished
        return event

    def deliver(self, event) -> None:
        """From the engine thread."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class EngineLoop:
    """Owns the engine and its thread. `accepting` turns False when the server drains;
    `in_flight` counts the tickets not finished yet (both are read and written on the event
    loop's thread only)."""

    def __init__(self, engine):
        self.engine = engine
        self.accepting = True
        self.in_flight = 0
        self.failure: EngineFailure | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._tickets: dict[int, Ticket] = {}       # engine request id -> ticket (engine thread only)
        self._failing = threading.Lock()            # a submission is queued wholly before or after a failure
        self._thread = threading.Thread(target=self._run, name="serving-engine", daemon=True)

    # ------------------------------------------------------------------ the event loop's side
    def start(self) -> None:
        self._thread.start()

    def submit(self, request) -> Ticket:
        """Queue an engine Request -> its Ticket. Call from the event loop; raises EngineFailure
        when the engine has stopped."""
        ticket = Ticket(request, asyncio.get_running_loop())
        with self._failing:
            if self.failure is not None:
                raise self.failure
            self._inbox.put(("submit", ticket))
        self.in_flight += 1
        return ticket

    def finish(self, ticket: Ticket) -> None:
        """The request's handler is done with it: cancel it in the engine unless it finished."""
        if not ticket.finished:
            self._inbox.put(("cancel", ticket))
        self.in_flight -= 1

    def stop_accepting(self) -> None:
        self.accepting = False

    @property
    def drained(self) -> bool:
        return not self.accepting and self.in_flight == 0

    def close(self, timeout: float | None = None) -> None:
        """Let the engine finish its active requests, then stop the thread."""
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        stopping = False
        while not (stopping and not self.engine.has_work()):
            block = not self.engine.has_work() and not stopping
            try:
                for command, ticket in self._take(block):
                    if command == "stop":
                        stopping = True
                    elif command == "submit":
                        ticket.request_id = self.engine.submit(ticket.request)
                        self._tickets[ticket.request_id] = ticket
                    elif self._tickets.pop(ticket.request_id, None) is not None:
                        self.engine.cancel(ticket.request_id)
                events = self.engine.step() if self.engine.has_work() else []
            except Exception as e:          # the engine itself broke: fail every request, stop
                self._fail(EngineFailure(f"the engine failed: {type(e).__name__}: {e}"))
                return
            for event in events:
                ticket = self._tickets.get(event.request_id)
                if ticket is None:          # cancelled meanwhile
                    continue
                if event.finished:
                    del self._tickets[event.request_id]
                ticket.deliver(event)

    def _take(self, block: bool) -> list:
        """Everything queued; waits for the first command when `block`."""
        commands = []
        try:
            if block:
                commands.append(self._inbox.get())
            while True:
                commands.append(self._inbox.get_nowait())
        except queue.Empty:
            return commands

    def _fail(self, failure: EngineFailure) -> None:
        with self._failing:
            self.failure = failure
            waiting = [ticket for command, ticket in self._take(block=False) if command == "submit"]
        for ticket in [*self._tickets.values(), *waiting]:
            ticket.deliver(failure)
        self._tickets.clear()
