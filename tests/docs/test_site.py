"""The documentation site builds strictly and renders in a real browser (headless Chromium over the DevTools
protocol, tests/docs/browser.py): the home page and an API reference page have their title, the navigation and
their content, and no page of the site logs a console error, an uncaught exception or a failed request.
Screenshots of both pages are kept: under the test's tmp dir, copied to docs/_screenshots/ (not committed).

Run by the tox ``docs`` env (``mkdocs build --strict`` first, then these with DOCS_SITE pointing at the build).
Without Chromium the browser tests skip saying why, unless REQUIRE_BROWSER=1 (tox sets it) makes that a
failure: .ci/install_chromium.sh installs it from Debian's packages as root.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser import Browser, find_chromium

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "docs" / "_screenshots"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built site: DOCS_SITE (tox builds it with --strict just before), else built here, strictly."""
    given = os.environ.get("DOCS_SITE")
    if given and (Path(given) / "index.html").exists():
        return Path(given)
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -c constraints.txt '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.fixture(scope="module")
def server(site: Path) -> Iterator[str]:
    """The site over http on 127.0.0.1 (over file:// the search worker cannot start, which is an error)."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    binary = find_chromium()
    if binary is None:
        reason = "no Chromium (as root on Debian: bash .ci/install_chromium.sh, or apt-get install chromium)"
        if os.environ.get("REQUIRE_BROWSER") == "1":
            pytest.fail(f"{reason}, but REQUIRE_BROWSER=1 requires the browser check")
        pytest.skip(reason)
    with Browser(binary) as b:
        yield b


def _keep(browser: Browser, name: str, tmp_path: Path) -> Path:
    shot = browser.screenshot(tmp_path / name)
    assert shot.stat().st_size > 20_000, "a screenshot of a rendered page is larger than this"
    SHOTS.mkdir(exist_ok=True)
    kept = shutil.copy(shot, SHOTS / name)
    print(f"screenshot: {shot}\nscreenshot: {kept}")
    return Path(kept)


def test_the_check_sees_console_errors(browser: Browser) -> None:
    """The browser check cannot pass by seeing nothing: an error logged, an exception and a missing image."""
    page = browser.open("data:text/html,<title>t</title><img src='http://127.0.0.1:9/x.png'>"
                        "<script>console.error('boom');undefined_name();</script>", settle=0.5)
    text = "\n".join(page.problems)
    assert "boom" in text and "undefined_name" in text, page.problems


def test_home_page_renders(browser: Browser, server: str, tmp_path: Path) -> None:
    page = browser.open(server + "/")
    assert page.title == "unidist", page.title
    assert page.problems == [], page.problems
    nav = browser.evaluate("[...document.querySelectorAll('nav.md-nav--primary .md-nav__link')]"
                           ".map(a => a.textContent.trim())")
    for label in ("Getting started", "Installing the engines", "Launchers", "Training", "ZeRO", "Checkpoints",
                  "Troubleshooting", "API reference", "Changelog"):
        assert label in nav, nav
    assert browser.evaluate("document.querySelector('article h1').textContent").startswith("unidist")
    assert browser.evaluate("document.querySelectorAll('article pre code').length") >= 1  # the example
    _keep(browser, "home.png", tmp_path)


def test_api_page_renders(browser: Browser, server: str, tmp_path: Path) -> None:
    page = browser.open(server + "/api/manager/")
    assert page.title == "Manager - unidist", page.title
    assert page.problems == [], page.problems
    headings = browser.evaluate("[...document.querySelectorAll('article .doc-heading code')]"
                                ".map(h => h.textContent.trim())")
    for name in ("Manager", "prepare", "allreduce", "save_checkpoint", "new_group"):
        assert any(h == name or h.startswith(name + "(") for h in headings), headings
    assert browser.evaluate("document.querySelector('nav.md-nav--primary') !== null")
    _keep(browser, "api-manager.png", tmp_path)


def test_every_page_loads_without_errors(browser: Browser, server: str, site: Path) -> None:
    pages = sorted(p.relative_to(site).parent.as_posix() for p in site.rglob("index.html")
                   if not p.relative_to(site).parts[0].startswith(("assets", "search")))
    assert len(pages) >= 30, pages
    bad = {}
    for rel in pages:
        page = browser.open(f"{server}/{'' if rel == '.' else rel + '/'}", settle=0.2)
        if page.problems or not page.title.endswith("unidist"):
            bad[rel] = (page.title, page.problems)
    assert not bad, bad
