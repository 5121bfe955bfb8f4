"""The suite's hermetic rule (tests/conftest.py `hermetic`): every default the sidecar
resolves lies under the test's own temp dir, and nothing of the caller's environment leaks."""

import os
import subprocess
import sys

from sidecar.config import Config, load
from sidecar.context import build_tiers
from tests.conftest import HERMETIC_DIRS

REAL_HOME = os.path.expanduser("~" + __import__("pwd").getpwuid(os.getuid()).pw_name)


def _under(path: str, top: str) -> bool:
    return os.path.commonpath([os.path.realpath(path), os.path.realpath(top)]) == os.path.realpath(
        top
    )


def test_the_fixture_points_every_default_at_a_temp_dir(hermetic):
    for var in HERMETIC_DIRS:
        assert _under(os.environ[var], hermetic), var
    assert not [v for v in os.environ if v.startswith("SIDECAR_")]
    for config in (Config(), load(None)):
        assert _under(config.data_dir, hermetic) and _under(config.socket, hermetic)
        assert config.token is None
        assert not _under(config.data_dir, REAL_HOME) and not config.socket.startswith("/run/")


def test_a_child_process_resolves_the_same_defaults(hermetic):
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from sidecar.config import Config; c = Config(); print(c.data_dir); print(c.socket)",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(_under(p, hermetic) for p in out), out


def test_tiers_build_on_the_default_data_dir_before_it_exists(hermetic):
    """A fresh machine has no data dir yet: sizing the file tier looks at the file system
    it will be made on (the nearest existing parent), and creates nothing."""
    config = load(None, env={})
    assert not os.path.exists(config.data_dir)
    tiers = build_tiers(config)
    assert [t.name for t in tiers] == ["file"] and tiers[0].capacity > 0
