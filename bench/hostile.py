"""Peak memory and time of one `kb ingest` over a hostile folder at the sizes issue 10 reported: an 850 MB zip
bomb, a 200 MB text file, a DOCX of 100,000 paragraphs, a 300 KB token, an unreadable folder, a symlink to a
secret, undecodable names, NUL bytes, a JSONL source full of bad records and an emptied second source.

    .venv/bin/python -m bench.hostile

Builds the folder in a temporary directory (tests/hostile.py, the same kinds as the test at full size), ingests
the good versions once, breaks them, then runs `kb ingest --json` as a child process (without root's file
capabilities, so the chmod 000 folder is unreadable) and samples the resident memory of it and all its children
(parse workers) every 100 ms. The sum over processes counts shared pages once per process: an upper bound.
Writes bench/results/hostile.json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hostile import good_records, make_hostile, tcp_to_database, without_root_capabilities  # noqa: E402

from bench.report import write_results  # noqa: E402
from pipelines.settings import SAMPLES_DIR, load_settings  # noqa: E402
from pipelines.storage.database import database_url, ensure_database  # noqa: E402

KB = str(Path(sys.executable).parent / "kb")


def tree_rss(pid: int) -> int:
    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return 0


def run_measured(command: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float, int]:
    started = time.perf_counter()
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0]

    def sample() -> None:
        while child.poll() is None:
            peak[0] = max(peak[0], tree_rss(child.pid))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = child.communicate()
    sampler.join()
    result = subprocess.CompletedProcess(command, child.returncode, stdout, stderr)
    return result, time.perf_counter() - started, peak[0]


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="kb-hostile-"))
    os.environ["KB_HOME"] = str(work / "home")
    settings = load_settings()
    url = ensure_database(database_url(settings), "kb_bench_hostile")
    env = {**os.environ, "DATABASE_URL": url}
    docs, records, archive = work / "docs", work / "records.jsonl", work / "archive"
    shutil.copytree(SAMPLES_DIR / "docs", docs)
    good_records(records)
    archive.mkdir()
    (archive / "old-memo.md").write_text("# Old memo\n\nThe okapi enclosure moved in 2019.\n")
    first = subprocess.run([KB, "ingest", str(docs), str(records), str(archive), "--public", "--json"], env=env,
                           capture_output=True, text=True)
    assert first.returncode == 0, first.stderr

    started = time.perf_counter()
    expected = make_hostile(docs, records, work / "outside" / "shadow.txt", scale="full")
    (archive / "old-memo.md").unlink()
    build_s = time.perf_counter() - started
    try:
        with tcp_to_database(url) as tcp_url:
            result, seconds, peak = run_measured([*without_root_capabilities(), KB, "ingest", "--json"],
                                                 {**env, "DATABASE_URL": tcp_url})
    finally:
        (docs / "finance").chmod(0o755)
    data = json.loads(result.stdout)
    reasons = {e["file"]: e["reason"] for e in data["errors"]}
    unmatched = {loc: reasons.get(loc) for loc, fragment in expected.items() if fragment not in (reasons.get(loc) or "")}
    out = {"exit_code": result.returncode, "seconds": round(seconds, 1), "peak_rss_mb": round(peak / 1e6),
           "building_the_folder_s": round(build_s, 1), "errors": reasons, "expected_but_not_reported": unmatched,
           "paragraphs_docx": reasons.get("paragraphs.docx", "parsed and published"),
           "documents_published": data["documents_published"], "documents_deleted": data["documents_deleted"],
           "elapsed_s": data["elapsed_s"]}
    print(json.dumps(out, indent=2))
    write_results("hostile", out)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
