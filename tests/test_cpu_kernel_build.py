"""Where the CPU kernels' library comes from (jaxserve/backends/cpu/build.py): the install's build
when it carries the current key, else the cache's, built there on first use. The compiler is
stubbed out (a real build is tests/test_cpu_kernels.py's and the install's)."""

from __future__ import annotations

import shutil

import pytest

from jaxserve.backends.cpu import build


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """An empty install directory and cache; `built` lists the paths the stubbed build wrote."""
    installed = tmp_path / "package" / "built"
    monkeypatch.setattr(build, "INSTALL_DIR", installed)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    built = []

    def fake_build(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"library")
        built.append(path)

    monkeypatch.setattr(build, "build", fake_build)
    return installed, built


def test_the_install_build_is_used_when_current(dirs):
    installed, built = dirs
    installed.mkdir(parents=True)
    (installed / build.library_name()).write_bytes(b"installed")
    assert build.library() == installed / build.library_name()
    assert built == []


def test_a_missing_or_stale_install_build_falls_back_to_the_cache(dirs):
    installed, built = dirs
    cached = build.cache_dir() / build.library_name()
    assert build.library() == cached  # nothing installed: built on first use
    assert built == [cached]
    installed.mkdir(parents=True)
    (installed / "cpu_kernels-0123456789abcdef.so").write_bytes(b"old sources")
    assert build.library() == cached  # the install's build is of other sources: not used
    assert built == [cached]  # the cache's is current: not built again


def test_install_build_reuses_the_current_build_and_removes_older_ones(dirs):
    installed, built = dirs
    installed.mkdir(parents=True)
    old = installed / "cpu_kernels-0123456789abcdef.so"
    old.write_bytes(b"old sources")
    path = build.install_build(installed)
    assert path == installed / build.library_name() and built == [path]
    assert not old.exists()
    assert build.install_build(installed) == path and built == [path]


def test_the_key_follows_the_sources(tmp_path, monkeypatch):
    copies = []
    for source in build.SOURCES:
        copies.append(tmp_path / source.name)
        shutil.copy(source, copies[-1])
    monkeypatch.setattr(build, "SOURCES", tuple(copies))
    name = build.library_name()
    assert name.startswith("cpu_kernels-") and name.endswith(".so")
    copies[0].write_text(copies[0].read_text() + "\n// edited\n")
    assert build.library_name() != name
