"""The real server: `python -m transformer.serve` in its own process, called over HTTP and driven in a headless
Chromium (Debian's chromium and chromium-driver, through Selenium; nothing downloaded)."""

import collections
import http.client
import json
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from common.server import start_server

from .helpers.junk_requests import junk_requests
from .helpers.prerequisites import require


def start(ckpt) -> tuple[subprocess.Popen, str]:
    process, port = start_server([ckpt])
    return process, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def server(trained):
    tmp, _, ckpt = trained
    process, url = start(ckpt)
    yield url, (tmp / "c" / "test.de").read_text().splitlines()
    process.terminate()
    process.wait(timeout=60)


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


@pytest.mark.slow  # a server process and a browser
def test_the_page_translates_in_a_real_browser(server, tmp_path):
    require(bool(shutil.which("chromium") and shutil.which("chromedriver")), "chromium and chromedriver",
            "apt-get install chromium chromium-driver")  # fmt: skip
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url, sources = server
    expected = post(f"{url}/translate", {"q": sources[0], "source": "de", "target": "en"})["translatedText"]
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        browser.get(url)
        WebDriverWait(browser, 30).until(lambda b: b.find_elements(By.CSS_SELECTOR, "#pair option"))
        assert browser.find_element(By.CSS_SELECTOR, "#pair option").text == "German → English"  # names, not codes
        browser.find_element(By.ID, "input").send_keys(sources[0])
        browser.find_element(By.ID, "translate").click()
        WebDriverWait(browser, 60).until(lambda b: b.find_element(By.ID, "output").text)
        assert browser.find_element(By.ID, "output").text == expected
        assert browser.find_element(By.ID, "time").text.endswith(" ms")
        browser.save_screenshot(str(tmp_path / "page.png"))
    finally:
        browser.quit()
    assert (tmp_path / "page.png").stat().st_size > 1000


@pytest.mark.slow  # a server process under load
def test_sigterm_under_load_answers_every_accepted_request(trained):
    """64 clients send one sentence after another; SIGTERM comes while they do. Every request the server accepted
    is answered (200), the rest refused; none is cut off mid-answer. A connection whose request the server never read
    (still in the kernel's backlog, or accepted by uvicorn but not yet read: it closes those at shutdown) is reset or
    closed before any byte of an answer, which counts as refused only after the SIGTERM. That a request the server
    had read is not among them, the server says: it answers some after the SIGTERM (one that died at once would
    answer none), and uvicorn logs an error for each one it cancels."""
    tmp, _, ckpt = trained
    sources = (tmp / "c" / "test.de").read_text().splitlines()
    process, url = start(ckpt)
    outcomes, stop, terminated = [], threading.Event(), threading.Event()
    unread = ConnectionError  # reset, closed (RemoteDisconnected) or a broken pipe: no byte of an answer came

    def client(i: int) -> None:
        n = 0
        while not stop.is_set():
            body = json.dumps({"q": sources[(i + n) % len(sources)], "source": "de", "target": "en"}).encode()
            request = urllib.request.Request(f"{url}/translate", body, {"Content-Type": "application/json"})
            n += 1
            try:
                response = urllib.request.urlopen(request, timeout=60)  # returns once the status line came
                late = terminated.is_set()
            except Exception as e:  # URLError wraps what failed in connecting and sending, not in the status line
                reason = e.reason if isinstance(e, urllib.error.URLError) else e
                refused = (
                    isinstance(reason, ConnectionRefusedError) or isinstance(reason, unread) and terminated.is_set()
                )
                outcomes.append("refused" if refused else f"lost: {e!r}")
                if refused:
                    return
                continue
            try:
                with response:
                    json.loads(response.read())
                outcomes.append("answered after SIGTERM" if late else "answered")
            except Exception as e:  # cut off mid-answer
                outcomes.append(f"lost: {e!r}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(5)
        terminated.set()
        process.send_signal(signal.SIGTERM)
        said = process.communicate(timeout=90)[1]  # read as it comes: a server blocked on a full pipe never exits
    finally:
        stop.set()
        process.kill()  # nothing if it has exited
    for thread in threads:
        thread.join(timeout=60)
    # uvicorn finishes the accepted requests, then raises the signal again: the exit status says SIGTERM ended it
    assert process.returncode == -signal.SIGTERM, said[-2000:]
    assert "ERROR" not in said and "Traceback" not in said, said[-2000:]
    lost = [o for o in outcomes if o.startswith("lost")]
    answered, late = outcomes.count("answered"), outcomes.count("answered after SIGTERM")
    assert answered > 64 and late > 0 and not lost, (answered, late, lost[:3])


@pytest.mark.slow  # a server process and 3,000 requests
def test_thousands_of_malformed_requests_leave_the_server_answering_correctly(server):
    """Over keep-alive connections, as clients send them: every junk request gets a status and a JSON error (or a
    translation), the connection stays usable, and a good request afterwards gets the right translation."""
    url, sources = server
    expected = post(f"{url}/translate", {"q": sources[0], "source": "de", "target": "en"})
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
    statuses = collections.Counter()
    for path, body, kind in junk_requests(1, 3000, 5000):
        connection.request("POST", path, body, {"Content-Type": kind})
        response = connection.getresponse()
        answer = json.loads(response.read())
        assert response.status == 200 or response.status < 500 and set(answer) == {"error"}, (body, answer)
        statuses[response.status] += 1
    assert statuses[400] > 1000 and statuses[413] > 10 and statuses[200] > 50, statuses
    assert post(f"{url}/translate", {"q": sources[0], "source": "de", "target": "en"}) == expected
