"""The docs site as a reader sees it: every page opened in a real headless Chromium, served
over HTTP from 127.0.0.1 with no other network.

Fails on any console error (a script that crashed, a resource that did not load), a broken
image, an internal link to a page or anchor that does not exist, a heading id that is not a
valid CSS selector, code that was not highlighted at build time, and a search that does not
find a chapter. Needs Debian's `chromium` and `chromium-driver` (which .ci/run installs) and
selenium; without them it skips and says what is missing. Nothing here downloads a browser.
"""

from __future__ import annotations

import functools
import http.server
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def _browser() -> tuple[str, str]:
    """Paths of a Chromium and its driver, or a skip saying what is missing."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        pytest.skip("selenium is not installed: pip install -e '.[test]'")
    binary = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("no headless browser: apt-get install chromium chromium-driver "
                    "(.ci/run does)")
    return binary, driver


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d",
                            str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    return out


@pytest.fixture(scope="module")
def server(site):
    """The built site on a free port of 127.0.0.1 (search needs HTTP, not file://)."""
    handler = functools.partial(_Quiet, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # one line per request would drown pytest's output
        pass


@pytest.fixture(scope="module")
def browser():
    binary, driver_path = _browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,900", "--disable-extensions",
                # Nothing but 127.0.0.1: a page that reaches for another host (a CDN, a web
                # font, an API) then fails here as it would on a machine without network.
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def _pages(site: Path) -> list[str]:
    return sorted(str(p.parent.relative_to(site)) for p in site.rglob("index.html"))


# Run in the page: everything a reader would notice, returned as lists of problems.
INSPECT = """
const bad = {images: [], selectors: [], plain: [], untokened: [], links: []};
for (const img of document.images) {
  if (!img.complete || img.naturalWidth === 0) bad.images.push(img.getAttribute('src'));
}
for (const el of document.querySelectorAll('h1[id],h2[id],h3[id],h4[id],h5[id],h6[id]')) {
  try { document.querySelector('#' + el.id); } catch (e) { bad.selectors.push(el.id); }
}
for (const pre of document.querySelectorAll('article pre')) {
  if (!pre.closest('.highlight')) bad.plain.push(pre.textContent.slice(0, 60));
}
let coloured = 0, blocks = 0;
for (const block of document.querySelectorAll('article div[class*="language-"].highlight')) {
  const lang = [...block.classList].find(c => c.startsWith('language-')).slice(9);
  if (['text', 'console', 'output', ''].includes(lang)) continue;
  blocks += 1;
  const code = block.querySelector('code');
  const token = block.querySelector('code span[class]:not(.filename)');
  if (!token) { bad.untokened.push(lang + ': ' + code.textContent.slice(0, 60)); continue; }
  const styled = [...block.querySelectorAll('code span[class]')].some(
    s => getComputedStyle(s).color !== getComputedStyle(code).color);
  if (styled) coloured += 1;
}
for (const a of document.querySelectorAll('a[href]')) bad.links.push(a.href);
return [bad, blocks, coloured];
"""


def _target(site: Path, base: str, url: str) -> tuple[Path, str] | None:
    """The file an internal link points to and its anchor; None for another site's link."""
    if not url.startswith(base):
        return None
    parts = urlsplit(url)
    path = site / unquote(parts.path).lstrip("/")
    if path.is_dir() or parts.path.endswith("/"):
        path = path / "index.html"
    return path, unquote(parts.fragment)


@functools.cache
def _ids(path: Path) -> frozenset[str]:
    import re

    return frozenset(re.findall(r'\sid="([^"]+)"', path.read_text(errors="replace")))


@pytest.mark.slow  # about 75 s on 2 cores (~125 pages): run by .ci/run's `pytest -m slow`
def test_every_page_loads_clean_and_search_works_in_a_real_browser(browser, site, server):
    """One test, so the suite builds the site and starts a browser once (under xdist too)."""
    pages = _pages(site)
    assert len(pages) > 20 and "reference/cli" in pages and "05-data-parallel" in pages
    problems: list[str] = []
    highlighted_pages = 0
    for page in pages:
        url = f"{server}/{page}/".replace("/./", "/")
        browser.get(url)
        errors = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        bad, blocks, coloured = browser.execute_script(INSPECT)
        where = page if page != "." else "index"
        problems += [f"{where}: console: {m}" for m in errors]
        problems += [f"{where}: broken image {src}" for src in bad["images"]]
        problems += [f"{where}: id is not a valid selector: #{i}" for i in bad["selectors"]]
        problems += [f"{where}: code block not highlighted at build time: {t!r}"
                     for t in bad["plain"]]
        problems += [f"{where}: code with no highlighted token: {t!r}" for t in bad["untokened"]]
        highlighted_pages += coloured > 0
        for link in set(bad["links"]):
            target = _target(site, server, link)
            if target is None:
                continue
            path, anchor = target
            if not path.is_file():
                problems.append(f"{where}: broken link {link}")
            elif anchor and anchor not in _ids(path):
                problems.append(f"{where}: link to a missing anchor {link}")
    assert problems == [], "\n".join(problems)
    # Token spans are Pygments' work; colour is the theme's CSS applied to them (a page of plain
    # commands may show none, so it is counted over the site).
    assert highlighted_pages >= 10, f"code in colour on only {highlighted_pages} pages"
    _search_finds_a_chapter(server, browser)


def _search_finds_a_chapter(server: str, browser) -> None:
    """The search box, offline: lunr in a web worker over the site's own index."""
    from selenium.webdriver.common.by import By

    browser.get(f"{server}/")
    box = browser.find_element(By.CSS_SELECTOR, "input.md-search__input")
    box.click()
    box.send_keys("deadlock")
    deadline = time.monotonic() + 30  # the index loads in a web worker
    links: list[str] = []
    while time.monotonic() < deadline and not any("02-point-to-point" in h for h in links):
        time.sleep(0.25)
        links = [a.get_attribute("href") for a in
                 browser.find_elements(By.CSS_SELECTOR, ".md-search-result__link")]
    assert any("02-point-to-point" in h for h in links), f"search for 'deadlock' found {links}"
