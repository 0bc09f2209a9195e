"""Open the Optuna storage a `hydra.sweeper.storage` URL names, for the sweeper and each trial.

The sweeper and each trial's pruning callback open it the same way, so it lives below both:

- an SQLAlchemy URL names a database: `sqlite:///logs/optuna.db` (one machine),
  `postgresql://user:password@host/db` (many machines; needs the psycopg driver);
- `journal:///logs/optuna.log` names Optuna's journal file, an append-only log that launches on
  machines sharing a filesystem write in turn, with no server. As in SQLite's URLs, the path
  follows the three slashes: `journal:////scratch/optuna.log` is absolute.
"""

import random
import time
import warnings
from pathlib import Path

import optuna
import sqlalchemy.exc
from optuna.storages.journal import JournalFileBackend, JournalStorage
from sqlalchemy.engine import URL, make_url

from src.utils.errors import ConfigError, first_line

# Optuna calls heartbeats experimental (since 2.9) and meant for study.optimize; the sweeper
# records them itself, for the trials its jobs run (src/run/search/heartbeat.py).
for message in (
    "Argument ``heartbeat_interval`` is an experimental feature",
    ".*fail_stale_trials is experimental",
    "Heartbeat of storage is supposed to be used with Study.optimize",
):
    warnings.filterwarnings("ignore", message=message)

JOURNAL = "journal:///"
# The pip package of each database driver that SQLAlchemy imports for a URL.
DRIVER_PACKAGES = {
    "psycopg": "psycopg[binary]",
    "psycopg2": "psycopg2-binary",
    "pymysql": "PyMySQL",
    "MySQLdb": "mysqlclient",
}
# Launches that open a new database at once race to create Optuna's tables: the losers fail,
# then find the winner's tables on a later try.
SCHEMA_TRIES = 5


def open_storage(
    url: str, heartbeat_interval: int | None = None, grace_period: int | None = None
) -> optuna.storages.BaseStorage:
    """The storage `url` names, its database tables or journal file created when missing.

    A database records trials' heartbeats every `heartbeat_interval` seconds when given (a
    trial silent for `grace_period`, by default twice that, is stale); a journal file keeps none.
    """
    if url.startswith(JOURNAL):
        return journal_storage(Path(url.removeprefix(JOURNAL)))
    heartbeat = {"heartbeat_interval": heartbeat_interval, "grace_period": grace_period}
    return database_storage(url, heartbeat)


def journal_storage(path: Path) -> JournalStorage:
    path.parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(path)))


def database_storage(url: str, heartbeat: dict | None = None) -> optuna.storages.RDBStorage:
    """Optuna's tables in the database `url`, created when it holds none."""
    parsed = parse_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)  # SQLite makes no folder
    for _ in range(SCHEMA_TRIES - 1):
        try:
            return rdb_storage(url, parsed, heartbeat or {})
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
            time.sleep(random.uniform(0.1, 0.5))
    return rdb_storage(url, parsed, heartbeat or {})


def rdb_storage(url: str, parsed: URL, heartbeat: dict) -> optuna.storages.RDBStorage:
    url_shown = parsed.render_as_string(hide_password=True)
    try:
        # Checked before use, as Optuna does for MySQL: a trial can run for longer than a server
        # or the network keeps an idle connection open.
        return optuna.storages.RDBStorage(url, engine_kwargs={"pool_pre_ping": True}, **heartbeat)
    except ImportError as error:
        raise missing_driver(url_shown, error) from error
    except sqlalchemy.exc.OperationalError as error:
        raise unreachable(url_shown, parsed, error) from error


def parse_url(url: str) -> URL:
    """The SQLAlchemy URL `url`, of a database SQLAlchemy knows."""
    try:
        parsed = make_url(url)
        parsed.get_dialect()  # imports no driver yet: only SQLAlchemy's code for the database
        return parsed
    # Unparsable (a port that is no number: ValueError), or a database SQLAlchemy does not know.
    except (sqlalchemy.exc.ArgumentError, ValueError):
        raise ConfigError(
            f"hydra.sweeper.storage={url!r} is no storage URL: give an SQLAlchemy URL "
            f"(sqlite:///logs/optuna.db, postgresql://user@host/db) or {JOURNAL}<path>.log."
        ) from None


def missing_driver(url_shown: str, error: ImportError) -> ConfigError:
    """The error for a database whose driver is not installed, with the package to install."""
    module = getattr(error.__cause__, "name", None) or "its driver"
    package = DRIVER_PACKAGES.get(module, module)
    return ConfigError(
        f"hydra.sweeper.storage={url_shown} needs the database driver {module}, which is not "
        f'installed: pip install "{package}".'
    )


def unreachable(url_shown: str, url: URL, error: sqlalchemy.exc.OperationalError) -> ConfigError:
    reason = first_line(error.orig or error)
    check = (
        "that its folder exists and is writable"
        if url.get_backend_name() == "sqlite"
        else "that the server runs and takes the URL's host, port, user, password and database"
    )
    return ConfigError(
        f"hydra.sweeper.storage={url_shown} cannot be opened ({reason}): check {check}."
    )


def shown(url: str | None) -> str | None:
    """`url` as logs and messages show it, with a database's password hidden."""
    if url is None or url.startswith(JOURNAL):
        return url
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        return url
