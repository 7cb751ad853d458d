"""The control channel: requests a rank answers on its kernel's control thread, even while it is blocked.

A rank blocked in a gloo/NCCL collective cannot run a cell or an ``apply``, but its control thread still
runs (the collective releases the GIL). ``ControlChannel.request`` sends one message there and waits for
the reply; the engine side (``sharddbg.engine.control``) defines the messages and their answers. Two
uses: ``diagnose`` (each rank's stack, Flight Recorder and recording so far, for hang reports and for the
events of a rank that hung during a trace) and ``clock_offsets`` (each rank's clock against this
process's: known where they are one clock, else measured by round trips).

ipyparallel has no public call for a custom control message, so ``_send`` uses its client's private
control stream: this module is the only place that does.
"""

from __future__ import annotations

import time

from ..engine import api, clock
from ..errors import ClusterError


class ControlTimeout(ClusterError):
    """Ranks did not answer a control request in time (their control thread is stuck too, or they are gone).

    ``answers``: rank -> reply content, of the ranks that did answer.
    """

    def __init__(self, message: str, answers: dict[int, dict]):
        super().__init__(message)
        self.answers = answers


class ControlChannel:
    """Control requests to the ranks of one running cluster (``engine_ids[r]`` is rank r's engine)."""

    def __init__(self, client, engine_ids: list[int]):
        self.client = client
        self.engine_ids = engine_ids
        # each engine's routing identity, kept: the client forgets an engine the controller unregistered (it
        # stopped answering the heartbeat), and a request to it must time out, not raise KeyError
        self._idents = client._build_targets(list(engine_ids))[0]

    def _send(self, rank: int, message_type: str, content: dict | None):
        """Send; a future of the reply message."""
        ident = self._idents[rank]
        return self.client._send(self.client._control_stream, message_type, content=content or {}, ident=ident)

    def request(self, rank: int, message_type: str, content: dict | None = None, timeout: float = 5.0) -> dict:
        """Send ``message_type`` to rank ``rank``'s control thread; the reply's content, within ``timeout``."""
        return self.request_each([rank], message_type, content, timeout)[rank]

    def request_each(self, ranks, message_type: str, content: dict | None = None,
                     timeout: float = 5.0) -> dict[int, dict]:
        """``request`` to several ranks at once, all answered within one ``timeout``: rank -> reply content.

        Raises :class:`ControlTimeout` naming the ranks that did not answer (``answers`` has the others).
        """
        futures = {rank: self._send(rank, message_type, content) for rank in ranks}
        deadline = time.monotonic() + timeout
        answers, silent = {}, []
        for rank, future in futures.items():
            try:
                answers[rank] = future.result(timeout=max(0.01, deadline - time.monotonic()))["content"]
            except Exception:
                silent.append(rank)
        if silent:
            raise ControlTimeout(f"ranks {silent} did not answer {message_type!r} within {timeout:g} s", answers)
        return answers

    def _offsets_known(self, ranks: list[int], timeout: float) -> dict[int, dict]:
        """The offsets of the ``ranks`` that read this process's own monotonic clock (see ``clock_offsets``), from
        one request to every rank at once."""
        if clock.domain() is None:  # no clock of this process can be named: nothing to ask
            return {}
        t0 = time.monotonic_ns()
        try:
            readings = self.request_each(ranks, api.CLOCK_REQUEST, timeout=timeout)
        except ControlTimeout as exc:
            silent = [r for r in ranks if r not in exc.answers]
            raise ClusterError(f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} did not answer "
                               f"a clock request within {timeout:g} s") from exc
        t1 = time.monotonic_ns()
        added = {rank: clock.added_on_this_clock(reading, t0, t1) for rank, reading in readings.items()}
        return {rank: {"offset_ns": a, "uncertainty_ns": 0} for rank, a in added.items() if a is not None}

    # ------------------------------------------------------------------ uses
    def diagnose(self, ranks, timeout: float = 5.0, brief: bool = False) -> dict[int, dict | None]:
        """Each rank's diagnosis (``sharddbg.engine.control.diagnosis``); None for a rank that did not answer.
        ``brief``: its collectives only (no stack, no recording so far)."""
        ranks = list(ranks)
        try:
            answers = self.request_each(ranks, api.DIAGNOSE_REQUEST, {"brief": True} if brief else None, timeout=timeout)
        except ControlTimeout as exc:
            answers = exc.answers
        return {rank: answers[rank].get("report") if answers.get(rank, {}).get("status") == "ok" else None
                for rank in ranks}

    def clock_offsets(self, samples: int = 15, timeout: float = 5.0, ranks=None,
                      measure_all: bool = False) -> dict[int, dict]:
        """How far each rank's recorder clock is ahead of this process's ``time.monotonic_ns()``.

        Every rank is asked once, all at once. A rank whose clock is this process's own monotonic clock (the same
        ``clock.domain()``: one boot, one time namespace) is ahead by exactly what it adds to it
        (``injected_offset_ns``, 0 but in tests), uncertainty 0, once its reading lies within that round trip
        (else its clock is not what it says, and it is measured). Any other rank is measured NTP-style, one after
        another: ``samples`` round trips, the one with the shortest round trip wins, offset = engine time -
        midpoint, uncertainty = half its round trip. ``measure_all``: every rank measured so.
        Rank -> {"offset_ns", "uncertainty_ns"}.
        """
        ranks = list(range(len(self.engine_ids)) if ranks is None else ranks)
        offsets = {} if measure_all or not ranks else self._offsets_known(ranks, timeout)
        for rank in ranks:
            if rank in offsets:
                continue
            best_round_trip_ns = best_offset_ns = None
            for _ in range(samples):
                t0 = time.monotonic_ns()
                try:
                    reply = self.request(rank, api.CLOCK_REQUEST, timeout=timeout)
                except ControlTimeout as exc:
                    raise ClusterError(f"rank {rank} did not answer a clock request within {timeout:g} s") from exc
                t1 = time.monotonic_ns()
                if best_round_trip_ns is None or t1 - t0 < best_round_trip_ns:
                    best_round_trip_ns, best_offset_ns = t1 - t0, int(reply["now_ns"]) - (t0 + t1) // 2
            offsets[rank] = {"offset_ns": best_offset_ns, "uncertainty_ns": best_round_trip_ns // 2}
        return offsets
