"""A throwaway PostgreSQL server for the tests of studies that launches share through it.

It runs Debian's `postgresql` package (initdb and pg_ctl on PATH or in
/usr/lib/postgresql/<version>/bin) on a Unix socket in a temporary folder, with no TCP port, and
as the unprivileged `postgres` user where the tests run as root, which PostgreSQL refuses. Each
test gets a new database. Without the binaries or the psycopg driver the tests that need the
server are skipped, with the reason.
"""

import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SERVER_USER = "postgres"


def postgres_binary(name: str) -> str | None:
    """`name` on PATH, else in the newest of Debian's /usr/lib/postgresql/<version>/bin."""
    found = shutil.which(name)
    if found:
        return found
    installed = glob.glob(f"/usr/lib/postgresql/*/bin/{name}")
    return max(installed, key=lambda path: int(Path(path).parts[-3]), default=None)


def server_user() -> pwd.struct_passwd | None:
    """The user to run the server as: `postgres` when the tests run as root, else nobody else."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(SERVER_USER)
    except KeyError:
        pytest.skip(f"the tests run as root, which PostgreSQL refuses, and no {SERVER_USER} user")


class Server:
    """The commands of one PostgreSQL server whose data, log and socket are in `folder`."""

    def __init__(self, folder: Path, user: pwd.struct_passwd | None):
        self.folder = folder
        self.as_user: dict[str, Any] = {}
        if user is not None:
            self.as_user = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
            os.chown(folder, user.pw_uid, user.pw_gid)

    def run(self, *command: str) -> None:
        done = subprocess.run(
            command, cwd=self.folder, capture_output=True, text=True, timeout=120, **self.as_user
        )
        if done.returncode != 0:
            log = self.folder / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            pytest.fail(f"{' '.join(command)} exited with {done.returncode}:\n{done.stderr}{tail}")

    def start(self, initdb: str, pg_ctl: str) -> None:
        data = str(self.folder / "data")
        self.run(initdb, "-D", data, "-A", "trust", "-U", SERVER_USER, "-E", "UTF8",
                 "--locale=C", "--no-sync")  # fmt: skip
        # No TCP (listen_addresses empty), the socket in the folder, no fsync: throwaway data.
        options = f"-k {self.folder} -c listen_addresses='' -F"
        self.run(pg_ctl, "-D", data, "-l", str(self.folder / "server.log"), "-o", options,
                 "-w", "-t", "60", "start")  # fmt: skip

    def stop(self, pg_ctl: str) -> None:
        """Stop the server, if it started."""
        if (self.folder / "data" / "postmaster.pid").exists():
            self.run(pg_ctl, "-D", str(self.folder / "data"), "-m", "fast", "-w", "stop")

    def new_database(self, name: str) -> str:
        """A new, empty database; its URL."""
        import psycopg

        with psycopg.connect(dbname="postgres", user=SERVER_USER, host=str(self.folder)) as db:
            db.autocommit = True
            db.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://{SERVER_USER}@/{name}?host={self.folder}"


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Server]:
    """A PostgreSQL server for this test session, stopped and removed when it ends."""
    initdb, pg_ctl = postgres_binary("initdb"), postgres_binary("pg_ctl")
    if initdb is None or pg_ctl is None:
        pytest.skip("PostgreSQL's initdb and pg_ctl are not installed (apt-get install postgresql)")
    pytest.importorskip("psycopg", reason='the PostgreSQL driver: pip install "psycopg[binary]"')
    # In /tmp, not pytest's tmp_path: the server's user must reach it, and a socket's path is
    # limited to about 100 characters.
    folder = Path(tempfile.mkdtemp(prefix="postgres-"))
    try:
        server = Server(folder, server_user())
        try:
            server.start(initdb, pg_ctl)
            yield server
        finally:
            server.stop(pg_ctl)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


_databases = itertools.count()


@pytest.fixture
def postgres_url(postgres_server: Server) -> str:
    """The SQLAlchemy URL of a new database on the session's PostgreSQL server."""
    return postgres_server.new_database(f"test_{next(_databases)}")
