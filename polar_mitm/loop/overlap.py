"""`polar-mitm loop --overlap N`: rollouts (and merges) run up to N iterations ahead of the trainer, in a thread.

Polar's asynchronous design: iteration K+N's sessions run while iteration K trains, so their data is up to N weight
versions behind; the trainer's importance ratios against the recorded behaviour logprobs correct for it. The thread
prepares the iterations in order and hands each to the trainer's thread through a queue; a permit per finished
training bounds how far ahead it gets.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from polar_mitm.loop.stages import IterationData


class RolloutsAhead:
    """A thread prepares (`prepare`: rollout and merge) the `iterations` in order, each once the trainer has finished
    all but `overlap` of the trainings before it (so its data is at most `overlap` weight versions old when it is
    trained on)."""

    def __init__(self, prepare: Callable[[int], IterationData], iterations: range, overlap: int) -> None:
        self.prepare, self.iterations = prepare, iterations
        self.permits = threading.Semaphore(overlap + 1)  # rollout r may start once training r-1-N is done
        self.ready: queue.Queue[tuple[IterationData | None, BaseException | None]] = queue.Queue()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._produce, name="polar-rollouts", daemon=True)

    def __enter__(self) -> RolloutsAhead:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stopping.set()
        self.permits.release()  # a producer waiting for a permit sees the stop
        self.thread.join()  # a rollout under way finishes first (its harnesses must not outlive the loop)

    def _produce(self) -> None:
        try:
            for k in self.iterations:
                self.permits.acquire()
                if self.stopping.is_set():
                    return
                self.ready.put((self.prepare(k), None))
        except BaseException as exc:  # surfaced in the trainer's thread, at its next get()
            self.ready.put((None, exc))

    def get(self, k: int) -> IterationData:
        """Iteration k's rollout and merge (waiting for them)."""
        data, error = self.ready.get()
        if error is not None:
            raise error
        assert data is not None
        return data

    def trained(self) -> None:
        """A training is done: one more iteration may be prepared."""
        self.permits.release()
