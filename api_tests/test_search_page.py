"""The search page at / driven by headless Chromium (Debian's chromium + chromedriver, via Selenium).

Search by a gallery caption (the notice above the grid shows the expected precision, the query kind
and the server's warnings), move the relevance slider up (fewer hits, all above it), to 1.0 (none,
and a "0 passed" message rather than an error), search words outside the benchmark's vocabulary (a
warning), then upload a PNG (caption hits, with their own notice). Saves screenshots into tmp_path
and prints their paths.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALL = "apt-get install -y chromium chromium-driver"
WAIT_S = 10

SET_SLIDER = """
const slider = arguments[0];
slider.value = arguments[1];
slider.dispatchEvent(new Event('input', {bubbles: true}));
slider.dispatchEvent(new Event('change', {bubbles: true}));
return slider.value;
"""

# The grid has rendered the response to the slider's current value (the request fired after the
# ~150 ms debounce) and nothing is in flight.
GRID_SETTLED = """
const results = document.getElementById('results');
const slider = document.getElementById('slider');
return results.dataset.state === 'done' && !results.hasAttribute('aria-busy')
    && Math.abs(Number(results.dataset.threshold) - Number(slider.value)) < 1e-9;
"""

FIRST_IMAGE_LOADED = """
const img = document.querySelector('#results .hit img');
return img !== null && img.complete && img.naturalWidth > 0;
"""


@pytest.fixture(scope="module")
def driver():
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        message = f"{', '.join(missing)} missing: {INSTALL}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="icr-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1200,1000",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    # An explicit driver path: Selenium Manager never runs (it would try to download one).
    browser = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    browser.set_page_load_timeout(30)
    try:
        yield browser
    finally:
        browser.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _gallery_caption(url: str) -> str:
    """A caption of the gallery image nearest to a simple query: a query the index surely matches."""
    r = httpx.post(url + "/v1/search/text", json={"text": "a red circle", "k": 20}, timeout=30)
    r.raise_for_status()
    for hit in r.json()["hits"]:
        captions = hit["metadata"].get("captions") or []
        if not hit["is_distractor"] and captions:
            return captions[0]
    return "a red circle"


def _hits(driver) -> list[dict[str, float | str]]:
    # One script reads every card at once: the page re-renders its cards (labels arrive after the
    # hits), so element handles found first and read one by one can go stale in between.
    cards = driver.execute_script(
        "return [...document.querySelectorAll('#results .hit')]"
        ".map(c => [c.dataset.id, c.dataset.score, c.dataset.relevance]);"
    )
    return [
        # data-relevance is empty where a hit has none (a query outside the calibration's evidence)
        {"id": id_, "score": float(score), "relevance": float(relevance or "nan")}
        for id_, score, relevance in cards
    ]


def _set_slider(driver, wait, value: float) -> float:
    from selenium.webdriver.common.by import By

    slider = driver.find_element(By.ID, "slider")
    actual = float(driver.execute_script(SET_SLIDER, slider, f"{value:.2f}"))
    wait.until(lambda d: d.execute_script(GRID_SETTLED))
    return actual


# Read in one script, so a re-render between reads cannot leave a stale element.
READ_NOTICE = """
const box = document.getElementById(arguments[0]);
return {
  displayed: !box.hidden && box.getClientRects().length > 0,
  level: box.dataset.level || "",
  kind: box.dataset.kind || "",
  expected_precision: box.dataset.expectedPrecision || "",
  evidence: box.dataset.evidence || "",
  text: box.innerText,
  warnings: Array.from(box.querySelectorAll('.notice-warning'), (w) => w.textContent),
};
"""


# The labels the grid shows on its hits (GET /v1/feedback/labels), read in one script.
READ_MARKS = """
return Array.from(document.querySelectorAll('#results .hit'), (hit) => {
  const count = hit.querySelector('.label-count');
  return {
    id: hit.dataset.id,
    label: hit.dataset.label || "",
    judgements: hit.dataset.judgements || "",
    yes: hit.querySelector('.label-yes').getAttribute('aria-pressed'),
    no: hit.querySelector('.label-no').getAttribute('aria-pressed'),
    count: count.getClientRects().length > 0 ? count.textContent : "",
  };
});
"""
LABELS_SHOWN = "return document.getElementById('results').dataset.labels === 'shown';"


def _marks(driver) -> dict[str, dict[str, str]]:
    """Each hit of the grid (by id): its shown label, judgements, pressed buttons and count."""
    return {mark.pop("id"): mark for mark in driver.execute_script(READ_MARKS)}


def _check_marks(driver, labelled: dict[str, bool]) -> None:
    """The grid shows each labelled hit's verdict pressed, with one judgement counted; no other."""
    marks = _marks(driver)
    assert set(labelled) <= set(marks), (labelled, marks)
    for image_id, mark in marks.items():
        if image_id in labelled:
            relevant = labelled[image_id]
            want = {
                "label": "relevant" if relevant else "not-relevant",
                "judgements": "1",
                "yes": str(relevant).lower(),
                "no": str(not relevant).lower(),
                "count": "✓1 ✗0" if relevant else "✓0 ✗1",
            }
        else:
            want = {"label": "", "judgements": "", "yes": "false", "no": "false", "count": ""}
        assert mark == want, (image_id, mark)


def _notice(driver, element_id: str = "notice") -> dict:
    """What the notice above a result list shows: facts line, warnings, and its data attributes."""
    return driver.execute_script(READ_NOTICE, element_id)


def _passed(driver) -> int:
    from selenium.webdriver.common.by import By

    return int(driver.find_element(By.ID, "summary").get_attribute("data-passed"))


def test_search_page(server, driver, tmp_path: Path) -> None:
    from PIL import Image, ImageDraw
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    start = time.monotonic()
    wait = WebDriverWait(driver, WAIT_S)
    query = _gallery_caption(server.url)

    driver.get(server.url + "/")
    wait.until(lambda d: d.find_element(By.ID, "info").get_attribute("data-state") == "ready")
    info = driver.find_element(By.ID, "info").text
    assert "distractors" in info and "calibrated" in info, info
    slider = driver.find_element(By.ID, "slider")
    assert (slider.get_attribute("min"), slider.get_attribute("max")) == ("0", "1")  # calibrated

    # Search from a permissive threshold (Enter submits the form), so the tiny model surely finds some.
    driver.execute_script(SET_SLIDER, slider, "0.00")  # no query yet: only moves the slider
    assert driver.find_element(By.ID, "slider-value").text.startswith("0.00")
    box = driver.find_element(By.ID, "query")
    box.send_keys(query)
    box.send_keys(Keys.ENTER)
    wait.until(lambda d: d.execute_script(GRID_SETTLED))
    wait.until(lambda d: d.execute_script(FIRST_IMAGE_LOADED))
    hits = _hits(driver)
    assert hits, driver.find_element(By.ID, "summary").text
    assert all(h["relevance"] >= 0.0 for h in hits)
    assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
    passed_low = _passed(driver)
    # at 0 the slider asks for no threshold (relevance >= 0 holds for every hit with one)
    assert driver.find_element(By.ID, "summary").text.startswith(f"{passed_low} results (no threshold)")
    assert "total" in driver.find_element(By.ID, "timings").text
    assert not driver.find_element(By.ID, "error").is_displayed()
    # The notice above the grid: this page's expected precision (the mean relevance shown), the
    # gallery caption's query kind, and the server's warnings in the warning style.
    api = httpx.post(
        server.url + "/v1/search/text", json={"text": query, "k": 12, "min_relevance": 0.0}, timeout=30
    ).json()
    notice = _notice(driver)
    assert notice["displayed"] and "Expected precision of these results" in notice["text"], notice
    mean = sum(h["relevance"] for h in hits) / len(hits)
    assert float(notice["expected_precision"]) == pytest.approx(mean)
    assert notice["kind"] == api["quality"]["kind"] and notice["kind"].replace("_", " ") in notice["text"]
    assert notice["warnings"] == api["quality"]["warnings"]
    assert notice["level"] == ("warn" if api["quality"]["warnings"] else "info")
    notice_top = driver.execute_script("return document.getElementById('notice').getBoundingClientRect().top")
    grid_top = driver.execute_script("return document.getElementById('results').getBoundingClientRect().top")
    assert notice_top < grid_top  # above the results

    # Up to between the lowest and highest relevance shown: the grid can only shrink, all above it.
    relevances = sorted(h["relevance"] for h in hits)
    higher = min(0.99, max(0.01, round((relevances[0] + relevances[-1]) / 2, 2)))
    value = _set_slider(driver, wait, higher)
    assert value == pytest.approx(higher)
    raised = _hits(driver)
    assert len(raised) <= len(hits) and _passed(driver) <= passed_low
    assert all(h["relevance"] >= value - 1e-9 for h in raised), (value, raised)

    # 1.0: nothing passes; the page says so instead of failing.
    _set_slider(driver, wait, 1.0)
    assert _hits(driver) == []
    summary = driver.find_element(By.ID, "summary")
    assert summary.is_displayed() and summary.text.startswith("0 passed"), summary.text
    assert not driver.find_element(By.ID, "error").is_displayed()

    # Back down; a word the model cannot read: the nearest images still, with no relevance, and the
    # notice says first that no relevance is given and why.
    _set_slider(driver, wait, 0.0)
    box = driver.find_element(By.ID, "query")
    box.clear()
    box.send_keys("a purple unicorn", Keys.ENTER)
    wait.until(lambda d: d.execute_script(GRID_SETTLED) and "unicorn" in _notice(d)["text"])
    notice = _notice(driver)
    assert notice["level"] == "warn" and notice["kind"] == "" and notice["evidence"] == "outside"
    assert notice["text"].startswith("No relevance for this query"), notice
    assert any("'unicorn'" in w for w in notice["warnings"]), notice
    hits = _hits(driver)
    assert hits and all(math.isnan(h["relevance"]) for h in hits)  # none shown
    assert not driver.find_element(By.ID, "error").is_displayed()
    _set_slider(driver, wait, 0.5)  # any relevance threshold: nothing passes, and the notice stays
    assert _hits(driver) == [] and _notice(driver)["evidence"] == "outside"
    _set_slider(driver, wait, 0.0)

    # Then (the slider back at 0 above) search by an uploaded image: caption hits and similar images.
    # Setting the slider to the value it has would rerun both searches after the debounce, racing
    # the upload's own search.
    png = tmp_path / "query.png"
    image = Image.new("RGB", (32, 32), "white")
    ImageDraw.Draw(image).ellipse((6, 6, 26, 26), fill=(220, 30, 30))
    image.save(png)
    driver.find_element(By.ID, "upload").send_keys(str(png))
    wait.until(lambda d: d.find_element(By.ID, "caption-results").get_attribute("data-state") == "done")
    captions = driver.find_elements(By.CSS_SELECTOR, "#caption-results .caption-hit")
    assert captions and all(c.text.strip() for c in captions)
    assert driver.find_elements(By.CSS_SELECTOR, "#similar .hit")
    assert not driver.find_element(By.ID, "error").is_displayed()
    caption_notice = _notice(driver, "caption-notice")
    assert caption_notice["displayed"] and "Expected precision" in caption_notice["text"]
    assert caption_notice["kind"] == ""  # an image has no query kind

    # An API error (text over ICR_MAX_TEXT_CHARS) is shown in the message area, not as a blank page.
    driver.execute_script("document.getElementById('query').value = 'x'.repeat(5000);")
    driver.find_element(By.ID, "search").click()
    wait.until(lambda d: d.find_element(By.ID, "error").is_displayed())
    assert "invalid_request" in driver.find_element(By.ID, "error").text
    assert driver.find_elements(By.CSS_SELECTOR, "#results .hit")  # the last good page stays

    # Screenshots for a person: the full page at desktop width, and the top at 375 px.
    box = driver.find_element(By.ID, "query")
    box.clear()
    box.send_keys(query, Keys.ENTER)
    wait.until(lambda d: d.execute_script(GRID_SETTLED) and not d.find_element(By.ID, "error").is_displayed())
    wait.until(lambda d: d.execute_script(FIRST_IMAGE_LOADED))
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1200, min(max(height + 120, 800), 4000))
    desktop = tmp_path / "search_page.png"
    assert driver.save_screenshot(str(desktop))
    driver.set_window_size(375, 900)
    overflow = driver.execute_script(
        "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
    )
    assert overflow <= 0, f"the page scrolls sideways by {overflow} px at 375 px"
    mobile = tmp_path / "search_page_375.png"
    assert driver.save_screenshot(str(mobile))
    seconds = time.monotonic() - start
    print(f"\nsearch page screenshots: {desktop} {mobile} ({seconds:.1f} s in the browser)")  # noqa: T201


def test_the_page_of_a_keyed_server_asks_for_the_key(make_server, driver) -> None:
    """ICR_API_KEY set: the page asks for the key, then searches and shows images with it (an <img>
    cannot send a header: the page fetches them with the key); a wrong key is asked for again."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    server = make_server(ICR_API_KEY="reader").start()
    wait = WebDriverWait(driver, WAIT_S)
    driver.get(server.url + "/")
    driver.execute_script("sessionStorage.clear()")  # the module's browser may hold another server's key
    driver.refresh()
    wait.until(lambda d: d.find_element(By.ID, "key-form").is_displayed())
    assert "API key" in driver.find_element(By.ID, "info").text
    box = driver.find_element(By.ID, "api-key")
    box.send_keys("wrong")
    box.send_keys(Keys.ENTER)
    wait.until(lambda d: d.find_element(By.ID, "key-form").is_displayed())  # 403: asked again
    box.clear()
    box.send_keys("reader")
    box.send_keys(Keys.ENTER)
    wait.until(lambda d: d.find_element(By.ID, "info").get_attribute("data-state") == "ready")
    assert not driver.find_element(By.ID, "key-form").is_displayed()
    driver.execute_script(SET_SLIDER, driver.find_element(By.ID, "slider"), "0.00")  # the tiny model: any hit
    query = driver.find_element(By.ID, "query")
    query.send_keys("a red circle")
    query.send_keys(Keys.ENTER)
    wait.until(lambda d: d.execute_script(FIRST_IMAGE_LOADED))
    src = driver.execute_script("return document.querySelector('#results .hit img').src")
    assert src.startswith("blob:")  # fetched with the key, not by <img src>
    assert driver.execute_script("return sessionStorage.getItem('icr-api-key')") == "reader"
    driver.execute_script("sessionStorage.clear()")


def test_labelling_hits_on_the_page_and_refitting(make_server, artifacts, driver, tmp_path: Path) -> None:
    """ "Label hits" on: each hit's relevant / not relevant button records a judgement (the counts
    line follows it); the hits rendered again (the same search again, after the refit, on a fresh
    visit with "Label hits" turned on after the search) show the labels given, and a click changes
    the mark; then "Refit" fits the calibration on them and the page says what it supports. On a
    copy of the index: the refit replaces its calibration.json."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    index = tmp_path / "images"
    shutil.copytree(artifacts.images, index)
    server = make_server(index=index).start()
    wait = WebDriverWait(driver, WAIT_S)
    driver.set_window_size(1200, 1000)
    query = _gallery_caption(server.url)
    driver.get(server.url + "/")
    driver.execute_script("sessionStorage.clear()")
    wait.until(lambda d: d.find_element(By.ID, "info").get_attribute("data-state") == "ready")
    driver.execute_script(SET_SLIDER, driver.find_element(By.ID, "slider"), "0.00")
    # past the slider's debounce (150 ms): its rerun would otherwise search again once the query is
    # typed and replace the cards this test holds
    time.sleep(0.5)
    box = driver.find_element(By.ID, "query")
    box.send_keys(query, Keys.ENTER)
    wait.until(lambda d: d.execute_script(GRID_SETTLED))
    cards = driver.find_elements(By.CSS_SELECTOR, "#results .hit")
    assert len(cards) >= 8
    assert not cards[0].find_element(By.CSS_SELECTOR, ".label-yes").is_displayed()  # off by default
    assert not driver.find_element(By.ID, "refit").is_displayed()

    driver.find_element(By.ID, "label-toggle").click()
    counts = driver.find_element(By.ID, "label-counts")
    wait.until(lambda _d: counts.is_displayed() and counts.get_attribute("data-judgements") == "0")
    assert driver.find_element(By.ID, "refit").is_displayed()
    relevant = 0
    labelled: dict[str, bool] = {}
    for i, item in enumerate(cards[:8]):
        # a hit is relevant when the query is its caption (the first hit counts as one, so one is)
        is_relevant = item.get_attribute("title") == query or i == 0
        relevant += is_relevant
        labelled[item.get_attribute("data-id")] = is_relevant
        item.find_element(By.CSS_SELECTOR, ".label-yes" if is_relevant else ".label-no").click()
        expected = "relevant" if is_relevant else "not-relevant"
        wait.until(lambda _d, item=item, expected=expected: item.get_attribute("data-label") == expected)
        wait.until(lambda _d, n=i + 1: counts.get_attribute("data-judgements") == str(n))
        pressed = item.find_element(By.CSS_SELECTOR, ".label-yes").get_attribute("aria-pressed")
        assert pressed == str(is_relevant).lower()
    assert counts.get_attribute("data-relevant") == str(relevant)
    assert "8 judgements on 8 hits of 1 queries" in counts.text, counts.text
    # the page's labels are the server's
    assert httpx.get(server.url + "/v1/feedback", timeout=10).json()["counts"]["judgements"] == 8
    wait.until(lambda d: all(m["count"] for i, m in _marks(d).items() if i in labelled))  # counted too
    _check_marks(driver, labelled)

    # the same search again: new cards, marked with the labels already given
    driver.find_element(By.ID, "search").click()
    wait.until(ec.staleness_of(cards[0]))
    wait.until(lambda d: d.execute_script(GRID_SETTLED) and d.execute_script(LABELS_SHOWN))
    _check_marks(driver, labelled)
    # a click on a re-rendered hit changes its mark (the other button pressed, the count follows)
    item = next(
        card
        for card in driver.find_elements(By.CSS_SELECTOR, "#results .hit")
        if card.get_attribute("data-id") in labelled
    )
    image_id = item.get_attribute("data-id")
    flipped = {**labelled, image_id: not labelled[image_id]}
    for now in (flipped, labelled):  # and back, so the labels the refit sees are the ones above
        item.find_element(By.CSS_SELECTOR, ".label-yes" if now[image_id] else ".label-no").click()
        want = "✓1 ✗0" if now[image_id] else "✓0 ✗1"
        wait.until(lambda d, want=want: _marks(d)[image_id]["count"] == want)
        _check_marks(driver, now)
        stored = httpx.get(
            server.url + "/v1/feedback/labels", params={"query": query, "image_id": image_id}, timeout=10
        ).json()["labels"]
        assert [(x["relevant"], x["judgements"], x["mine"]) for x in stored] == [
            (now[image_id], 1, now[image_id])
        ]

    driver.find_element(By.ID, "refit").click()
    notice = driver.find_element(By.ID, "label-notice")
    WebDriverWait(driver, 120).until(lambda _d: notice.get_attribute("data-state") in ("done", "error"))
    assert notice.get_attribute("data-state") == "done", notice.text
    assert notice.text.startswith("Refitted in") and "new calibration is served" in notice.text, notice.text
    assert "fitted on 8 of them" in counts.text and "relevance 0.5" in counts.text, counts.text
    assert driver.find_element(By.ID, "slider").get_attribute("value") == "0"  # the user's threshold stays
    assert httpx.get(server.url + "/v1/info", timeout=10).json()["calibration"]["labels"] == "user"
    # searched again under the new calibration, the labels shown on the new cards
    wait.until(lambda d: d.execute_script(GRID_SETTLED) and d.execute_script(LABELS_SHOWN))
    _check_marks(driver, labelled)
    assert not driver.find_element(By.ID, "error").is_displayed()
    shot = tmp_path / "search_page_labelling.png"
    assert driver.save_screenshot(str(shot))
    print(f"\nlabelling screenshot: {shot}")  # noqa: T201

    # a fresh visit: searched with "Label hits" off (no labels asked for), then turned on
    driver.get(server.url + "/")
    wait.until(lambda d: d.find_element(By.ID, "info").get_attribute("data-state") == "ready")
    driver.execute_script(SET_SLIDER, driver.find_element(By.ID, "slider"), "0.00")
    time.sleep(0.5)  # past the slider's debounce, as above
    driver.find_element(By.ID, "query").send_keys(query, Keys.ENTER)
    wait.until(lambda d: d.execute_script(GRID_SETTLED))
    assert not driver.execute_script(LABELS_SHOWN)
    assert not any(mark["label"] for mark in _marks(driver).values())
    driver.find_element(By.ID, "label-toggle").click()
    wait.until(lambda d: d.execute_script(LABELS_SHOWN))
    _check_marks(driver, labelled)
    assert not driver.find_element(By.ID, "error").is_displayed()
