"""Project-local state: the registry's default database and the site-data cache live in the
project's .hfleet/ folder, never in the user's home."""

from __future__ import annotations

from pathlib import Path

from hybridfleet.data.cache import default_cache_dir
from hybridfleet.paths import project_dir, state_dir
from hybridfleet.registry.db import default_db_url


def test_state_lives_in_the_nearest_project_folder_not_in_home(tmp_path, monkeypatch):
    # Prepare: a project (it has pyproject.toml) with a nested working folder, and a fake home
    project = tmp_path / "clone"
    (project / "examples" / "deep").mkdir(parents=True)
    (project / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HFLEET_REGISTRY", raising=False)
    monkeypatch.delenv("HFLEET_DATA_CACHE", raising=False)
    monkeypatch.delenv("HFLEET_PROJECT_DIR", raising=False)
    monkeypatch.chdir(project / "examples" / "deep")
    # Execute / Assert
    assert project_dir() == project.resolve()
    assert default_db_url() == f"sqlite:///{project.resolve() / '.hfleet' / 'registry' / 'registry.db'}"
    assert default_cache_dir() == project.resolve() / ".hfleet" / "cache" / "data"
    assert not (tmp_path / "home").exists()


def test_two_clones_get_two_registries_and_the_env_overrides(tmp_path, monkeypatch):
    monkeypatch.delenv("HFLEET_REGISTRY", raising=False)
    monkeypatch.delenv("HFLEET_PROJECT_DIR", raising=False)
    for name in ("a", "b"):
        (tmp_path / name / ".git").mkdir(parents=True)
    assert state_dir(tmp_path / "a") != state_dir(tmp_path / "b")
    monkeypatch.setenv("HFLEET_PROJECT_DIR", str(tmp_path / "elsewhere"))
    assert state_dir(tmp_path / "a") == (tmp_path / "elsewhere" / ".hfleet").resolve()
    monkeypatch.setenv("HFLEET_REGISTRY", str(tmp_path / "reg.db"))
    assert default_db_url() == str(tmp_path / "reg.db")


def test_make_clean_removes_the_project_state():
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    clean = makefile.split("clean:", 1)[1].splitlines()[1]
    assert ".hfleet" in clean.split()
