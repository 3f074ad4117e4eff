"""Checks of the built docs site (site/, from ``make docs``), as a reader sees it.

    python tools/docs_check.py links [SITE]     # every internal href/src resolves, #anchors included
    python tools/docs_check.py browser [SITE]   # a headless Chromium opens three pages; screenshots

``links`` walks every HTML page of the site and checks each internal link: its target file exists (a folder
stands for its index.html) and its #fragment is an id on the target page. External links (http:, mailto:, ...)
are not followed: the site must build and check offline.

``browser`` serves the site on 127.0.0.1, opens the home page, a guide and an API page in headless Chromium
(Debian's ``chromium``: ``apt-get install chromium``), and checks the DOM after its scripts ran: the page's title,
the navigation (the site's sections), code blocks, and the copy button Material's JavaScript adds to each code
block (so the scripts ran). Screenshots go to SITE/_screenshots/. Exit status 0 when every check passes, 1 with
the failures listed, 2 when no Chromium is installed.
"""

from __future__ import annotations

import functools
import html.parser
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from urllib.parse import unquote, urldefrag, urlsplit

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "site"
SECTIONS = ("Guides", "Methods", "Concepts", "Reference", "Reproductions")  # the nav's sections (mkdocs.yml)
# (path in the site, words the <title> must hold, text the page's body must hold)
PAGES = (("", "dpopt", "A first private run"),
         ("own_loop/", "Your own loop", "make_private"),
         ("reference/api/", "Python API", "PrivateOptimizer"))


class _Page(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name in ("id", "name") and (name == "id" or tag == "a"):
                self.ids.add(value)
            elif name in ("href", "src") and tag != "base":
                self.links.append(value)


@functools.cache
def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8", errors="replace"))
    return page


def _target(site: Path, page: Path, link: str) -> tuple[Path, str] | None:
    """The file an internal link points to and its fragment, or None for an external link."""
    url, fragment = urldefrag(link)
    parts = urlsplit(url)
    if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:", "data:")):
        return None
    if not parts.path:  # "#x": this page
        return page, unquote(fragment)
    base = site if parts.path.startswith("/") else page.parent
    target = (base / unquote(parts.path).lstrip("/")).resolve()
    if target.is_dir() or parts.path.endswith("/"):
        target = target / "index.html"
    return target, unquote(fragment)


def check_links(site: Path = SITE) -> tuple[int, list[str]]:
    """(the number of internal links checked, the broken ones as messages)."""
    site = site.resolve()
    broken, checked = [], 0
    for page in sorted(site.rglob("*.html")):
        for link in _parse(page).links:
            found = _target(site, page, link)
            if found is None:
                continue
            checked += 1
            target, fragment = found
            where = f"{page.relative_to(site)}: {link}"
            if site not in target.parents and target != site:
                broken.append(f"{where} (outside the site)")
            elif not target.is_file():
                broken.append(f"{where} (no such file)")
            elif fragment and target.suffix == ".html" and fragment not in _parse(target).ids:
                broken.append(f"{where} (no id {fragment!r} on {target.relative_to(site)})")
    return checked, broken


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        if found := shutil.which(name):
            return found
    return None


def _serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def _chromium(browser: str, profile: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--no-first-run", "--disable-extensions", f"--user-data-dir={profile}", "--hide-scrollbars",
               "--virtual-time-budget=3000", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class _Rendered(html.parser.HTMLParser):
    """What the checks look for in the DOM Chromium dumps after the scripts ran."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.title = ""
        self.nav: list[str] = []  # the text of the primary navigation
        self.code_blocks = self.copy_buttons = self.nav_links = 0
        self.text: list[str] = []
        self._open: list[tuple[str, bool]] = []  # (tag, inside the primary navigation)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        classes = (named.get("class") or "").split()
        in_nav = bool(self._open and self._open[-1][1]) or (tag == "nav" and "md-nav--primary" in classes)
        if tag == "pre":
            self.code_blocks += 1
        if tag == "button" and named.get("data-clipboard-target"):  # Material's copy button, added by its script
            self.copy_buttons += 1
        if tag == "a" and in_nav:
            self.nav_links += 1
        if tag not in VOID:
            self._open.append((tag, in_nav))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i][0] == tag:
                del self._open[i:]
                break

    def handle_data(self, data: str) -> None:
        if self._open and self._open[-1][0] == "title":
            self.title += data
        if self._open and self._open[-1][1] and data.strip():
            self.nav.append(data.strip())
        self.text.append(data)


def check_browser(site: Path = SITE, out: Path | None = None) -> tuple[list[str], list[Path]]:
    """(the failures, the screenshots written). Raises FileNotFoundError when no Chromium is installed."""
    browser = chromium()
    if browser is None:
        raise FileNotFoundError("no chromium on PATH (apt-get install chromium)")
    site = site.resolve()
    out = out or site / "_screenshots"
    out.mkdir(parents=True, exist_ok=True)
    server, base = _serve(site)
    failures, shots = [], []
    try:
        with tempfile.TemporaryDirectory() as profile:
            for path, title, text in PAGES:
                url = base + path
                shot = out / f"{path.strip('/').replace('/', '_') or 'home'}.png"
                shot.unlink(missing_ok=True)
                shown = _chromium(browser, profile, "--window-size=1280,1600", f"--screenshot={shot}", "--dump-dom",
                                  url)  # one start of the browser: the DOM after the scripts ran, and a picture
                if shown.returncode != 0 or "<html" not in shown.stdout:
                    failures.append(f"{url}: chromium exited {shown.returncode}: {shown.stderr[-500:]}")
                    continue
                dom = _Rendered()
                dom.feed(shown.stdout)
                body = " ".join(dom.text)
                if title not in dom.title:
                    failures.append(f"{url}: title {dom.title.strip()!r} lacks {title!r}")
                missing = [s for s in SECTIONS if s not in dom.nav]
                if dom.nav_links < 20 or missing:
                    failures.append(f"{url}: navigation has {dom.nav_links} links, sections missing: {missing}")
                if dom.code_blocks == 0:
                    failures.append(f"{url}: no code block")
                if dom.copy_buttons == 0:
                    failures.append(f"{url}: no copy button on its code blocks: the page's scripts did not run")
                if text not in body:
                    failures.append(f"{url}: the page does not show {text!r}")
                if not shot.is_file() or shot.stat().st_size < 10_000:
                    failures.append(f"{url}: no screenshot ({shown.stderr[-300:]})")
                else:
                    shots.append(shot)
    finally:
        server.shutdown()
        server.server_close()
    return failures, shots


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("links", "browser"):
        print(__doc__, file=sys.stderr)
        return 2
    site = Path(argv[1]) if len(argv) > 1 else SITE
    if not (site / "index.html").is_file():
        print(f"{site}/index.html not found: build the site first (make docs)", file=sys.stderr)
        return 2
    if argv[0] == "links":
        checked, broken = check_links(site)
        print(f"{checked} internal links checked, {len(broken)} broken")
        print("\n".join(broken))
        return 1 if broken else 0
    try:
        failures, shots = check_browser(site)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"{len(PAGES)} pages opened in headless Chromium, {len(failures)} failures; screenshots: "
          + ", ".join(str(s.relative_to(site)) if site.resolve() in s.parents else str(s) for s in shots))
    print("\n".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("NO_MKDOCS_2_WARNING", "1")
    sys.exit(main(sys.argv[1:]))
