"""Web-site sources: the pages of one origin below a path (`https://intranet.example.com/handbook/`), found through
the site's sitemaps, else by following its links from the declared URL.

Only the declared origin is ever asked for anything, below the declared path: a link, a sitemap entry or a redirect
that leads elsewhere (another host, `file://`, 169.254.169.254) is not followed, and a redirect off the origin fails
that page. Before each request the host's addresses are checked: link-local, multicast and reserved addresses are
never contacted; loopback and private ones only when the declaration names an address, or says the site is on the
company's network (`private_network = true`), so a public site whose name starts pointing inside cannot make kb
read the inside. robots.txt is honoured for the user agent `kb` (a robots.txt that cannot be read, other than 4xx,
stops the crawl: RFC 9309). Each page is asked for with the ETag and Last-Modified it had (an unchanged page costs a
304), read no further than the per-file limit, and stored for the parse stage as fetched: a page that differs at
every request is parsed as this crawl saw it. A crawl stops at KB_WEB_MAX_PAGES pages or KB_WEB_MAX_DEPTH links from
the start; a crawl that stopped early, or could not read the site, deletes nothing.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
import socket
import time
import xml.etree.ElementTree as ElementTree
import zlib
from collections import deque
from dataclasses import dataclass, field, replace
from html.parser import HTMLParser
from typing import Callable, Iterator
from urllib.parse import urljoin, urlsplit, urlunsplit
from urllib.robotparser import RobotFileParser

AGENT = "kb"
# Cloud metadata services, never contacted even on a private network: AWS/GCP/Azure, AWS over IPv6, Alibaba.
METADATA = {ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200")}
NAT64 = ipaddress.ip_network("64:ff9b::/96")
# Special-purpose ranges this Python's `is_global` may still call global (IETF protocol assignments, 192.0.0.0/24).
NOT_PUBLIC = [ipaddress.ip_network("192.0.0.0/24")]
MAX_REDIRECTS = 5
MAX_SITEMAPS = 50
SITEMAP_BYTES = 50_000_000  # the sitemap protocol's own limit per file
PAGE_TYPES = {"text/html": "html", "application/xhtml+xml": "html"}


class WebError(OSError):
    """The site cannot be crawled (robots.txt unreachable, the start page refused); the message says why."""


class PageError(ValueError):
    """One page that cannot be fetched; the message says why."""


def is_web(location: str) -> bool:
    return str(location).split("://", 1)[0].lower() in ("http", "https") and "://" in str(location)


def normalise(url: str) -> str:
    """The declared start URL, or ValueError: http(s), a host, no credentials, no fragment."""
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"{url}: name the site's host (https://HOST/path)")
    if parts.username or parts.password:
        raise ValueError(f"{parts.scheme}://{parts.hostname}/...: a site URL holds no credentials")
    return urlunsplit((parts.scheme.lower(), parts.netloc.lower(), parts.path or "/", parts.query, ""))


@dataclass(frozen=True)
class Scope:
    """What one web source may fetch: its origin, below its path."""

    origin: tuple[str, str, int]
    prefix: str  # the declared path up to its last '/'
    start: str
    private_network: bool

    @classmethod
    def of(cls, url: str, private_network: bool) -> "Scope":
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls((parts.scheme, parts.hostname, port), parts.path[: parts.path.rfind("/") + 1] or "/", url,
                   private_network)

    def holds(self, url: str) -> bool:
        """Whether the URL is this origin's, below the declared path, once its dot segments are resolved as a
        server would resolve them (`/kb/../private/` is `/private/`)."""
        parts = urlsplit(resolved(url))
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            return False
        return (parts.scheme, parts.hostname, port) == self.origin and parts.path.startswith(self.prefix)

    def locator(self, url: str) -> str:
        """A page's name in the source: its path below the declared one (a folder URL as its index.html), with its
        query."""
        parts = urlsplit(url)
        relative = parts.path[len(self.prefix):]
        if relative == "" or relative.endswith("/"):
            relative += "index.html"
        return relative + (f"?{parts.query}" if parts.query else "")

    def check_address(self) -> None:
        """Refuse a host whose addresses kb must not contact (see the module's docstring)."""
        host = self.origin[1]
        try:
            named = ipaddress.ip_address(host)
        except ValueError:
            named = None
        try:
            infos = socket.getaddrinfo(host, self.origin[2], type=socket.SOCK_STREAM)
        except OSError as exc:
            raise WebError(f"cannot resolve {host}: {exc}") from exc
        for info in infos:
            resolved_to = ipaddress.ip_address(info[4][0].split("%")[0])
            # An IPv4 address inside an IPv6 one (::ffff:127.0.0.1, 2002:a9fe:a9fe::, 64:ff9b::a9fe:a9fe) is that one.
            for address in filter(None, (resolved_to, getattr(resolved_to, "ipv4_mapped", None),
                                         getattr(resolved_to, "sixtofour", None), _nat64(resolved_to))):
                if (address in METADATA or address.is_link_local or address.is_multicast or address.is_unspecified
                        or address.is_reserved):
                    raise WebError(f"{host} resolves to {resolved_to}, an address kb never contacts (a cloud metadata"
                                   " service, link-local, multicast or reserved)")
                public = address.is_global and not any(address in network for network in NOT_PUBLIC)
                if not public and named is None and not self.private_network:
                    raise WebError(f"{host} resolves to {resolved_to}, inside a private network; if the site really is"
                                   " the company's own, declare it with private_network = true")


def _nat64(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address a NAT64 address (64:ff9b::/96) carries."""
    if address.version == 6 and address in NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def resolved(url: str) -> str:
    """The URL with its dot segments (also percent-encoded ones) removed, as servers read it."""
    parts = urlsplit(url)
    path = re.sub(r"%2[eE]", ".", parts.path) or "/"
    clean = urlsplit(urljoin(f"{parts.scheme}://{parts.netloc}/", path if path.startswith("/") else "/" + path))
    return urlunsplit((parts.scheme, parts.netloc, clean.path, parts.query, ""))


def _shown(scope: Scope) -> str:
    scheme, host, port = scope.origin
    return f"{scheme}://{host}:{port}{scope.prefix}"


class _Links(HTMLParser):
    """The links and the canonical URL of an HTML page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.links: list[str] = []
        self.canonical: str | None = None

    def handle_starttag(self, tag: str, attrs) -> None:
        values = dict(attrs)
        if tag == "a" and values.get("href"):
            self.links.append(values["href"])
        elif tag == "link" and (values.get("rel") or "").lower() == "canonical" and values.get("href"):
            self.canonical = values["href"]


@dataclass
class Page:
    url: str
    status: int  # 200, or 304 (unchanged since the tag sent)
    body: bytes = b""
    doc_format: str = "html"
    tag: str | None = None  # the validators it came with, as stored in documents.version_tag
    last_modified: str | None = None
    links: list[str] = field(default_factory=list)
    canonical: str | None = None


class Site:
    """One crawl's client for one web source."""

    def __init__(self, scope: Scope, limit_bytes: float, timeout_s: float) -> None:
        import httpx

        self.scope, self.limit, self.timeout_s = scope, limit_bytes, timeout_s
        self.client = httpx.Client(follow_redirects=False, timeout=timeout_s, trust_env=False,
                                   headers={"User-Agent": f"{AGENT}/1", "Accept-Encoding": "gzip, deflate"})
        self.requests = 0

    def __enter__(self) -> "Site":
        return self

    def __exit__(self, *exc) -> None:
        self.client.close()

    def get(self, url: str, tag: str | None = None, limit: float | None = None, scope: Scope | None = None) -> Page:
        """The page at `url` (redirects inside `scope`, by default the source's, followed), or PageError."""
        import httpx

        scope = scope or self.scope
        headers = {}
        if tag:
            validators = json.loads(tag)
            if validators.get("etag"):
                headers["If-None-Match"] = validators["etag"]
            if validators.get("last_modified"):
                headers["If-Modified-Since"] = validators["last_modified"]
        for _ in range(MAX_REDIRECTS + 1):
            scope.check_address()
            self.requests += 1
            try:
                with self.client.stream("GET", url, headers=headers) as response:
                    if response.has_redirect_location:
                        target = resolved(urljoin(url, response.headers.get("location", "")))
                        if not scope.holds(target):
                            raise PageError(f"redirected to {target}, outside {_shown(scope)}: not followed")
                        url = target
                        continue
                    if response.status_code == 304:
                        return Page(url, 304, tag=tag)
                    if response.status_code != 200:
                        raise PageError(f"HTTP {response.status_code}")
                    body = self._read(response, self.limit if limit is None else limit,
                                      time.monotonic() + self.timeout_s)
                    kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
                    validators = {k: v for k, v in (("etag", response.headers.get("etag")),
                                                    ("last_modified", response.headers.get("last-modified"))) if v}
                    return Page(url, 200, body, PAGE_TYPES.get(kind, kind), json.dumps(validators, sort_keys=True)
                                if validators else None, validators.get("last_modified"))
            except httpx.HTTPError as exc:
                raise PageError(f"{type(exc).__name__}: {exc}") from exc
        raise PageError(f"more than {MAX_REDIRECTS} redirects")

    def _read(self, response, limit: float, deadline: float) -> bytes:
        """The body, decoded here rather than by httpx so that a compression bomb stops at the limit: gzip or deflate
        once (stacked or other encodings are refused), inflated at most to the limit, all within the request's
        KB_WEB_TIMEOUT_S (a server that drips a byte at a time does not hold the crawl)."""
        encoding = response.headers.get("content-encoding", "identity").strip().lower() or "identity"
        if encoding not in ("identity", "gzip", "x-gzip", "deflate"):
            raise PageError(f"content encoding {encoding!r} is not read (gzip or deflate, once)")
        inflate = None if encoding == "identity" else zlib.decompressobj(32 + zlib.MAX_WBITS)  # gzip or zlib header
        data = bytearray()
        try:
            for raw in response.iter_raw():
                while raw:
                    if inflate is None:
                        data += raw
                        raw = b""
                    else:
                        data += inflate.decompress(raw, int(limit) + 1 - len(data))
                        raw = inflate.unconsumed_tail
                    if len(data) > limit:
                        raise PageError(f"the page is over the {limit / 1e6:g} MB limit (KB_MAX_FILE_MB)")
                if time.monotonic() > deadline:
                    raise PageError(f"the page took more than {self.timeout_s:g} s (KB_WEB_TIMEOUT_S)")
            if inflate is not None:
                data += inflate.flush()
                if not inflate.eof:  # a body cut short in transfer: storing what came would store half a page
                    raise PageError(f"the page's {encoding} body ends early (cut short in transfer)")
        except zlib.error as exc:
            raise PageError(f"the page's {encoding} body is damaged: {exc}") from None
        if len(data) > limit:
            raise PageError(f"the page is over the {limit / 1e6:g} MB limit (KB_MAX_FILE_MB)")
        return bytes(data)

    def robots(self) -> RobotFileParser:
        """The site's robots.txt rules; WebError when it cannot be read (a 4xx means no rules)."""
        scheme, host, port = self.scope.origin
        url = f"{scheme}://{host}:{port}/robots.txt"
        rules = RobotFileParser(url)
        try:
            page = self._origin_get(url)
        except PageError as exc:
            if str(exc).startswith("HTTP 4"):
                rules.parse([])
                return rules
            raise WebError(f"cannot read {url} ({exc}): kb does not crawl a site whose robots.txt it cannot read")
        rules.parse(page.body.decode("utf-8", "replace").splitlines())
        return rules

    def _origin_get(self, url: str) -> Page:
        """A request to the origin outside the declared path (robots.txt, sitemaps): the same address checks, and
        redirects followed on the origin only."""
        return self.get(url, limit=SITEMAP_BYTES, scope=self._origin())

    def _origin(self) -> Scope:
        return replace(self.scope, prefix="/")

    def sitemap_urls(self, rules: RobotFileParser) -> tuple[list[str], str | None]:
        """(the in-scope page URLs the site's sitemaps list (robots.txt's Sitemap: lines, else /sitemap.xml), an
        index's sitemaps followed; [] when it has none, why the list is incomplete or None). A default /sitemap.xml
        that is not there means no sitemap; a named or indexed one that fails, or more than MAX_SITEMAPS, leaves the
        list incomplete: the pages of the sitemap that failed are unknown, and nothing may be deleted for them."""
        scheme, host, port = self.scope.origin
        named = rules.site_maps()
        queue = deque(named or [f"{scheme}://{host}:{port}/sitemap.xml"])
        seen, pages, problem = set(), [], None
        while queue:
            url = queue.popleft()
            if url in seen or not self._origin().holds(url):
                continue
            if len(seen) >= MAX_SITEMAPS:
                problem = f"more than {MAX_SITEMAPS} sitemaps: the pages of {url} and after are not listed"
                break
            seen.add(url)
            try:
                root = ElementTree.fromstring(self._origin_get(url).body)
            except (PageError, ElementTree.ParseError) as exc:
                if named or len(seen) > 1 or not str(exc).startswith("HTTP 404"):
                    problem = problem or f"sitemap {url} could not be read ({exc})"
                continue
            for loc in (e.text.strip() for e in root.iter() if e.tag.rsplit("}", 1)[-1] == "loc" and e.text):
                if root.tag.rsplit("}", 1)[-1] == "sitemapindex":
                    queue.append(loc)
                elif self.scope.holds(loc):
                    pages.append(loc)
        return pages, problem


def page_url(scope: Scope, locator: str) -> str:
    """A page's URL, as messages name it."""
    scheme, host, port = scope.origin
    path, _, query = locator.partition("?")
    return urlunsplit((scheme, f"{host}:{port}", scope.prefix + path, query, ""))


def links_of(page: Page) -> tuple[list[str], str | None]:
    """(absolute links, canonical URL) of an HTML page."""
    parser = _Links()
    try:
        parser.feed(page.body.decode("utf-8", "replace"))
    except Exception:  # noqa: BLE001 - html.parser on hostile markup: no links is the safe answer
        return [], None
    absolute = [resolved(urljoin(page.url, href).split("#", 1)[0]) for href in parser.links]
    return absolute, resolved(urljoin(page.url, parser.canonical)) if parser.canonical else None


GAP = "gap"  # crawl() yields (reason, GAP) once when it goes on but cannot see every page: nothing is deleted


def crawl(site: Site, known_tags: dict[str, str | None], stored: Callable[[str], bytes | None], max_pages: int,
          max_depth: int, max_s: float = math.inf,
          clock: Callable[[], float] = time.monotonic) -> Iterator[tuple[str, Page | PageError | str | None]]:
    """(locator, page or why it failed) for every page in scope: the sitemap's, else those reached by links from the
    start URL (at most `max_depth` links away); an unchanged page's links are read from its `stored` body. Yields
    (reason, None) once and stops when `max_pages` is reached or `max_s` seconds of `clock` have passed before a
    page is requested; yields (reason, GAP) once and goes on when some pages cannot be known (a sitemap that failed;
    following links, a page that failed other than with a 4xx, a 304 without its stored body, links past
    max_depth). Either way the crawl is incomplete. A page whose canonical URL is another in-scope page is not
    stored: that page is fetched itself (a page cannot put its text under another's name)."""
    deadline = clock() + max_s
    rules = site.robots()
    listed, gap = site.sitemap_urls(rules)
    queue = deque((url, 0) for url in dict.fromkeys(resolved(url) for url in [site.scope.start, *listed]))
    follow = not listed
    seen: set[str] = set()
    visited = 0
    while queue:
        if gap:
            yield gap, GAP
            gap = ""
        url, depth = queue.popleft()
        locator = site.scope.locator(url)
        if locator in seen or not rules.can_fetch(AGENT, url):
            continue
        seen.add(locator)
        if visited >= max_pages:
            yield f"stopped after {max_pages} pages (KB_WEB_MAX_PAGES)", None
            return
        if clock() >= deadline:
            yield f"stopped after {visited} pages: the refresh's {max_s:g} s (KB_WEB_MAX_S) ran out", None
            return
        visited += 1
        try:
            page = site.get(url, known_tags.get(locator))
        except PageError as exc:
            yield locator, exc
            if follow and gap is None and not str(exc).startswith("HTTP 4"):  # a page gone took its links with it
                gap = f"{locator} failed: the pages it links to are not known"
            continue
        if page.url != url:  # redirected inside the scope: the page is named by where it is
            locator = site.scope.locator(page.url)
            if locator in seen:
                continue
            seen.add(locator)
        if page.status == 304:
            page.body = stored(locator) or b""
            if follow and not page.body and gap is None:
                gap = f"{locator} is unchanged but its stored copy is gone: the pages it links to are not known"
        if page.doc_format == "html" and page.body:
            links, canonical = links_of(page)
            if canonical and resolved(canonical) != resolved(page.url) and site.scope.holds(canonical):
                if site.scope.locator(canonical) not in seen:
                    queue.appendleft((canonical, depth))
                continue  # the same page under another URL: stored once, under its canonical one, as fetched there
            if follow and depth < max_depth:
                queue.extend((link, depth + 1) for link in links if site.scope.holds(link))
            elif follow and gap is None and any(site.scope.holds(link) and site.scope.locator(link) not in seen
                                                for link in links):
                gap = f"links past {max_depth} deep (KB_WEB_MAX_DEPTH) are not followed"
        yield locator, page
    if gap:
        yield gap, GAP


def place_path(url: str) -> str:
    """The site's place for the overlap rules: origin and path, scheme and default port made explicit."""
    scope = Scope.of(url, False)
    scheme, host, port = scope.origin
    return f"web://{host}:{port}{scope.prefix}".rstrip("/") if scope.prefix != "/" else f"web://{host}:{port}"

