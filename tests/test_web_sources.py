"""Web sites as sources (issue 28, item 2), against a small site the test serves itself on loopback over HTTP: a
sitemap, robots.txt, conditional GETs, a redirect inside the site and one to 169.254.169.254, a 404, a page that
changes, a huge page, a slow page, and a crawl by links when there is no sitemap."""

from __future__ import annotations

import itertools
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cli_runs import ingest, kb
from pipelines.retrieval.search import Filters, search
from pipelines.sources.web import Scope
from pipelines.sources.web import Site as WebSite
from pipelines.sources.web import crawl


class Site:
    """Pages by path: (status, headers, body); every request is logged as (path, its conditional headers)."""

    def __init__(self) -> None:
        self.pages: dict[str, tuple[int, dict, bytes]] = {}
        self.log: list[tuple[str, str | None, str | None]] = []
        self.slow = threading.Event()  # set: the slow page answers now (the test's end releases the handler)
        site = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                site.log.append((self.path, self.headers.get("If-None-Match"), self.headers.get("If-Modified-Since")))
                status, headers, body = site.pages.get(self.path, (404, {}, b"not found"))
                if headers.get("slow"):
                    site.slow.wait(60)
                etag = headers.get("ETag")
                if etag and self.headers.get("If-None-Match") == etag or (
                        headers.get("Last-Modified") and self.headers.get("If-Modified-Since") == headers["Last-Modified"]):
                    status, body = 304, b""
                self.send_response(status)
                for name, value in headers.items():
                    if name != "slow":
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.base = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def page(self, path: str, title: str, text: str, links=(), **headers) -> None:
        body = f"<html><head><title>{title}</title></head><body><h1>{title}</h1><p>{text}</p>" + "".join(
            f'<a href="{link}">{link}</a>' for link in links) + "</body></html>"
        self.pages[path] = (200, {"Content-Type": "text/html; charset=utf-8", **headers}, body.encode())

    def requested(self, since: int = 0) -> list[str]:
        return [path for path, _, _ in self.log[since:]]


@pytest.fixture
def site():
    served = Site()
    yield served
    served.slow.set()
    served.server.shutdown()


def texts(conn, embedder, query: str) -> list[tuple[str, str]]:
    return [(h.document, h.content) for h in search(conn, embedder, query, 10, filters=Filters())]


def test_a_site_is_crawled_from_its_sitemap_and_refreshed_with_conditional_gets(settings, conn, embedder, site,
                                                                                monkeypatch):
    monkeypatch.setenv("KB_MAX_FILE_MB", "0.02")
    monkeypatch.setenv("KB_WEB_TIMEOUT_S", "15")  # the slow page never answers before the test releases it
    site.pages["/robots.txt"] = (200, {"Content-Type": "text/plain"},
                                 f"User-agent: *\nDisallow: /kb/private/\nSitemap: {site.base}/sitemap.xml\n".encode())
    listed = ["/kb/", "/kb/leave.html", "/kb/travel.html", "/kb/moved", "/kb/metadata", "/kb/gone.html",
              "/kb/huge.html", "/kb/slow.html", "/kb/private/salaries.html", "/elsewhere/page.html"]
    site.pages["/sitemap.xml"] = (200, {"Content-Type": "application/xml"}, (
        '<?xml version="1.0"?><urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">'
        + "".join(f"<url><loc>{site.base}{path}</loc></url>" for path in listed) + "</urlset>").encode())
    site.page("/kb/", "Handbook", "Welcome to the handbook.", ETag='"i1"')
    site.page("/kb/leave.html", "Leave", "A primary caregiver gets sixteen weeks of okapi leave.", ETag='"v1"')
    site.page("/kb/travel.html", "Travel", "Economy class for flights under six hours.",
              **{"Last-Modified": "Tue, 01 Dec 2026 10:00:00 GMT"})
    site.pages["/kb/moved"] = (301, {"Location": "/kb/parking.html"}, b"")
    site.page("/kb/parking.html", "Parking", "The zebra garage opens at seven.", ETag='"p1"')
    site.pages["/kb/metadata"] = (302, {"Location": "http://169.254.169.254/latest/meta-data/"}, b"")
    site.page("/kb/huge.html", "Huge", "word " * 10_000)
    site.page("/kb/slow.html", "Slow", "Answers in time only once released.", slow="1", ETag='"s1"')
    site.page("/kb/private/salaries.html", "Salaries", "Disallowed by robots.txt.")
    site.page("/elsewhere/page.html", "Elsewhere", "Outside the declared path.")
    kb("source", "add", "intranet", f"{site.base}/kb/", "--public")

    first = ingest(expect=3)
    failed = {e["file"]: e["reason"] for e in first["errors"]}
    assert set(failed) == {"gone.html", "metadata", "huge.html", "slow.html"}, failed
    assert "HTTP 404" in failed["gone.html"]
    assert "redirected to http://169.254.169.254/latest/meta-data/" in failed["metadata"] and "not followed" in failed["metadata"]
    assert "over the 0.02 MB limit" in failed["huge.html"] and "Timeout" in failed["slow.html"]
    assert (first["documents_new"], first["documents_fetched"]) == (4, 4)  # index, leave, travel, parking
    assert conn.execute("SELECT array_agg(locator ORDER BY locator) FROM documents").fetchone()[0] == \
        ["index.html", "leave.html", "parking.html", "travel.html"]
    assert any("sixteen weeks" in c for _, c in texts(conn, embedder, "okapi leave primary caregiver"))
    assert any("zebra garage" in c for _, c in texts(conn, embedder, "zebra garage parking"))
    asked = site.requested()
    assert not any(p.startswith("/kb/private/") or p.startswith("/elsewhere/") for p in asked), asked

    site.slow.set()
    before = len(site.log)
    again = ingest(expect=3)  # gone, metadata and huge fail again; slow now answers
    conditional = {path: (etag, since) for path, etag, since in site.log[before:]}
    assert conditional["/kb/leave.html"] == ('"v1"', None)
    assert conditional["/kb/travel.html"][1] == "Tue, 01 Dec 2026 10:00:00 GMT"
    assert (again["documents_unchanged"], again["documents_new"]) == (4, 1)  # 304s, and slow.html at last
    assert again["documents_fetched"] == 2  # slow.html, and parking.html behind its redirect (no tag for /kb/moved)
    crawl = again["sources"]["intranet"]
    assert (crawl["listed"], crawl["read"], crawl["unread"], crawl["unread_by"], crawl["failed"]) == (
        8, 2, 3, "304 Not Modified", 3)  # 5 pages and 3 failures listed

    site.page("/kb/leave.html", "Leave", "A primary caregiver gets twenty weeks of okapi leave.", ETag='"v2"')
    changed = ingest(expect=3)
    assert (changed["documents_changed"], changed["documents_fetched"]) == (1, 2)
    now = texts(conn, embedder, "okapi leave primary caregiver")
    assert any("twenty weeks" in c for _, c in now) and not any("sixteen" in c for _, c in now)


def test_a_site_without_a_sitemap_is_crawled_by_its_links_and_a_page_gone_is_deleted(settings, conn, embedder, site):
    site.page("/docs/", "Start", "The start page.", links=["a.html", "/docs/b.html", "/outside.html",
                                                          "http://169.254.169.254/", "/docs/../secret.html",
                                                          "/docs/%2e%2e/secret.html", "../secret.html"])
    site.page("/secret.html", "Secret", "Outside the declared path.")
    site.page("/docs/a.html", "A", "Page A talks about okapi stew.", links=["c.html"])
    site.page("/docs/b.html", "B", "Page B talks about zebra curry.")
    site.page("/docs/c.html", "C", "Page C talks about lemur soup.")
    kb("source", "add", "docs", f"{site.base}/docs/", "--public")
    first = ingest()
    assert first["documents_new"] == 4
    asked = site.requested()
    assert not [p for p in asked if not p.startswith("/docs/") and p not in ("/robots.txt", "/sitemap.xml")], asked
    assert not [p for p in asked if ".." in p or "%2e" in p.lower()], "a server reads /docs/%2e%2e/ as /"
    site.page("/docs/a.html", "A", "Page A talks about okapi stew.")  # the link to c is gone, and so is c
    del site.pages["/docs/c.html"]
    second = ingest()
    assert second["documents_deleted"] == 1
    assert not any("lemur" in c for _, c in texts(conn, embedder, "lemur soup"))
    assert any("okapi" in c for _, c in texts(conn, embedder, "okapi stew"))


def test_a_host_name_that_resolves_inside_is_crawled_only_when_declared_private(settings, conn, site):
    site.page("/docs/", "Start", "The start page.")
    kb("source", "add", "local", f"http://localhost:{site.port}/docs/", "--public")
    refused = ingest(expect=3)
    assert len(refused["errors"]) == 1 and "inside a private network" in refused["errors"][0]["reason"]
    assert "private_network = true" in refused["errors"][0]["reason"] and site.requested() == []
    kb("source", "add", "intranet", f"http://localhost:{site.port}/docs/", "--public", "--private-network", expect=2)
    kb("source", "remove", "local")
    kb("source", "add", "intranet", f"http://localhost:{site.port}/docs/", "--public", "--private-network")
    assert ingest("--source", "intranet")["documents_new"] == 1


def test_web_declarations_refuse_credentials(settings):
    refused = kb("source", "add", "w", "https://user:secret@intranet.example.com/", "--public", expect=2)
    assert "holds no credentials" in refused and "secret" not in refused
    assert "for web sources" in kb("source", "add", "p", ".", "--public", "--private-network", expect=2)


def test_a_crawl_past_its_time_budget_requests_no_more_pages_and_deletes_nothing(settings, conn, embedder, site,
                                                                                 monkeypatch):
    site.page("/docs/", "Start", "The start page.", links=["a.html", "b.html", "c.html"])
    for name in "abc":
        site.page(f"/docs/{name}.html", name.upper(), f"Page {name} talks about okapi stew.")
    ticks = itertools.count(0, 60)  # the clock each time it is read: a minute later than the last reading
    with WebSite(Scope.of(f"{site.base}/docs/", False), 1e6, 5) as web:
        pages = list(crawl(web, {}, lambda locator: None, 100, 10, max_s=150, clock=lambda: next(ticks)))
    assert [locator for locator, _ in pages[:2]] == ["index.html", "a.html"] and pages[2][1] is None
    assert "stopped after 2 pages: the refresh's 150 s (KB_WEB_MAX_S) ran out" == pages[2][0] and len(pages) == 3

    kb("source", "add", "docs", f"{site.base}/docs/", "--public")
    assert ingest()["documents_new"] == 4
    del site.pages["/docs/c.html"]
    monkeypatch.setenv("KB_WEB_MAX_S", "0")
    before = len(site.log)
    stopped = ingest(expect=3)
    assert "KB_WEB_MAX_S" in stopped["errors"][0]["reason"] and stopped["documents_deleted"] == 0
    assert not [p for p in site.requested(before) if p.startswith("/docs/")], "no page requested past the budget"
    assert any("Page c" in c for _, c in texts(conn, embedder, "okapi stew")), "a stopped crawl deleted nothing"


@pytest.mark.parametrize("address, private_network, refused", [
    ("93.184.216.34", False, None),
    ("100.100.100.200", True, "never contacts"),  # a cloud's metadata service, even on a private network
    ("fd00:ec2::254", True, "never contacts"),
    ("2002:a9fe:a9fe::1", False, "never contacts"),  # 169.254.169.254 inside a 6to4 address
    ("64:ff9b::a9fe:a9fe", False, "never contacts"),  # and inside a NAT64 one
    ("::ffff:127.0.0.1", False, "never contacts"),  # IPv4-mapped: a reserved range
    ("100.64.1.1", False, "inside a private network"),  # carrier-grade NAT: not public
    ("192.0.0.192", False, "inside a private network"),
    ("10.1.2.3", True, None),
])
def test_a_host_is_contacted_only_at_public_addresses_unless_declared_private(monkeypatch, address, private_network,
                                                                              refused):
    import socket

    from pipelines.sources.web import WebError

    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(None, None, None, "", (address, 443))])
    scope = Scope.of("https://docs.vendor.example/kb/", private_network)
    if refused is None:
        scope.check_address()
    else:
        with pytest.raises(WebError, match=refused):
            scope.check_address()


def test_compressed_pages_stop_at_the_limit_and_a_canonical_url_cannot_borrow_another_pages_name(
        settings, conn, embedder, site, monkeypatch):
    import gzip

    monkeypatch.setenv("KB_MAX_FILE_MB", "0.05")
    html = {"Content-Type": "text/html"}
    site.page("/kb/", "Start", "The start page.", links=["plain.html", "bomb.html", "stacked.html", "a1.html",
                                                         "cut.html"])
    site.pages["/kb/cut.html"] = (200, {**html, "Content-Encoding": "gzip"}, gzip.compress(
        b"<html><body><p>Half of this page never arrives.</p>" + b"<p>filler</p>" * 500)[:-40])
    site.pages["/kb/plain.html"] = (200, {**html, "Content-Encoding": "gzip"}, gzip.compress(
        b"<html><head><title>Plain</title></head><body><p>Okapi stew is served on Fridays.</p></body></html>"))
    site.pages["/kb/bomb.html"] = (200, {**html, "Content-Encoding": "gzip"}, gzip.compress(b"<p>" + b"0" * 50_000_000))
    site.pages["/kb/stacked.html"] = (200, {**html, "Content-Encoding": "gzip, gzip"},
                                      gzip.compress(gzip.compress(b"<p>stacked</p>")))
    site.page("/kb/a1.html", "A1", "Page A1 says the zebra garage is closed.")
    site.page("/kb/b1.html", "B1", "Page B1 says the zebra garage opens at seven.")
    site.pages["/kb/a1.html"] = (200, html, site.pages["/kb/a1.html"][2].replace(
        b"<head>", b'<head><link rel="canonical" href="/kb/b1.html">'))
    kb("source", "add", "docs", f"{site.base}/kb/", "--public")
    result = ingest(expect=3)
    failed = {e["file"]: e["reason"] for e in result["errors"]}
    assert set(failed) == {"bomb.html", "stacked.html", "cut.html", f"{site.base}/kb/"}, failed  # links unknown
    assert "ends early" in failed["cut.html"]
    assert "no page is deleted by this crawl" in failed[f"{site.base}/kb/"]
    assert "over the 0.05 MB limit" in failed["bomb.html"] and "is not read" in failed["stacked.html"]
    found = texts(conn, embedder, "zebra garage")
    assert ("b1.html", True) in {(d, "opens at seven" in c) for d, c in found}
    assert not any("is closed" in c for _, c in found), "a page's text stored under another page's name"
    assert any("Okapi stew" in c for _, c in texts(conn, embedder, "okapi stew Fridays"))


def test_a_crawl_that_cannot_see_every_page_deletes_none(settings, conn, embedder, site):
    site.pages["/robots.txt"] = (200, {"Content-Type": "text/plain"},
                                 f"Sitemap: {site.base}/index.xml\n".encode())
    urlset = '<?xml version="1.0"?><urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">{}</urlset>'
    site.pages["/index.xml"] = (200, {"Content-Type": "application/xml"}, (
        '<?xml version="1.0"?><sitemapindex xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">'
        f"<sitemap><loc>{site.base}/a.xml</loc></sitemap><sitemap><loc>{site.base}/b.xml</loc></sitemap>"
        "</sitemapindex>").encode())
    for name, pages in (("a", ["a1", "a2"]), ("b", ["b1", "b2"])):
        site.pages[f"/{name}.xml"] = (200, {"Content-Type": "application/xml"}, urlset.format("".join(
            f"<url><loc>{site.base}/kb/{p}.html</loc></url>" for p in pages)).encode())
        for p in pages:
            site.page(f"/kb/{p}.html", p.upper(), f"Page {p} is about okapi number {p}.")
    site.page("/kb/", "Start", "The start page.")
    kb("source", "add", "docs", f"{site.base}/kb/", "--public")
    assert ingest()["documents_new"] == 5
    site.pages["/b.xml"] = (503, {}, b"busy")
    partial = ingest(expect=3)
    assert "sitemap" in partial["errors"][0]["reason"] and partial["documents_deleted"] == 0
    assert conn.execute("SELECT count(*) FROM documents WHERE deleted_at IS NULL").fetchone()[0] == 5
