"""Where offspec keeps its files: the same places as before platformdirs, every override honoured."""

import sys

import pytest

from offspec.util import paths

VARS = ("OFFSPEC_CACHE_DIR", "OFFSPEC_CONFIG_DIR", "OFFSPEC_DATA_DIR", "OFFSPEC_KERNELS_DIR", "XDG_CACHE_HOME",
        "XDG_CONFIG_HOME", "XDG_DATA_HOME")


@pytest.fixture
def home(tmp_path, monkeypatch):
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


@pytest.mark.skipif(sys.platform != "linux", reason="the XDG defaults are Linux's (platformdirs elsewhere)")
def test_linux_defaults_are_the_xdg_directories(home):
    assert paths.cache_dir() == home / ".cache" / "offspec"
    assert paths.config_dir() == home / ".config" / "offspec"
    assert paths.data_dir() == home / ".local" / "share" / "offspec"
    assert paths.kernels_dir() == home / ".cache" / "offspec" / "kernels"


@pytest.mark.skipif(sys.platform != "linux", reason="the XDG variables are Linux's (platformdirs elsewhere)")
def test_xdg_variables_are_honoured(home, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "c"))
    monkeypatch.setenv("XDG_CONFIG_HOME", "~/cfg")  # "~" expanded, as before
    monkeypatch.setenv("XDG_DATA_HOME", str(home / "d"))
    assert paths.cache_dir() == home / "c" / "offspec"
    assert paths.config_dir() == home / "cfg" / "offspec"
    assert paths.data_dir() == home / "d" / "offspec"


def test_offspec_variables_override_everything(home, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "c"))
    monkeypatch.setenv("OFFSPEC_CACHE_DIR", "~/mine")
    monkeypatch.setenv("OFFSPEC_CONFIG_DIR", str(home / "conf"))
    monkeypatch.setenv("OFFSPEC_DATA_DIR", str(home / "data"))
    assert paths.cache_dir() == home / "mine"
    assert paths.kernels_dir() == home / "mine" / "kernels"
    assert paths.config_dir() == home / "conf"
    assert paths.data_dir() == home / "data"
    monkeypatch.setenv("OFFSPEC_KERNELS_DIR", str(home / "k"))
    assert paths.kernels_dir() == home / "k"


def test_an_existing_xdg_directory_is_kept_where_the_system_has_its_own(home, monkeypatch):
    # macOS / Windows: platformdirs names other places; a cache offspec made earlier in ~/.cache stays in use
    monkeypatch.setattr(paths.platformdirs, "user_cache_dir", lambda app, appauthor: str(home / "Library" / app))
    assert paths.cache_dir() == home / "Library" / "offspec"  # nothing earlier: the system's place
    (home / ".cache" / "offspec").mkdir(parents=True)
    assert paths.cache_dir() == home / ".cache" / "offspec"
    (home / "Library" / "offspec").mkdir(parents=True)
    assert paths.cache_dir() == home / "Library" / "offspec"  # both: the system's own
