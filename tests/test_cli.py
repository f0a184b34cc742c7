"""The CLI as a person meets it, run as the installed `kb` command: where the knowledge base lives, progress,
times, and mistakes that end in one clear line and exit 2 rather than a traceback."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import re
import shutil
import socket
import struct
import subprocess
import sys
import termios
from pathlib import Path

import psutil
import pytest
from deadline import killed_after

from pipelines.settings import SAMPLES_DIR

KB = str(Path(sys.executable).parent / "kb")
ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00"


def kb(*args: str, cwd: Path | None = None, env: dict | None = None, stdin: str | None = None):
    return subprocess.run([KB, *args], capture_output=True, text=True, cwd=cwd, input=stdin,
                          env=os.environ.copy() if env is None else env, timeout=600)


def one_error_line(result, *phrases: str) -> None:
    """Exit 2, no traceback, and exactly one `Error:` line that says what is wrong."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.stderr
    for phrase in phrases:
        assert phrase in errors[0], errors[0]


def small_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "small"
    folder.mkdir()
    shutil.copy(SAMPLES_DIR / "docs" / "handbook" / "leave-policy.md", folder)
    shutil.copy(SAMPLES_DIR / "docs" / "ops" / "postgres-runbook.txt", folder)
    return folder


def records(tmp_path: Path) -> Path:
    path = tmp_path / "tickets.jsonl"
    path.write_text("".join(json.dumps({"_id": f"t{i}", "title": f"Ticket {i}", "text": f"The printer on floor {i}"
                                        " jams when printing duplex."}) + "\n" for i in range(3)))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_version():
    out = kb("--version")
    assert out.returncode == 0 and re.fullmatch(r"kb \d+\.\d+\.\d+\S*\n", out.stdout)


def test_the_knowledge_base_is_found_upward_like_git_else_per_user(settings, tmp_path):
    project = tmp_path / "project"
    (project / ".kb").mkdir(parents=True)
    (project / "docs" / "deep").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "KB_HOME"}
    env["XDG_DATA_HOME"] = str(tmp_path / "xdg")

    inside = kb("status", cwd=project / "docs" / "deep", env=env)
    assert inside.returncode == 0, inside.stderr
    assert f"knowledge base: {project}/.kb (found {project}/.kb;" in inside.stdout
    outside = kb("status", "--json", cwd=elsewhere, env=env)
    assert json.loads(outside.stdout)["home"] == {"path": str(tmp_path / "xdg" / "kb"), "found": "per-user default",
                                                  "database": "DATABASE_URL"}
    assert not (elsewhere / ".kb").exists()  # never a fresh, empty knowledge base where the command happened to run
    explicit = kb("status", cwd=elsewhere, env={**env, "KB_HOME": str(project / ".kb")})
    assert f"knowledge base: {project}/.kb (KB_HOME;" in explicit.stdout


def test_each_stage_reports_its_total_and_its_end_when_not_on_a_terminal(settings, tmp_path):
    out = kb("ingest", str(small_folder(tmp_path)), str(records(tmp_path)), "--public")
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["declared source small", "declared source tickets"]
    assert all(re.match(r"\d\d:\d\d:\d\d \w+: ", line) for line in lines[2:]), lines  # each line says when
    lines = [line[9:] for line in lines[2:]]
    for stage in ("extract", "parse", "chunk", "enrich", "embed", "publish", "cards"):
        assert any(re.fullmatch(rf"{stage}: \d+ to do", line) for line in lines), (stage, lines)
        assert any(re.fullmatch(rf"{stage}: done, \d+ in \d+\.\d\d s", line) for line in lines), (stage, lines)
    assert lines[:2] == ["extract: 2 to do", "extract: 3 more to do"]  # the folder's files, then the records
    assert "extract: done, 5 in" in out.stderr
    assert "parse: 2 to do" in lines  # records need no parsing: they are read as text at extract
    embedded = next(int(m.group(1)) for line in lines if (m := re.fullmatch(r"embed: (\d+) to do", line)))
    assert embedded > 0 and f"embed: done, {embedded} in" in out.stderr
    assert "%|" not in out.stderr and "/s]" not in out.stderr  # no bars in logs


def on_a_terminal(*args: str) -> str:
    """What `kb ARGS` writes to a terminal 120 columns wide (its stderr), once it has exited 0."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    process = subprocess.Popen([KB, *args], stdout=subprocess.PIPE, stderr=follower, env=os.environ.copy())
    os.close(follower)
    with killed_after(process):
        screen = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal closed
                break
            if not chunk:
                break
            screen += chunk
        assert process.wait(timeout=600) == 0
    return screen.decode(errors="replace")


def test_on_a_terminal_each_stage_shows_a_bar_with_total_rate_and_eta(settings, tmp_path):
    folder = small_folder(tmp_path)
    text = on_a_terminal("ingest", str(folder), "--public")
    for stage in ("extract", "parse", "chunk", "enrich", "embed", "publish"):
        bar = re.search(rf"{stage}\s*: +\d+%\|[^|]*\| \d+/(\d+) \[\d\d:\d\d<[\d:?]+, +(?:[\d.?]+ ?\w+/s|[\d.]+s/\w+)\]",
                        text)
        assert bar and int(bar.group(1)) > 0, (stage, text[-2000:])
    for stage in ("extract", "parse", "chunk", "enrich", "embed", "publish"):  # each bar stays, at 100%, when done
        assert re.search(rf"\r{stage}\s*: 100%\|[^\r\n]*\]\r?\n", text), (stage, text[-2000:])
    again = on_a_terminal("ingest", "--source", "small")  # nothing changed: said in words, not as an empty bar
    for stage in ("parse", "chunk", "enrich", "embed", "publish"):
        assert re.search(rf"\r{stage}\s*: nothing to do\r?\n", again), (stage, again[-2000:])


def test_text_output_has_iso_times_and_never_says_none(settings, tmp_path):
    assert kb("ingest", str(small_folder(tmp_path)), "--public").returncode == 0
    status = kb("status")
    assert re.search(rf"last crawled {ISO}", status.stdout) and re.search(rf"last run: #1 .* at {ISO}", status.stdout)
    debug = kb("search", "printer duplex jam HR-2024-047", "--debug", "--k", "5")
    assert debug.returncode == 0 and "None" not in status.stdout + debug.stdout
    history = kb("history", "small:leave-policy.md")
    assert re.search(ISO, history.stdout) and "None" not in history.stdout
    as_json = json.loads(kb("status", "--json").stdout)
    started = as_json["last_run"]["started_at"]  # isoformat() leaves out a fraction of .000000
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?\+00:00", started), started


def test_an_as_of_before_the_first_ingest_says_why_nothing_is_found(settings, tmp_path):
    assert kb("ingest", str(small_folder(tmp_path)), "--public").returncode == 0
    out = kb("search", "HR-2024-047", "--as-of", "2024-06-01")
    assert out.returncode == 0
    assert re.match(rf"no results: nothing was in the knowledge base at 2024-06-01T00:00:00\+00:00: its history starts"
                    rf" at {ISO}", out.stdout), out.stdout
    for command in ("search", "ask"):  # the README's form, minutes and no zone, as `kb search` and `kb ask` read it
        out = kb(command, "HR-2024-047", "--as-of", "2024-06-01T09:00", "--json")
        assert out.returncode == 0, out.stderr


def test_user_mistakes_exit_2_with_one_clear_line(settings, tmp_path):
    page = tmp_path / "notes.md"
    page.write_text("# Notes\n\nSome text.")
    one_error_line(kb("ingest", str(page)), str(page), "not a single file")
    one_error_line(kb("cite", "-", stdin="{not json"), "not an answer to check")
    one_error_line(kb("status", env={**os.environ, "KB_EMBEDDER": "bogus"}), "KB_EMBEDDER", "bogus")
    unreachable = f"postgresql://kb@127.0.0.1:{free_port()}/kb"
    one_error_line(kb("status", env={**os.environ, "DATABASE_URL": unreachable}), "cannot connect to PostgreSQL",
                   "check DATABASE_URL, or unset it")
    nan = kb("search", "leave", "--lexical-weight", "nan")
    assert nan.returncode == 2 and "'nan' is not a number from 0 to 1" in nan.stderr and "Traceback" not in nan.stderr


def test_verbose_adds_the_traceback(settings):
    out = kb("--verbose", "status", env={**os.environ, "KB_EMBEDDER": "bogus"})
    assert out.returncode == 2 and "Traceback" in out.stderr and "ConfigError" in out.stderr


@pytest.fixture
def postgres_without_pgvector(tmp_path):
    """Debian's PostgreSQL 15 (no pgvector installed for it) on a free port, for as long as the test runs."""
    bin_dir = Path("/usr/lib/postgresql/15/bin")
    assert (bin_dir / "postgres").exists(), "make test installs Debian's postgresql-15"
    assert not Path("/usr/share/postgresql/15/extension/vector.control").exists()
    data = tmp_path / "plain-pg"
    data.mkdir()
    as_postgres = []
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        shutil.chown(tmp_path, "postgres")
        shutil.chown(data, "postgres")
        as_postgres = ["runuser", "-u", "postgres", "--"]
    subprocess.run([*as_postgres, bin_dir / "initdb", "-D", data, "-A", "trust", "-U", "postgres"], check=True,
                   capture_output=True, timeout=300)
    port = free_port()
    subprocess.run([*as_postgres, bin_dir / "pg_ctl", "-D", data, "-w", "-l", data / "log", "-o",
                    f"-p {port} -k {data} -c listen_addresses=127.0.0.1", "start"], check=True, capture_output=True,
                   timeout=300)
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_postgres, bin_dir / "pg_ctl", "-D", data, "-m", "immediate", "stop"], capture_output=True,
                       timeout=300)


def test_a_server_without_pgvector_is_a_configuration_error(postgres_without_pgvector):
    out = kb("status", env={**os.environ, "DATABASE_URL": postgres_without_pgvector})
    one_error_line(out, "pgvector")


def test_cite_strict_fails_on_an_invalid_citation(settings, tmp_path):
    assert kb("ingest", str(small_folder(tmp_path)), "--public").returncode == 0
    hits = json.loads(kb("search", "primary caregiver paid leave weeks", "--k", "3", "--json").stdout)["chunks"]
    answer = {"claims": [{"text": "Primary caregivers get paid leave.", "citations": [hits[0]["chunk_id"]]},
                         {"text": "Primary caregivers get paid leave.", "citations": [10**9]}],
              "retrieved": [h["chunk_id"] for h in hits]}
    path = tmp_path / "answer.json"
    path.write_text(json.dumps(answer))
    lenient = kb("cite", str(path))
    assert lenient.returncode == 0 and "INVALID" in lenient.stdout
    strict = kb("cite", "--strict", str(path))
    assert strict.returncode == 3 and "INVALID" in strict.stdout
    path.write_text(json.dumps({**answer, "claims": answer["claims"][:1]}))
    assert kb("cite", "--strict", str(path)).returncode == 0


def test_a_file_name_cannot_forge_a_line_of_output(settings, tmp_path):
    folder = small_folder(tmp_path)
    (folder / "evil\nERROR small:forged.md: everything is fine.md").write_bytes(b"")  # an empty file fails
    out = kb("ingest", str(folder), "--source", "small", "--public")
    assert out.returncode == 3
    errors = [line for line in out.stdout.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and errors[0].startswith("ERROR small:evil\\x0aERROR small:forged.md")  # one failure
    assert [line for line in kb("status").stdout.splitlines() if line.startswith("failing")][0].startswith(
        "failing: small:evil\\x0aERROR")


def test_kb_serve_stopped_with_sigterm_stops_the_embedded_server(tmp_path):
    import signal
    import time
    import urllib.error
    import urllib.request

    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"} | {"KB_HOME": str(tmp_path / "home")}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([KB, "serve", "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    pid_file = tmp_path / "home" / "pgdata" / "postmaster.pid"
    try:
        deadline = time.monotonic() + 300
        while True:  # until it answers: a home without `kb migrate` answers 503, which is up (the wait took all 300 s)
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except urllib.error.HTTPError:
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "the server never came up"
                time.sleep(0.2)
        assert pid_file.exists(), "the embedded PostgreSQL never started"
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=120) == 0
    finally:
        server.kill()
    assert not pid_file.exists(), "the embedded PostgreSQL outlived `kb serve`"


def test_an_embedded_server_that_cannot_start_or_a_full_disk_is_one_line(tmp_path):
    import psycopg

    from pipelines.settings import load_settings
    from pipelines.storage.database import describe_lost_connection

    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"} | {"KB_HOME": str(tmp_path / "home")}
    assert kb("status", env=env).returncode == 0  # creates the server; it stops when the command ends
    with open(tmp_path / "home" / "pgdata" / "postgresql.auto.conf", "a") as conf:
        conf.write("shared_buffers = 'a lot, please'\n")
    one_error_line(kb("status", env=env), "the embedded PostgreSQL in", "did not start", "nothing stored is lost")
    full = psycopg.errors.DiskFull("could not extend file \"base/16384/16385\": No space left on device")
    message = describe_lost_connection(full, load_settings())
    assert "is full" in message and "free some disk space" in message


def test_a_database_url_that_is_not_one_is_one_line(tmp_path):
    one_error_line(kb("status", env={**os.environ, "DATABASE_URL": "not-a-url"}),
                   "DATABASE_URL is not a PostgreSQL connection string", "postgresql://USER:PASSWORD@HOST:5432/DBNAME")


def test_kb_eval_names_what_a_dataset_or_a_question_set_lacks(settings, tmp_path):
    folder = small_folder(tmp_path)
    one_error_line(kb("eval", str(folder)), f"{folder} is not a BEIR dataset", "qrels/test.tsv", "scifact.zip")
    (folder / "corpus.jsonl").write_text("")
    (folder / "queries.jsonl").write_text("")
    (folder / "qrels").mkdir()
    (folder / "qrels" / "dev.tsv").write_text("")
    one_error_line(kb("eval", str(folder), "--split", "test"), "no qrels/test.tsv", "its splits are dev")
    questions = tmp_path / "questions.jsonl"
    questions.write_text('{"q": "How long is parental leave?"}\n')
    one_error_line(kb("eval", "--answers", str(questions)), 'line 1 has no "question"', "samples/answers.jsonl")


def test_history_of_an_unknown_document_is_one_line(settings):
    one_error_line(kb("history", "nosuch.md"), "no document 'nosuch.md'", "SOURCE:PATH")


def test_serve_on_a_busy_port_is_one_line_not_uvicorns_log():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = kb("serve", "--port", str(port))
    one_error_line(out, f"cannot listen on 127.0.0.1:{port}", "--port")
    assert "INFO" not in out.stderr


def processes_of(kb_home: Path) -> list[psutil.Process]:
    """The processes running with this KB_HOME: a command started with it and whatever it started, even orphaned."""
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.environ().get("KB_HOME") == str(kb_home) and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


def left_running(kb_home: Path) -> list[str]:
    """What still runs with this KB_HOME once its processes had 30 s to exit; each is killed before this returns."""
    _, alive = psutil.wait_procs(processes_of(kb_home), timeout=30)
    named = []
    for process in alive:
        with contextlib.suppress(psutil.Error):
            named.append(" ".join(process.cmdline()[:4]))
            process.kill()
    return named


def test_kb_dagster_dev_on_a_busy_port_is_one_line_and_starts_nothing(tmp_path):
    """Before: `dagster dev` started, printed "Serving ...", then "address already in use", and its daemon and
    webserver kept running with no UI."""
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"} | {"KB_HOME": str(home)}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        command = subprocess.Popen([KB, "dagster", "dev", "--port", str(port)], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = command.communicate(timeout=120)
        finally:
            leftover = left_running(home)
    out = subprocess.CompletedProcess(command.args, command.returncode, stdout, stderr)
    one_error_line(out, f"cannot listen on 127.0.0.1:{port}", "in use", "choose another with --port")
    assert leftover == []


def test_kb_dagster_dev_serves_the_checkout_it_started_in_without_a_warning(settings, fresh_clone, tmp_path):
    """Started in a subfolder of a clone, it serves the clone's code location (not the installed kb's), with no
    "dagster.yaml will not be used" warning, and Ctrl-C leaves nothing of it running. Its output goes to a file,
    not a pipe that a process left behind would hold open."""
    import signal
    import time
    import urllib.request

    with (fresh_clone / "assets" / "definitions.py").open("a") as definitions:
        definitions.write('\nprint("kb code location from", __file__, flush=True)\n')
    port, log = free_port(), tmp_path / "dev.log"
    with log.open("w") as output:
        dev = subprocess.Popen([KB, "dagster", "dev", "--port", str(port)], cwd=fresh_clone / "docs", stdout=output,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:  # until the UI answers (it logs "Serving" just before it binds the port)
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=30)
                break
            except OSError:
                assert dev.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.5)
        dev.send_signal(signal.SIGINT)
        assert dev.wait(timeout=120) == 0, log.read_text()
    finally:
        dev.kill()
        leftover = left_running(settings.home)
    output = log.read_text()
    assert f"kb code location from {fresh_clone / 'assets' / 'definitions.py'}" in output
    assert "will not be used" not in output
    assert leftover == []


def test_an_openai_endpoint_that_is_not_configured_or_not_listening_fails_at_once(settings, tmp_path):
    """Named before any request, so the client's retries (about 24 s, then `Connection error.`) never start."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    one_error_line(kb("ingest", str(small_folder(tmp_path)), "--public", env={**env, "KB_EMBEDDER": "openai"}),
                   "KB_EMBEDDER=openai needs an OpenAI-compatible endpoint", "OPENAI_API_KEY", "OPENAI_BASE_URL")
    dead = f"http://127.0.0.1:{free_port()}/v1"
    one_error_line(kb("serve", "--port", str(free_port()), env={**env, "KB_CHAT_MODEL": "gpt-x", "OPENAI_BASE_URL": dead}),
                   f"KB_CHAT_MODEL=gpt-x: cannot reach {dead}", "OPENAI_BASE_URL")


def test_cite_checks_kb_ask_output_and_refuses_what_is_not_an_answer(settings, tmp_path):
    assert kb("ingest", str(small_folder(tmp_path)), "--public").returncode == 0
    asked = kb("ask", "How many weeks of paid leave does a primary caregiver get?", "--json")
    assert asked.returncode == 0, asked.stderr
    assert json.loads(asked.stdout)["sentences"], asked.stdout
    checked = kb("cite", "--strict", "-", stdin=asked.stdout)
    assert checked.returncode == 0 and re.match(r"VALID +chunk \d+: ", checked.stdout), checked.stdout
    for not_an_answer in ('{"foo": 1}', "[]", '{"sentences": [{"text": "x", "citations": ["seven"]}], "contexts": []}'):
        one_error_line(kb("cite", "--strict", "-", stdin=not_an_answer), "<stdin>: not an answer to check")
    nothing = kb("cite", "--strict", "-", stdin='{"claims": [], "retrieved": []}')
    assert nothing.returncode == 0 and "no citations to check" in nothing.stdout


def test_search_names_an_unknown_source_or_group_and_says_what_it_leaves_out(settings, tmp_path):
    assert kb("ingest", str(small_folder(tmp_path)), "--group", "hr").returncode == 0
    assert kb("ingest", str(records(tmp_path)), "--public").returncode == 0
    one_error_line(kb("search", "printer", "--source-id", "nosuch"), "no source 'nosuch' is declared")
    one_error_line(kb("search", "printer", "--group", "hrr"), "no declared source is readable by group 'hrr'",
                   "groups in use: hr")
    one_error_line(kb("ask", "leave", "--source-id", "small"), "source 'small' is readable by groups hr only",
                   "--group hr")
    public = kb("search", "printer duplex")
    assert public.returncode == 0 and "tickets:" in public.stdout
    assert "note: reading as a public caller, so 1 source is left out: small (groups hr)" in public.stderr
    member = kb("search", "parental leave", "--group", "hr")
    assert member.returncode == 0 and "small:" in member.stdout and "note:" not in member.stderr


def test_a_config_file_with_an_unknown_table_is_refused(settings, tmp_path):
    config = tmp_path / "kb.toml"
    config.write_text('[source.handbook]\nlocation = "."\npublic = true\n')
    one_error_line(kb("source", "apply", str(config)), "unknown table [source]", "[sources.NAME]")
    config.write_text("# nothing yet\n")
    one_error_line(kb("source", "apply", str(config)), "declares no source")


def test_files_of_types_kb_does_not_read_are_skipped_and_listed_not_failed(settings, tmp_path):
    folder = small_folder(tmp_path)
    (folder / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n....")
    (folder / "firmware.bin").write_bytes(b"\x00\x01" * 50)
    out = kb("ingest", str(folder), "--public")
    assert out.returncode == 0, out.stdout
    assert ("skipped 2 files of types kb does not read: small:firmware.bin, small:photo.png; exclude them, or"
            " KB_UNSUPPORTED_FILES=fail to fail them") in out.stdout
    assert re.search(r"^documents: 2 seen \(2 new, 0 changed, 0 unchanged\), 2 published, 0 deleted, 0 failed$",
                     out.stdout, re.M), out.stdout
    assert re.search(r"^chunks: \d+ added, 0 updated, 0 closed; \d+ embedded, 0 reused; \d+ Q&A cards?$", out.stdout, re.M)
    data = json.loads(kb("ingest", "--json").stdout)
    assert data["documents_skipped"] == 2 and data["skipped"] == [
        {"source": "small", "file": "firmware.bin", "reason": "unsupported file type .bin"},
        {"source": "small", "file": "photo.png", "reason": "unsupported file type .png"}]
    strict = kb("ingest", env={**os.environ, "KB_UNSUPPORTED_FILES": "fail"})
    assert strict.returncode == 3 and "ERROR small:photo.png:" in strict.stdout and "skipped" not in strict.stdout
    one_error_line(kb("ingest", env={**os.environ, "KB_UNSUPPORTED_FILES": "ignore"}), "KB_UNSUPPORTED_FILES", "skip")


def test_text_output_reads_as_written_not_as_python(settings, tmp_path):
    """No Python reprs, no "1 documents", no microseconds in text output."""
    folder = tmp_path / "one"
    (folder / "drafts").mkdir(parents=True)
    shutil.copy(SAMPLES_DIR / "docs" / "handbook" / "leave-policy.md", folder)
    added = kb("source", "add", "one", str(folder), "--exclude", "drafts/*", "--group", "hr", "--group", "legal")
    assert added.returncode == 0, added.stderr
    assert added.stdout.rstrip().endswith("readable by groups hr, legal; exclude drafts/*"), added.stdout
    assert kb("source", "update", "one", "--group", "legal").returncode == 0
    shown = kb("source", "show", "one").stdout
    assert "groups hr, legal -> legal" in shown and "[" not in shown and "'" not in shown, shown
    assert re.search(rf"^  {ISO} update by ", shown, re.M), shown
    assert kb("keys", "create", "bot", "--group", "legal").returncode == 0
    assert re.search(rf"; created {ISO} by ", kb("keys", "list").stdout)
    assert kb("ingest", "--source", "one").returncode == 0
    status = kb("status").stdout
    assert re.search(r"\(folder .*; readable by groups legal\): 1 document, \d+ chunks,", status), status
    removed = kb("source", "remove", "one").stdout
    assert removed.strip() == "removed one: 1 document soft-deleted"


def test_searching_an_empty_knowledge_base_says_what_to_run(settings):
    for command in (["search", "leave"], ["ask", "How long is parental leave?"]):
        one_error_line(kb(*command), "the knowledge base is empty: run `kb ingest` first")


def test_ingest_with_a_kb_toml_not_yet_applied_says_to_apply_it(settings, tmp_path):
    (tmp_path / "kb.toml").write_text('[sources.notes]\nlocation = "."\npublic = true\n')
    one_error_line(kb("ingest", cwd=tmp_path), f"{tmp_path}/kb.toml is not applied yet: run `kb source apply`")
