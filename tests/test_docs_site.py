"""The documentation site as a reader meets it: built with the one documented command
(``mkdocs build --strict``), served over HTTP, opened in Debian's headless ``chromium``.

Checks that the home page renders with its navigation, that the run-config reference lists every
key of ``[tool.flwr.app.config]`` and the API page the public names, that the pages rendered from
docstrings show no Sphinx role the Markdown renderer does not understand, that their cross-references
lead to entries of the site and that their signatures are formatted, and that searching the site for
a run-config key finds the reference (Material's search, driven through its ``?q=`` URL). Every page
of the site, opened in a 1280 px wide window, has no horizontal overflow, and every internal link of
every built page (``href``/``src``, navigation and cross-references included) leads to a file of the
site and, with a ``#fragment``, to an element of that id on the target page.

Needs the ``docs`` extra and a ``chromium`` binary (``apt-get install chromium``); without them the
tests skip with the reason, except where ``FEDCOMP_REQUIRE_DOCS=1`` (CI) makes that a failure.
"""

from __future__ import annotations

import functools
import html
import html.parser
import http.server
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time
import tomllib
import urllib.parse

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
PUBLIC = ["CompressedStrategy", "compression_mod", "get_compressor", "ErrorFeedback", "PayloadError"]
#: The pages mkdocstrings renders from docstrings (``::: identifier`` entries).
DOCSTRING_PAGES = ["reference/api", "reference/wire-format"]
#: A Sphinx role (``:func:`name```) as the Markdown renderer prints it: the role's name in colons,
#: the backticks turned into ``<code>``. Docstrings cross-reference with mkdocstrings' autorefs,
#: ``[`name`][fedcomp.module.name]``, or name the target in a plain code span.
SPHINX_ROLE = re.compile(r":(?:py:)?(?:mod|func|class|meth|attr|data|exc|obj):")


def _unavailable(reason: str):
    if os.environ.get("FEDCOMP_REQUIRE_DOCS") == "1":
        pytest.fail(f"FEDCOMP_REQUIRE_DOCS=1 but {reason}")
    pytest.skip(reason)


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    _unavailable("no chromium binary (Debian: apt-get install chromium)")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The built site (``mkdocs build --strict``) and the seconds the build took."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        _unavailable("the docs extra is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, time.perf_counter() - t0


@pytest.fixture(scope="module")
def served(site):
    """``http://127.0.0.1:<port>/`` serving the site (search loads its index over HTTP, not file://)."""
    root, _ = site
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


#: A page of the test server (not of the site): the site's page ``/?q=<query>`` in a frame, polled until
#: Material's search has listed its results, which are then copied into this page's DOM for
#: ``--dump-dom``. The search runs in a web worker that headless Chromium's virtual time does not
#: wait for; each poll is a fetch of ``/__wait`` that the server answers after 200 ms of real time,
#: during which virtual time stands still.
SEARCH_PAGE = """<!doctype html><html><body><div id="out">waiting</div>
<iframe id="site" src="/?q=%s" style="width:1200px;height:800px"></iframe>
<script>
async function poll() {
  for (let i = 0; i < 150; i++) {
    await fetch("/__wait");
    const d = document.getElementById("site").contentDocument;
    if (d && d.querySelectorAll(".md-search-result__item").length) {
      document.getElementById("out").innerHTML = d.querySelector(".md-search-result__list").outerHTML;
      return;
    }
  }
  document.getElementById("out").textContent = "no search results after 30 s";
}
poll();
</script></body></html>"""


#: A page of the test server: every page named in its query (``?page=reference/api/&page=...``) in
#: turn in a frame that fills the window, measured once loaded, its fonts ready and Material's scripts
#: run (they wrap each table in a scrolling ``div``): the root element's ``scrollWidth`` and
#: ``clientWidth`` and, where the first exceeds the second, the elements that stick out past the right
#: edge themselves (their parent does not, and no clipping or scrolling ancestor contains them). The
#: measurements are written into ``#out`` as JSON for ``--dump-dom``.
OVERFLOW_PAGE = """<!doctype html><html style="margin:0;overflow:hidden"><body style="margin:0;overflow:hidden">
<pre id="out">waiting</pre>
<iframe id="site" style="position:fixed;top:0;left:0;width:100%;height:100%;border:0"></iframe>
<script>
function describe(e, w) {
  const r = e.getBoundingClientRect();
  const cls = typeof e.className === "string" && e.className ? "." + e.className.trim().split(/\\s+/).join(".") : "";
  return {element: e.tagName.toLowerCase() + (e.id ? "#" + e.id : "") + cls, right: Math.round(r.right),
          width: Math.round(r.width), text: (e.textContent || "").trim().replace(/\\s+/g, " ").slice(0, 80)};
}
function culprits(d, w, limit) {
  const out = [];
  for (const e of d.body.querySelectorAll("*")) {
    const r = e.getBoundingClientRect();
    if (r.width === 0 || r.right <= limit) continue;
    const p = e.parentElement;
    if (p && p !== d.body && p.getBoundingClientRect().right > limit) continue;
    let clipped = false;
    for (let a = p; a && a !== d.body; a = a.parentElement) {
      if (w.getComputedStyle(a).overflowX !== "visible" && a.getBoundingClientRect().right <= limit) {
        clipped = true;
        break;
      }
    }
    if (!clipped) out.push(describe(e, w));
  }
  return out.sort((a, b) => b.right - a.right).slice(0, 5);
}
async function measure(frame, page) {
  await new Promise((resolve) => { frame.onload = resolve; frame.src = "/" + page; });
  const w = frame.contentWindow, d = frame.contentDocument;
  await d.fonts.ready;
  await new Promise((resolve) => setTimeout(resolve, 50));
  const root = d.documentElement;
  const m = {page: page, title: d.title, innerWidth: w.innerWidth, scrollWidth: root.scrollWidth,
             clientWidth: root.clientWidth, content: !!d.querySelector("article.md-content__inner")};
  if (m.scrollWidth > m.clientWidth) m.culprits = culprits(d, w, m.clientWidth + 0.5);
  return m;
}
async function run() {
  const frame = document.getElementById("site"), results = [];
  for (const page of new URLSearchParams(location.search).getAll("page")) {
    try { results.push(await measure(frame, page)); } catch (err) { results.push({page: page, error: String(err)}); }
  }
  document.getElementById("out").textContent = JSON.stringify(results);
}
run();
</script></body></html>"""


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    """The site's files, plus ``/__search?q=...`` (:data:`SEARCH_PAGE`), ``/__overflow?page=...``
    (:data:`OVERFLOW_PAGE`) and ``/__wait`` (200 ms)."""

    def log_message(self, *args):  # no access log in the test output
        pass

    def do_GET(self):  # http.server's name
        url = urllib.parse.urlparse(self.path)
        if url.path == "/__wait":
            time.sleep(0.2)
            self.send_response(204)
            self.end_headers()
        elif url.path in ("/__search", "/__overflow"):
            if url.path == "/__search":
                body = (SEARCH_PAGE % urllib.parse.quote(urllib.parse.parse_qs(url.query)["q"][0])).encode()
            else:
                body = OVERFLOW_PAGE.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            super().do_GET()


def _browser(*args: str, tmp: pathlib.Path, budget_ms: int = 15000) -> subprocess.CompletedProcess:
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", f"--user-data-dir={tmp / 'profile'}", f"--virtual-time-budget={budget_ms}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def _dom(url: str, tmp: pathlib.Path) -> str:
    proc = _browser("--dump-dom", url, tmp=tmp)
    assert proc.returncode == 0 and "<html" in proc.stdout, proc.stderr[-3000:]
    return proc.stdout


def _config_keys() -> list[str]:
    return list(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"])


def test_every_key_and_public_name_is_in_the_built_site(site):
    root, seconds = site
    print(f"mkdocs build --strict: {seconds:.1f} s")
    reference = (root / "reference" / "run-config" / "index.html").read_text()
    missing = [k for k in _config_keys() if f"<code>{k}</code>" not in reference]
    assert missing == []
    api = (root / "reference" / "api" / "index.html").read_text()
    assert [n for n in PUBLIC if not re.search(rf'id="fedcomp\.[\w.]*\.{n}"', api)] == []
    index = (root / "search" / "search_index.json").read_text()
    assert "secagg-quantization-bits" in index and "reference/run-config/" in index


def test_docstring_pages_show_no_sphinx_role_and_their_cross_references_resolve(site):
    """An autoref whose target is not on the site fails ``mkdocs build --strict`` (the ``site`` fixture);
    on the built pages every cross-reference is a link to an element of the site with that id, none
    is left as ``[text][identifier]``, and the API page links a codec's docstring to
    ``get_compressor``."""
    root, _ = site
    links = 0
    for page in DOCSTRING_PAGES:
        source = (root / page / "index.html").read_text()
        body = source[source.index("<article"):source.index("</article>")]
        assert [body[max(0, m.start() - 80):m.end() + 80] for m in SPHINX_ROLE.finditer(body)] == []
        text = re.sub(r"<[^>]+>", "", body)
        assert re.findall(r"\]\[[\w.]*\]", text) == [], "an unresolved cross-reference"
        for href in re.findall(r'<a class="autorefs autorefs-internal"[^>]*href="([^"]+)"', body):
            url = urllib.parse.urljoin(f"/{page}/", href)
            path, _, anchor = url.partition("#")
            target = (root / path.lstrip("/") / "index.html").read_text()
            assert f'id="{anchor}"' in target, href
            links += 1
    assert links >= 20
    api = (root / "reference" / "api" / "index.html").read_text()
    assert 'href="#fedcomp.compression.get_compressor"' in api


def test_api_signatures_are_formatted(site):
    """mkdocstrings formats each signature with ruff (the docs extra) at ``line_length`` 88: a long one
    is cut into one parameter a line instead of printed on a single line."""
    root, _ = site
    api = (root / "reference" / "api" / "index.html").read_text()
    signatures = [html.unescape(re.sub(r"<[^>]+>", "", s)) for s in
                  re.findall(r'<div class="doc-signature[^"]*">(.*?)</div>', api, re.DOTALL)]
    assert len(signatures) >= 10
    lines = [line for s in signatures for line in s.splitlines()]
    assert [line for line in lines if len(line) > 88] == []
    init = next(s for s in signatures if s.startswith("__init__("))
    assert "\n    inner: Strategy,\n" in init and init.rstrip().endswith(") -> None")


def test_the_home_page_renders_with_its_navigation(served, tmp_path):
    t0 = time.perf_counter()
    dom = _dom(served, tmp_path)
    for section in ("Get started", "How-to guides", "Reference", "Benchmarks", "Architecture", "Changelog"):
        assert section in dom, section
    assert 'class="md-nav' in dom and 'href="reference/run-config/"' in dom
    shot = tmp_path / "home.png"
    proc = _browser(f"--screenshot={shot}", "--window-size=1280,900", served, tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 1280 and len(png) > 20_000
    print(f"home page: dump-dom + screenshot {time.perf_counter() - t0:.1f} s")


def test_the_run_config_reference_renders_every_key(served, tmp_path):
    dom = _dom(served + "reference/run-config/", tmp_path)
    assert "md-nav" in dom
    assert [k for k in _config_keys() if f"<code>{k}</code>" not in dom] == []


def test_a_search_for_a_key_finds_the_reference(served, tmp_path):
    """Material's search box, filled from the URL (``?q=``), lists the run-config reference's
    section of the key among its results."""
    t0 = time.perf_counter()
    dom = _dom(served + "__search?q=secagg-quantization-bits", tmp_path)
    out = dom[dom.index('<div id="out">'):dom.index("<iframe")]
    assert "md-search-result__item" in out, out[:500]
    assert "reference/run-config/?h=secagg+quantization+bits#secure-aggregation-secagg" in out, out[:3000]
    print(f"search: {time.perf_counter() - t0:.1f} s")


def _url(root: pathlib.Path, page: pathlib.Path) -> str:
    """A built page's URL path relative to the site's root: ``""``, ``"reference/api/"``, ``"404.html"``."""
    rel = page.relative_to(root).as_posix()
    return rel.removesuffix("index.html") if rel == "index.html" or rel.endswith("/index.html") else rel


def _pages(root: pathlib.Path) -> list[str]:
    """Every page of the built site (each ``index.html``, and ``404.html``), as :func:`_url` names it."""
    return sorted(_url(root, p) for p in root.rglob("*.html"))


def test_no_page_overflows_a_1280_px_window(site, served, tmp_path):
    """Each page in a 1280 px wide window (a frame filling it) is no wider than the window: the root
    element's ``scrollWidth`` is at most its ``clientWidth``. Material hides the root's horizontal
    overflow (``overflow-x: hidden``), so a table or line that does not fit would be cut off, out of
    the reader's reach. Hosts other than the test server's resolve to nothing: the pages are measured
    in the fallback fonts, not Google's Roboto, the same with or without a network."""
    root, _ = site
    pages = _pages(root)
    assert len(pages) >= 40
    t0 = time.perf_counter()
    query = urllib.parse.urlencode([("page", p) for p in pages])
    proc = _browser("--dump-dom", "--window-size=1280,900", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                    f"{served}__overflow?{query}", tmp=tmp_path, budget_ms=120_000)
    assert proc.returncode == 0 and '<pre id="out">' in proc.stdout, proc.stderr[-3000:]
    out = html.unescape(re.search(r'<pre id="out">(.*?)</pre>', proc.stdout, re.DOTALL).group(1))
    assert out.startswith("["), f"the pages were not all measured: {out[:300]}"
    results = json.loads(out)
    assert [r["page"] for r in results] == pages
    assert [r for r in results if "error" in r or not r["content"] or r["innerWidth"] != 1280] == []
    overflowing = [r for r in results if r["scrollWidth"] > r["clientWidth"]]
    report = "\n".join(f"/{r['page']}: {r['scrollWidth']} px wide in {r['clientWidth']} px; sticking out: "
                       + "; ".join(f"<{c['element']}> to {c['right']} px ({c['width']} px wide) {c['text']!r}"
                                   for c in r["culprits"]) for r in overflowing)
    assert overflowing == [], "pages wider than a 1280 px window:\n" + report
    print(f"overflow at 1280 px: {len(pages)} pages in {time.perf_counter() - t0:.1f} s")


class _LinksAndIds(html.parser.HTMLParser):
    """A page's ``href``/``src`` values (with the tag) and its elements' ids (``<a name>`` too)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.links: list[tuple[str, str]] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):  # html.parser's name
        for name, value in attrs:
            if name in ("href", "src") and value is not None:
                self.links.append((tag, value))
            elif name == "id" or (tag == "a" and name == "name"):
                self.ids.add(value or "")


def _parse(path: pathlib.Path) -> _LinksAndIds:
    parser = _LinksAndIds()
    parser.feed(path.read_text(encoding="utf-8"))
    parser.close()
    return parser


def test_every_internal_link_of_the_built_pages_resolves(site):
    """``mkdocs build --strict`` checks the links written in Markdown; this checks what the pages hold
    once built: navigation, table of contents, theme assets, cross-references from docstrings, links
    in generated tables and raw HTML. Every ``href``/``src`` of every built page (``*.html``) that
    stays on the site, relative or absolute (``/...``), leads to a file of the site (a directory to its
    ``index.html``), and one with a ``#fragment`` to an element with that id on the target page."""
    root, _ = site
    pages = sorted(root.rglob("*.html"))
    assert len(pages) >= 40
    parsed = {path: _parse(path) for path in pages}
    broken, checked = [], 0
    for path, page in parsed.items():
        base = "/" + _url(root, path)
        for tag, link in page.links:
            url = urllib.parse.urlsplit(urllib.parse.urljoin(base, link.strip()))
            if url.scheme or url.netloc:  # another site (http(s)://, mailto:, data:, javascript:)
                continue
            checked += 1
            target = root / urllib.parse.unquote(url.path).lstrip("/")
            if url.path.endswith("/") or target.is_dir():
                target = target / "index.html"
            if not target.resolve().is_relative_to(root.resolve()) or not target.is_file():
                broken.append(f"{base}: <{tag}> {link!r}: no file {url.path}")
                continue
            fragment = urllib.parse.unquote(url.fragment)
            if fragment:
                ids = parsed[target].ids if target in parsed else set()
                if fragment not in ids:
                    broken.append(f"{base}: <{tag}> {link!r}: no id {fragment!r} on {url.path}")
    assert broken == [], f"{len(broken)} broken internal link(s):\n" + "\n".join(broken)
    assert checked > 1000
    print(f"internal links: {checked} in {len(pages)} pages")
