"""The guides' site: built from a clone by README's command, strict, and opened in
headless Chromium (Debian's, which ``.ci/run`` installs; Playwright drives it and
downloads nothing). Navigation works, search finds a name, and no link is broken."""

import functools
import http.server
import os
import re
import shutil
import urllib.parse

import pytest

from tests.support import guides
from tests.support.as_typed import copy_clone, ok, sh
from tests.support.helpers import http_served

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# As root and offline: no sandbox, and none of Chromium's own calls home.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """README's build command, run in a fresh clone's root: the process, and the site."""
    root = copy_clone(tmp_path_factory.mktemp("docs") / "tf-trainer")
    return ok(sh(guides.BUILD, root)), root / "docs" / "site"


@pytest.fixture(scope="module")
def served(built):
    """The site over HTTP on 127.0.0.1 (search runs in a web worker, which a file://
    page may not start); yields its address."""
    with http_served(functools.partial(QuietHandler, directory=str(built[1]))) as address:
        yield address + "/"


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def page(served):
    """A page of headless Chromium."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("no Chromium: apt-get install chromium (.ci/run does)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})  # a desktop's
        # A bound on waiting, not a speed: with the suite's other worker busy on both
        # cores, Chromium's first page once took over 10 s to load.
        page.set_default_timeout(60_000)
        yield page
        browser.close()


def test_readmes_command_builds_every_guide_strict_with_an_api_reference(built):
    proc, site = built
    assert not re.search(r"^(WARNING|ERROR)\b", proc.stderr, re.M), proc.stderr
    for path in guides.pages()[1:]:
        name = os.path.relpath(path, guides.GUIDES)
        assert (site / name.replace(".md", ".html")).is_file(), name
    reference = (site / "reference" / "trainer.html").read_text()
    # From the docstrings: the Estimator, and the fields of a settings group.
    assert 'id="trainer.estimator.Estimator"' in reference
    assert "clip_gradient_norm" in reference and "microbatches" in reference
    assert "Five minutes" in (site / "index.html").read_text()  # README's tour, included


def test_chromium_follows_the_navigation(page, served):
    page.goto(served + "index.html")
    navigation = page.locator("nav.md-nav--primary")
    navigation.get_by_role("link", name="Data", exact=True).click()
    page.wait_for_url("**/data.html")
    assert page.title() == "Data - tf-trainer"
    navigation.get_by_role("link", name="trainer", exact=True).click()  # the API reference
    page.wait_for_url("**/reference/trainer.html")
    assert page.title() == "trainer - tf-trainer"


def test_chromium_search_finds_early_stopping(page, served):
    page.goto(served + "index.html")
    # Typed, key by key, as a user types: Material reads the query on keyup (or 1 ms after
    # focus, or when its index is ready); fill() sends no keyup, so on loaded cores the
    # query was read empty after focus and never searched.
    page.locator("input.md-search__input").press_sequentially("EarlyStopping")  # the header's
    results = page.locator(".md-search-result__item a")
    results.first.wait_for(timeout=60_000)  # the web worker indexes the site first
    links = [results.nth(i).get_attribute("href") for i in range(results.count())]
    # The callbacks' section, which names it, with the word marked on the page.
    assert served + "keras.html?h=earlystopping#callbacks" in links, links


def test_no_link_in_the_site_is_broken(page, served):
    """Every page reached from the home page, and every link on it: its page loads, and
    the place it names (``#anchor``) is on that page."""
    anchors, links, queue = {}, [], [served + "index.html"]
    while queue:
        url = queue.pop()
        if url in anchors:
            continue
        response = page.goto(url)
        assert response.ok, url
        anchors[url] = set(page.eval_on_selector_all("[id]", "els => els.map(e => e.id)"))
        hrefs = page.eval_on_selector_all("a[href]", "els => els.map(a => a.href)")
        for href in hrefs:
            target, _, anchor = href.partition("#")
            if target.startswith(served):
                links.append((url, target, anchor))
                if target.endswith(".html"):
                    queue.append(target)
    assert len(anchors) >= len(guides.pages()) - 1
    for source, target, anchor in links:
        if target.endswith(".html"):
            assert target in anchors, (source, target)
            assert not anchor or urllib.parse.unquote(anchor) in anchors[target], (source, anchor)
        else:  # a file beside the pages: the sitemap, the search index
            assert page.request.get(target).ok, (source, target)
