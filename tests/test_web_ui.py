"""The chat page at `/` in a real headless browser (Debian's chromium driven by playwright).

Needs `apt-get install chromium` and `pip install playwright`; never `playwright install`
(no browser downloads): we launch the system chromium by path.
"""
from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

CHROMIUM = os.environ.get("SPARSEINFER_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def browser():
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)) and not shutil.which("chromium"):
        pytest.skip(f"chromium is not installed at {CHROMIUM} (apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM if os.path.isfile(CHROMIUM) else shutil.which("chromium"),
                               args=ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(smollm2_path):
    import sparseinfer
    from sparseinfer.server.app import Settings, create_app
    from sparseinfer.server.background import BackgroundServer
    from sparseinfer.server.engine import Engine

    llm = sparseinfer.load(smollm2_path, ctx_size=512)
    engine = Engine(llm, parallel=1)
    settings = Settings.for_model(llm)
    with BackgroundServer(create_app(settings, engine)) as s:
        s.settings = settings
        yield s


def test_chat_page_streams_a_reply(browser, server):
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/")
    page.fill("#max-tokens", "12")
    page.fill("#temperature", "0")
    page.fill("#input", "What is the capital of France?")
    page.click("#send")
    page.wait_for_selector(".msg.user", timeout=10_000)
    # streamed text appears while the reply is still open, then the reply completes
    page.wait_for_function("document.querySelector('.msg.assistant') && "
                           "document.querySelector('.msg.assistant').textContent.trim().length > 0",
                           timeout=60_000)
    page.wait_for_selector(".msg.assistant.done", timeout=60_000)
    reply = page.text_content(".msg.assistant")
    assert "Paris" in reply, reply
    assert "error" not in (page.get_attribute(".msg.assistant", "class") or "")
    assert page.text_content("#model") == server.settings.model_id
    assert not errors, errors
    # a second turn carries the conversation
    page.fill("#input", "And of Italy?")
    page.press("#input", "Enter")
    page.wait_for_function("document.querySelectorAll('.msg.assistant.done').length == 2", timeout=60_000)
    assert page.locator(".msg.user").count() == 2
    page.close()
