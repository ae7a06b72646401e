"""`program.run(..., remote=True)`: the server runs the traced IR; this state fills in from its answer."""
from __future__ import annotations

import queue
import threading
from typing import Any

from lang_client.errors import BackendError, LangError


class RemoteExecutor:
    """Read-side twin of StreamExecutor, fed by POST /v1/programs instead of by a local stream."""

    def __init__(self, backend, ir: dict, args: dict[str, Any], stream: bool):
        self.text_ = ""
        self.messages_: list[dict[str, str]] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.error_: BaseException | None = None
        self.out_queue: queue.Queue | None = queue.Queue() if stream else None
        self._lock = threading.Lock()
        self._events: dict[str, threading.Event] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(backend, ir, args, stream), daemon=True,
                                        name="lang-remote")
        self._thread.start()

    @property
    def var_events(self) -> dict[str, threading.Event]:
        return self._events

    def _event(self, name: str) -> threading.Event:
        with self._lock:
            event = self._events.get(name)
            if event is None:
                event = self._events[name] = threading.Event()
                if self._done.is_set() or name in self.variables:
                    event.set()
            return event

    def _run(self, backend, ir, args, stream) -> None:
        try:
            if stream:
                for event in backend.run_program(ir, args, True):
                    if event.get("type") == "variable":
                        self._set(event["name"], event.get("value"), event.get("meta_info"))
                    elif event.get("type") == "result":
                        self._finish(event)
            else:
                self._finish(backend.run_program(ir, args, False))
        except BaseException as e:
            self.error_ = e
        finally:
            with self._lock:
                self._done.set()
                for event in self._events.values():
                    event.set()
            if self.out_queue is not None:
                self.out_queue.put(None)

    def _set(self, name: str, value: Any, meta: Any) -> None:
        with self._lock:
            self.variables[name] = value
            self.meta_info[name] = meta
            event = self._events.get(name)
        if event is not None:
            event.set()
        if self.out_queue is not None:
            self.out_queue.put((name, value if isinstance(value, str) else str(value)))

    def _finish(self, result: Any) -> None:
        if not isinstance(result, dict) or "variables" not in result:
            raise BackendError("/v1/programs answered without variables")
        for name, value in result["variables"].items():
            if name not in self.variables:
                self._set(name, value, result.get("meta_info", {}).get(name))
        self.meta_info.update(result.get("meta_info", {}))
        self.text_ = result.get("text", "")
        self.messages_ = result.get("messages", [])

    # ---- the ProgramState protocol ----
    def get_var(self, name: str) -> Any:
        self._event(name).wait()
        if name in self.variables:
            return self.variables[name]
        if self.error_ is not None:
            raise self.error_
        raise KeyError(f"the remote program produced no variable {name!r}")

    def get_meta_info(self, name: str) -> Any:
        self.get_var(name)
        return self.meta_info.get(name)

    def sync(self) -> None:
        self._done.wait()

    def submit(self, expr) -> None:
        raise LangError("the state of a remote run is read-only")

    def fork(self, size: int):
        raise LangError("the state of a remote run is read-only")

    def end(self) -> None:
        pass
