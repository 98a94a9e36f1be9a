"""Browser test: `streamlit run dashboards/app.py` on loopback, headless Chromium (Debian's /usr/bin/chromium driven
by Playwright's python package; no browser download) loads every page, waits for the script to finish, saves a
screenshot, and fails if a page shows a Streamlit exception."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import free_port

try:
    from tests.dashboard_fixtures import dashboard_store
except ImportError:
    from dashboard_fixtures import dashboard_store  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
PAGES = {"runs": "", "gate": "gate", "levels": "levels", "collapsed": "collapsed", "variants": "variants"}
SHOTS = Path(os.environ.get("SAGE_SCREENSHOTS", REPO / "outputs" / "dashboard-screenshots"))
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]

pytestmark = pytest.mark.e2e


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"streamlit exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.read().strip() == b"ok":
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError("streamlit did not answer /_stcore/health")


@pytest.fixture(scope="module")
def streamlit_server(request):
    if not (os.path.exists(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"{CHROMIUM} is absent: install Debian's chromium (`make browser`) to run the browser test")
    pytest.importorskip("playwright.sync_api", reason="the playwright python package is not installed")
    # SAGE_E2E_TRACKING_URI: look at another store (e.g. a real study) instead of the synthetic one
    uri = os.environ.get("SAGE_E2E_TRACKING_URI") or request.getfixturevalue("dashboard_store")["uri"]
    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false"}
    SHOTS.mkdir(parents=True, exist_ok=True)
    log = (SHOTS / "streamlit.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(REPO / "dashboards" / "app.py"),
                             "--server.headless", "true", "--server.address", "127.0.0.1", "--server.port", str(port),
                             "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait_script_done(page, timeout_ms: int = 90_000) -> None:
    page.wait_for_selector('[data-testid="stAppViewContainer"]', timeout=timeout_ms)
    # the page's own content has arrived (a title), and the script-running widget is gone
    page.wait_for_selector('h1', timeout=timeout_ms)
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=timeout_ms)
    # charts draw after the script: wait for vega to render every chart on the page
    page.wait_for_function(
        "() => [...document.querySelectorAll('[data-testid=\"stVegaLiteChart\"]')]"
        ".every(c => c.querySelector('svg, canvas'))", timeout=timeout_ms)
    page.wait_for_timeout(1500)


def test_every_page_renders_in_chromium(streamlit_server):
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    problems, titles = {}, {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1000})
            for name, path in PAGES.items():
                page.set_viewport_size({"width": 1500, "height": 1000})
                page.goto(f"{streamlit_server}/{path}", wait_until="domcontentloaded")
                _wait_script_done(page)
                # Streamlit scrolls inside its main section: grow the viewport to the content for a whole-page shot
                height = page.evaluate("() => (document.querySelector('[data-testid=\"stMain\"]') || "
                                       "document.body).scrollHeight")
                page.set_viewport_size({"width": 1500, "height": max(1000, min(int(height) + 40, 8000))})
                _wait_script_done(page)
                page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
                errors = page.locator('[data-testid="stException"]')
                if errors.count():
                    problems[name] = errors.first.inner_text()[:2000]
                if page.get_by_text("Page not found").count():
                    problems[name] = "Page not found"
                titles[name] = page.locator("h1").first.inner_text()
        finally:
            browser.close()
    assert not problems, f"Streamlit exceptions: {problems}"
    assert titles == {"runs": "Runs", "gate": "Gate statistics", "levels": "Per-prompt hint levels",
                      "collapsed": "Collapsed prompts", "variants": "Variant comparison"}, titles
    for name in PAGES:
        assert (SHOTS / f"{name}.png").stat().st_size > 10_000, f"screenshot of {name} looks empty"
