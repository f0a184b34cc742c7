"""A web site as a source (issue 28): first ingest, a no-op refresh and 1% of the pages changed, on a static site
that Python's own HTTP server (`python -m http.server`: Last-Modified from each file's mtime, 304 to an
If-Modified-Since that matches) serves on loopback, with the requests each refresh made.

    .venv/bin/python -m bench.site_refresh ../shared/datasets/scifact/corpus.jsonl --pages 1000 --home /tmp/kb-bench-site

Each page is one SciFact abstract as HTML (title, heading, text); past the corpus' end records repeat with a line
naming the copy. The site has a robots.txt naming its sitemap.xml, which lists every page. Each step is one `ingest`
of the source in this process (the model is loaded before the clock), timed whole. Requests are read from the
server's log, counted by status (200, 304, ...). A changed page gets new text and an mtime a minute later. Writes
bench/results/site_refresh_<N>.json.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from bench.report import print_table, write_results


def _serve(root: Path, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(root),
                                str(port)], stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    url = f"http://127.0.0.1:{port}"
    import httpx

    for _ in range(600):
        try:
            httpx.get(f"{url}/robots.txt", timeout=5)
            return process, url
        except httpx.TransportError:
            time.sleep(0.2)
    raise SystemExit(f"http.server did not start: {log.read_text()[-2000:]}")


def _requests(log: Path) -> list[tuple[str, str]]:
    """(path, status) of each request the server logged: `... "GET /site/00001.html HTTP/1.1" 304 -`."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r'"GET (\S+) HTTP/[\d.]+" (\d{3})', log.read_text())]


def _page(record: dict, copy: str) -> str:
    title = html.escape(record.get("title") or record["_id"])
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head><body><h1>{title}</h1>"
            f"<p>{html.escape(record['text'])}{html.escape(copy)}</p></body></html>")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--pages", type=int, default=1000)
    parser.add_argument("--home", type=Path, required=True)
    args = parser.parse_args()
    shutil.rmtree(args.home, ignore_errors=True)
    root = args.home / "www"
    (root / "site").mkdir(parents=True)
    os.environ.update(KB_HOME=str(args.home), KB_WEB_MAX_PAGES=str(args.pages + 10))
    records = [json.loads(line) for line in args.corpus.read_text().splitlines() if line.strip()]
    pages = {}
    for i in range(args.pages):
        copy = f" (copy {i // len(records)})" if i >= len(records) else ""
        pages[f"site/{i:05d}.html"] = _page(records[i % len(records)], copy)
    pages["site/index.html"] = "<!doctype html><html><head><title>Site</title></head><body><h1>Site</h1></body></html>"
    for path, text in pages.items():
        (root / path).write_text(text)
    log = args.home / "http-requests.log"
    server, url = _serve(root, log)
    (root / "robots.txt").write_text(f"User-agent: *\nAllow: /\nSitemap: {url}/sitemap.xml\n")
    (root / "sitemap.xml").write_text('<?xml version="1.0"?><urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">'
                                      + "".join(f"<url><loc>{url}/{path}</loc></url>" for path in sorted(pages))
                                      + "</urlset>")
    try:
        run(args, url, root, pages, log)
    finally:
        server.terminate()
        server.wait(timeout=30)


def run(args, url: str, root: Path, pages: dict, log: Path) -> None:
    from pipelines.ingest.run import ingest
    from pipelines.models.embedders import make_embedder
    from pipelines.settings import load_settings
    from pipelines.sources.declarations import add_source, declare
    from pipelines.storage.database import connect

    settings = load_settings()
    embedder = make_embedder(settings)
    embedder.embed(["warm up"])
    with connect(settings, install=True) as conn:
        add_source(conn, declare("site", f"{url}/site/", groups=None), "bench/site_refresh.py")
    results = []

    def step(name: str) -> None:
        before = len(_requests(log))
        started = time.perf_counter()
        with connect(settings) as conn:
            counters = ingest(conn, embedder, settings, ["site"]).counters()
        seconds = time.perf_counter() - started
        made = _requests(log)[before:]
        results.append({"step": name, "seconds": round(seconds, 2), "requests": len(made),
                        "by_status": dict(sorted(Counter(status for _, status in made).items())),
                        "new": counters["documents_new"], "changed": counters["documents_changed"],
                        "unchanged": counters["documents_unchanged"], "failed": counters["documents_failed"],
                        "embedded": counters["embeddings_computed"],
                        "stages_s": {k: round(v, 2) for k, v in counters["elapsed_s"].items()}})

    step("first ingest")
    step("no-op refresh")
    later = time.time() + 60
    for path in sorted(p for p in pages if p != "site/index.html")[::100]:  # 1%
        page = root / path
        page.write_text(pages[path].replace("</p>", " Edited for the benchmark.</p>"))
        os.utime(page, (later, later))
    step("1% changed")
    print_table([{**r, "by_status": " ".join(f"{k} {v}" for k, v in r["by_status"].items())} for r in results],
                ["step", "seconds", "requests", "by_status", "new", "changed", "unchanged", "failed", "embedded"])
    path = write_results(f"site_refresh_{args.pages}", {"pages": args.pages, "corpus": str(args.corpus),
                                                        "load_average": os.getloadavg(), "steps": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
