"""Sustained streaming load for end-to-end tests that change the cluster under
it (autoscaling, rollouts): every stream must end with a finish_reason."""

from __future__ import annotations

import threading
from collections import Counter

import openai


class StreamingLoad:
    """Threads that each stream chat completions back to back until stopped.
    A stream counts as complete only when it ends with a finish_reason."""

    def __init__(self, base_url: str, secret: str, model: str, request: dict):
        self.request = request
        self.client = openai.OpenAI(base_url=base_url + "/v1", api_key=secret, max_retries=0, timeout=180)
        self.model = model
        self.outcomes: Counter[str] = Counter()
        self.errors: list[str] = []
        self._threads: list[tuple[threading.Thread, threading.Event]] = []

    def add(self, count: int) -> None:
        for _ in range(count):
            stop = threading.Event()
            thread = threading.Thread(target=self._run, args=(stop,), daemon=True)
            thread.start()
            self._threads.append((thread, stop))

    def stop(self) -> None:
        self.remove(len(self._threads))

    def remove(self, count: int) -> None:
        """Stop ``count`` threads after their current stream (no stream is cut)."""
        for thread, stop in self._threads[:count]:
            stop.set()
            thread.join(timeout=180)
        self._threads = self._threads[count:]

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                finish = None
                for chunk in self.client.chat.completions.create(model=self.model, stream=True, **self.request):
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                self.outcomes["complete" if finish in ("length", "stop") else f"finish={finish}"] += 1
            except Exception as exc:  # any failure is a test failure, counted and kept
                self.outcomes["error"] += 1
                self.errors.append(repr(exc))
