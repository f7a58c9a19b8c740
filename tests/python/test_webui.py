"""The chat page at `/`, in a real headless browser (Chromium from the distribution's packages,
driven by selenium through chromedriver): the page loads under its Content-Security-Policy with no
violation, asks for the API key, shows the model and target, streams an answer to a question
through the server's own API (the reference question: the answer names Paris), then the speed;
the second turn carries the conversation. A screenshot is kept as target/webui-chat.png. Without
the browser the test skips, saying so, unless METRALE_REQUIRE_BROWSER=1 (ci/test.sh sets it after
installing Chromium), where it fails. Over plain HTTP: the page's headers, and `--no-webui`.
"""

import os
import pathlib
import shutil

import httpx
import pytest

from conftest import API_KEY, start_server, stop_server

REPO = pathlib.Path(__file__).resolve().parents[2]
Q = "What is the capital of France? Answer in one sentence."


def browser_paths():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (chromium and driver):
        msg = ("Chromium and chromedriver are needed (Debian: apt-get install chromium chromium-driver), "
               f"found {chromium} and {driver}")
        if os.environ.get("METRALE_REQUIRE_BROWSER") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return chromium, driver


@pytest.fixture(scope="module")
def browser():
    chromium, driver_path = browser_paths()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--no-first-run", "--window-size=1100,800"]:
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)
    try:
        yield d
    finally:
        d.quit()


def test_the_page_streams_an_answer_in_a_browser(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 120)
    browser.get(server.base + "/")
    assert browser.title == "metrale"
    # the server asks for a key: the page says so, then shows the model once it has one
    wait.until(ec.text_to_be_present_in_element((By.ID, "model"), "API key"))
    key = browser.find_element(By.ID, "key")
    key.send_keys(API_KEY)
    browser.find_element(By.ID, "prompt").click()  # leaving the key field fires its change
    model = httpx.get(server.base + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"][0]
    wait.until(ec.text_to_be_present_in_element((By.ID, "model"), model["id"]))
    prompt = browser.find_element(By.ID, "prompt")
    prompt.send_keys(Q)
    browser.find_element(By.ID, "send").click()
    done = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, ".msg.assistant[data-done='1']")))
    answer = done.text
    assert "Paris" in answer and "error" not in done.get_attribute("class"), answer
    wait.until(ec.text_to_be_present_in_element((By.ID, "stats"), "tokens/s"))
    # a second turn sends the conversation: two user and two assistant bubbles
    browser.find_element(By.ID, "prompt").send_keys("And of Italy?")
    browser.find_element(By.ID, "send").click()
    wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done='1']")) == 2)
    assert len(browser.find_elements(By.CSS_SELECTOR, ".msg.user")) == 2
    second = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[1]
    assert second.text and "error" not in second.get_attribute("class"), second.text
    shot = REPO / "target" / "webui-chat.png"
    shot.parent.mkdir(exist_ok=True)
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    # nothing the page did was refused by its policy
    logs = browser.get_log("browser")
    assert not [e for e in logs if "Content Security Policy" in e["message"]], logs


def test_the_page_is_served_under_its_policy(server):
    r = httpx.get(server.base + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "unsafe" not in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    for path, kind in [("/webui/app.js", "text/javascript"), ("/webui/app.css", "text/css")]:
        f = httpx.get(server.base + path)
        assert f.status_code == 200 and f.headers["content-type"].startswith(kind)


def test_no_webui_serves_no_page(tmp_path):
    s = start_server(tmp_path / "log", ["--ctx-size", "256", "--no-webui"])
    try:
        r = httpx.get(s.base + "/")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert httpx.get(s.base + "/health").status_code == 200
    finally:
        stop_server(s.proc)
