"""A headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: commands on
fd 3, replies and events on fd 4, each a JSON message ending in NUL), with the standard library only.

``Browser.open(url)`` loads a page and keeps what its console and the network reported: console.error and
console.warn calls, uncaught exceptions, and log entries of level error (a failed request, a blocked script).
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_chromium() -> str | None:
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class Page:
    url: str
    title: str
    problems: list[str] = field(default_factory=list)  # console errors and warnings, exceptions, failed loads

    def evaluate(self, browser: Browser, expression: str) -> Any:
        return browser.evaluate(expression)


class Browser:
    def __init__(self, binary: str, *, width: int = 1280, height: int = 900, timeout: float = 60.0) -> None:
        self.timeout = timeout
        cmd_r, cmd_w = os.pipe()   # we write commands, chromium reads fd 3
        ev_r, ev_w = os.pipe()     # chromium writes fd 4, we read
        self._profile = Path(os.environ.get("TMPDIR", "/tmp")) / f"unidist-docs-chromium-{os.getpid()}"
        argv = [binary, "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--mute-audio",
                "--disable-background-networking", f"--user-data-dir={self._profile}",
                f"--window-size={width},{height}", "about:blank"]

        def fds() -> None:  # in the child: the pipe ends as fds 3 and 4 (moved out of the way first)
            high_r, high_w = fcntl.fcntl(cmd_r, fcntl.F_DUPFD, 100), fcntl.fcntl(ev_w, fcntl.F_DUPFD, 100)
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        # fds 3 and 4 are kept open in the child (pass_fds); the child's own copies are the ones fds() made
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, preexec_fn=fds, pass_fds=(3, 4))
        os.close(cmd_r)
        os.close(ev_w)
        self._w = os.fdopen(cmd_w, "wb", buffering=0)
        self._r = os.fdopen(ev_r, "rb", buffering=0)
        self._buf = b""
        self._next = 0
        self._events: list[dict[str, Any]] = []
        self.session = ""
        target = self.call("Target.createTarget", url="about:blank", session=False)["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True, session=False)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")

    # -- the protocol
    def _read(self) -> dict[str, Any]:
        while b"\0" not in self._buf:
            chunk = self._r.read(1 << 16)
            if not chunk:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"chromium closed its DevTools pipe (exit {self.proc.poll()}): {err[-2000:]}")
            self._buf += chunk
        msg, _, self._buf = self._buf.partition(b"\0")
        return dict(json.loads(msg))

    def call(self, method: str, *, session: bool = True, **params: Any) -> dict[str, Any]:
        self._next += 1
        msg: dict[str, Any] = {"id": self._next, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        self._w.write(json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))
            self._events.append(reply)

    def _wait_event(self, method: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            for i, ev in enumerate(self._events):
                if ev.get("method") == method:
                    return self._events.pop(i)
            self._events.append(self._read())
        raise TimeoutError(f"no {method} within {self.timeout} s")

    # -- what the tests use
    def open(self, url: str, settle: float = 1.5) -> Page:
        self._events.clear()
        self.call("Page.navigate", url=url)
        self._wait_event("Page.loadEventFired")
        end = time.monotonic() + settle  # late scripts (the search index, deferred bundles) report after load
        while time.monotonic() < end:
            self.evaluate("1")
        title = str(self.evaluate("document.title"))
        return Page(url, title, self._problems())

    def _problems(self) -> list[str]:
        out = []
        for ev in self._events:
            method, p = ev.get("method"), ev.get("params", {})
            if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "warning", "assert"):
                out.append(f"console.{p['type']}: " + " ".join(str(a.get("value", a.get("description", "")))
                                                                 for a in p.get("args", [])))
            elif method == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                out.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
            elif method == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                e = p["entry"]
                out.append(f"log {e.get('source')}: {e.get('text')} {e.get('url', '')}".strip())
        return out

    def evaluate(self, expression: str) -> Any:
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression}: {res['exceptionDetails']}")
        return res["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self.call("Browser.close", session=False)
        except (RuntimeError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for f in (self._w, self._r):
            f.close()
        if self.proc.stderr:
            self.proc.stderr.close()
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
