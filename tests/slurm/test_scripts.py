"""scripts/slurm/up.sh on a machine without the packages, run against fake commands in a private mount namespace."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from tests.conftest import REPO
from tests.slurm.conftest import _unavailable

FAKES = {
    # Nothing is installed; the install creates user munge (the marker file stands for it).
    "dpkg-query": "exit 1",
    "apt-get": 'touch "$FAKE_DIR/munge-user"',
    "id": '[ "$1" = munge ] || exec /usr/bin/id "$@"\n[ -e "$FAKE_DIR/munge-user" ] && echo "uid=101(munge)"',
    # User munge cannot enter the private parent; starting munged records how it was started and fails.
    "setpriv": 'case " $* " in *" test -x "*) exit 1 ;; esac\nprintf "%s\\n" "$@" >"$FAKE_DIR/munged.args"\nexit 1',
    "mungekey": 'for a; do :; done; : >"$a"',
    "chown": "exit 0",
    "ip": "exit 1",
}
STUBS = "munged munge unmunge mariadbd mariadb-install-db mariadb slurmdbd slurmctld slurmd sacctmgr sinfo sacct"


def _fake_bin(fake_dir: Path) -> Path:
    bin_dir = fake_dir / "bin"
    bin_dir.mkdir(parents=True)
    for name, body in {**FAKES, **dict.fromkeys(STUBS.split(), "exit 1")}.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def test_munged_files_are_placed_after_the_install_has_created_user_munge(tmp_path):
    """A first `make slurm-up` from a checkout under a 0700 directory put munged's files where munge cannot go."""
    if os.geteuid() != 0:
        _unavailable("scripts/slurm/up.sh needs root")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    fake_dir = tmp_path / "fake"
    bin_dir = _fake_bin(fake_dir)
    hosts = tmp_path / "hosts"
    hosts.write_text(Path("/etc/hosts").read_text())
    # /etc/hosts and /run are private copies: nothing the script writes there reaches the machine.
    sandbox = 'mount --bind "$0" /etc/hosts && mount -t tmpfs tmpfs /run && exec bash "$1"'
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", sandbox, hosts, REPO / "scripts/slurm/up.sh"],
        env={
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "FAKE_DIR": str(fake_dir),
            "TULA_SLURM_DIR": str(private / "state"),
            "TULA_SLURM_NODES": "0",
            "TULA_SLURM_UP_TIMEOUT": "5",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (fake_dir / "munge-user").exists(), proc.stdout + proc.stderr
    args = (fake_dir / "munged.args").read_text()
    key_file = re.search(r"--key-file=(\S+)", args).group(1)
    assert not key_file.startswith(str(private)), f"munged's key {key_file} lies under a directory munge cannot enter"


def _up_as_site(tmp_path: Path, site: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TULA_SLURM_SITE": site, "TULA_SLURM_DIR": str(tmp_path / "state")}
    return subprocess.run(["bash", REPO / "scripts/slurm/up.sh"], env=env, capture_output=True, text=True, timeout=60)


def test_an_unknown_site_profile_is_refused_naming_the_profiles_before_anything_is_touched(tmp_path):
    """Checked before root is asked for: no package, namespace, /etc/hosts line or state directory is made."""
    for site in ("lax", "../sites/strict", ""):
        proc = _up_as_site(tmp_path, site or " ")
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert f"unknown site profile '{site or ' '}'" in proc.stderr
        assert "one of permissive, strict" in proc.stderr
    assert not (tmp_path / "state").exists()


def test_every_site_profile_sets_what_the_permissive_one_sets():
    """up.sh renders the templates from these names: a profile that leaves one out would keep another's value."""

    def settings(site: str) -> set[str]:
        script = f"source {REPO}/scripts/slurm/common.sh && SITE={site} && load_site && compgen -v SITE_"
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
        return set(out.split())

    profiles = sorted(path.stem for path in (REPO / "scripts/slurm/sites").glob("*.sh"))
    assert profiles == ["permissive", "strict"]
    assert len(settings("permissive")) >= 10
    for site in profiles:
        assert settings(site) == settings("permissive"), site
