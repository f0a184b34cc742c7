"""Shared fixtures: one real PostgreSQL (embedded, or DATABASE_URL's server) with a fresh database per test,
the real local embedding model loaded once, and Dagster pointed at a temporary home.

No test reads or writes state it did not create. The session runs with none of the developer's settings (`make
test` itself exports KB_HOME=./.kb, the demo's knowledge base) and with HOME, KB_HOME and each test's working
directory in temporary folders, so nothing finds ./.kb, ./kb.toml or ~/.local/share/kb. A tripwire checks that
each test (and the session's own fixtures) left the repository's files and its ./.kb as they were."""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from pipelines.settings import REPO_ROOT, SAMPLES_DIR, Settings, load_settings
from pipelines.storage.database import connect, database_url

# Settings that point kb, Dagster or the OpenAI client at a developer's own state or services.
DEVELOPER_SETTINGS = ("KB_", "OPENAI_", "XDG_", "DATABASE_URL", "DAGSTER_HOME")
GIVEN_DATABASE_URL = pytest.StashKey[str | None]()
USER_ENVIRONMENT = pytest.StashKey[dict]()  # as the developer started pytest: git's view of the repository


def pytest_configure(config: pytest.Config) -> None:
    """Drop the developer's settings before any test module is imported (some read the environment at import).
    DATABASE_URL is kept aside: tests create their own databases on that server (`server_url`)."""
    config.stash[USER_ENVIRONMENT] = dict(os.environ)
    config.stash[GIVEN_DATABASE_URL] = os.environ.get("DATABASE_URL")
    for name in [name for name in os.environ if name.startswith(DEVELOPER_SETTINGS)]:
        del os.environ[name]


@pytest.fixture(scope="session", autouse=True)
def session_home(tmp_path_factory) -> Iterator[Path]:
    """HOME and KB_HOME in temporary folders for the whole session (a test's `settings` gives it its own KB_HOME)."""
    home = tmp_path_factory.mktemp("kb_home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(tmp_path_factory.mktemp("home")))
        patch.setenv("KB_HOME", str(home))
        patch.setenv("KB_MODEL_CACHE", str(home / "models"))  # one ONNX export for the whole session
        yield home


@pytest.fixture(autouse=True)
def own_working_directory(tmp_path_factory, monkeypatch) -> None:
    """Each test starts in an empty folder of its own: walking up from it finds no .kb, it holds no kb.toml, and a
    relative path a test writes lands there, not in the repository."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


def repository_files(environment: dict) -> list[str]:
    """The repository's files as a clone of the working tree would hold them: tracked or not yet tracked, uncommitted
    changes included, nothing git ignores (no .venv, no .kb)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                                env=environment, capture_output=True, check=True, timeout=60).stdout.decode()
    except (OSError, subprocess.CalledProcessError):  # no git, or an unpacked archive rather than a checkout
        return _files_not_ignored()
    return [name for name in listed.split("\0") if name and (REPO_ROOT / name).is_file()]


def _files_not_ignored() -> list[str]:
    """Every file below the repository root but .git and what .gitignore names (each line a name, a glob or a
    folder path, as kb's .gitignore writes them)."""
    ignored = [line.strip().strip("/") for line in (REPO_ROOT / ".gitignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")] + [".git"]

    def kept(relative: Path) -> bool:
        return not any(fnmatch.fnmatch(part, pattern) for part in relative.parts for pattern in ignored) and not any(
            relative.as_posix().startswith(pattern + "/") for pattern in ignored)

    files = []
    for folder, subfolders, names in os.walk(REPO_ROOT):  # never into an ignored folder (a .venv is 2.7 GB)
        here = Path(folder).relative_to(REPO_ROOT)
        subfolders[:] = [name for name in subfolders if kept(here / name)]
        files += [(here / name).as_posix() for name in names if kept(here / name)]
    return sorted(files)


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_size, stat.st_mtime_ns


def _repository_state(environment: dict) -> dict[str, tuple | None]:
    """Size and modification time of every repository file and of everything in ./.kb. Inside ./.kb/pgdata, names
    only: a server the developer runs there (`make dev`) rewrites its files by itself."""
    state = {name: _stamp(REPO_ROOT / name) for name in repository_files(environment)}
    kb_home = REPO_ROOT / ".kb"
    for folder, subfolders, files in os.walk(kb_home):
        here = Path(folder)
        state[str(here.relative_to(REPO_ROOT))] = None  # an empty folder counts
        if here == kb_home / "pgdata":
            state.update({str(here.relative_to(REPO_ROOT) / name): None for name in subfolders + files})
            subfolders.clear()
        else:
            state.update({str(here.relative_to(REPO_ROOT) / name): _stamp(here / name) for name in files})
    return state


def _changes(before: dict, after: dict) -> set[str]:
    return {name for name in before.keys() | after.keys() if before.get(name, 0) != after.get(name, 0)}


def _fail_on(changed: set[str], who: str) -> None:
    if changed:
        shown = sorted(changed)
        pytest.fail(f"{who} changed the repository (under {REPO_ROOT}): {', '.join(shown[:20])}"
                    f"{' ...' if len(shown) > 20 else ''}. A test writes only under its tmp_path; if a process of"
                    " your own (an editor, `make dev`, `kb serve` on ./.kb) changed them during the run, run again.",
                    pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def repository_untouched_by_the_session(pytestconfig) -> Iterator[set[str]]:
    """The tripwire for session fixtures (the embedded server, the model) and for anything between tests. Yields the
    names already reported against a test, so that each change is reported once."""
    environment = pytestconfig.stash[USER_ENVIRONMENT]
    before, reported = _repository_state(environment), set()
    yield reported
    _fail_on(_changes(before, _repository_state(environment)) - reported, "the test session, outside any test,")


@pytest.fixture(autouse=True)
def repository_untouched(pytestconfig, repository_untouched_by_the_session) -> Iterator[None]:
    """The tripwire for each test: a test that wrote into the repository or its ./.kb fails, by name."""
    environment = pytestconfig.stash[USER_ENVIRONMENT]
    before = _repository_state(environment)
    yield
    changed = _changes(before, _repository_state(environment))
    repository_untouched_by_the_session.update(changed)
    _fail_on(changed, "this test")


@pytest.fixture(scope="session")
def server_url(pytestconfig, session_home) -> str:
    """The server the tests create their databases on: the developer's DATABASE_URL if set, else an embedded one in
    the session's KB_HOME."""
    given = pytestconfig.stash[GIVEN_DATABASE_URL]
    return database_url(load_settings({"DATABASE_URL": given} if given else None))


def _url_with_db(url: str, dbname: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(url)
    info["dbname"] = dbname
    return psycopg.conninfo.make_conninfo(**info)


@pytest.fixture
def settings(server_url, tmp_path, monkeypatch) -> Settings:
    """Settings on a brand-new database; also exported to the environment for CLI and Dagster code paths."""
    dbname = f"kb_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    url = _url_with_db(server_url, dbname)
    monkeypatch.setenv("DATABASE_URL", url)
    monkeypatch.setenv("KB_HOME", str(tmp_path / "kb"))
    monkeypatch.delenv("KB_CONFIG", raising=False)
    monkeypatch.delenv("DAGSTER_HOME", raising=False)  # never touch a developer's Dagster instance
    yield load_settings()
    with psycopg.connect(server_url, autocommit=True) as admin:
        for name in (dbname, f"{dbname}_dagster"):  # and the Dagster instance's, if a test made one
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def conn(settings):
    with connect(settings) as connection:
        yield connection


@pytest.fixture(scope="session")
def embedder(server_url):
    from pipelines.models.embedders import make_embedder

    return make_embedder(load_settings())  # the default: int8 ONNX, cached under KB_MODEL_CACHE


@pytest.fixture
def samples_copy(tmp_path) -> Path:
    """A private copy of the sample folder that a test may edit."""
    target = tmp_path / "docs"
    shutil.copytree(SAMPLES_DIR / "docs", target)
    return target


@pytest.fixture
def fresh_clone(tmp_path, pytestconfig) -> Path:
    """A fresh clone of the repository under test, in tmp_path/clone: the files `repository_files` lists (so a
    suite run on uncommitted changes clones them too), and nothing beside them, such as a ./.kb from `make demo`."""
    clone = tmp_path / "clone"
    for name in repository_files(pytestconfig.stash[USER_ENVIRONMENT]):
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, clone / name)
    return clone


@pytest.fixture
def instance(tmp_path):
    """A throwaway Dagster instance (DAGSTER_HOME points at it while the test runs)."""
    import dagster as dg

    home = tmp_path / "dagster"
    home.mkdir()
    with dg.instance_for_test(temp_dir=str(home)) as test_instance:
        yield test_instance

