"""ci/releases/wheels.py: a release's wheel from its sdist, built in a child of the zygote."""
import hashlib
import io
import tarfile
import zipfile

import pytest

from ci.releases import wheels


def _sdist(tmp_path, setup_py: str, release: str = "9.9.9"):
    path = tmp_path / f"deepspeed-{release}.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        data = setup_py.encode()
        info = tarfile.TarInfo(f"deepspeed-{release}/setup.py")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    return path


def test_when_the_index_lists_no_sdist_of_the_release_then_a_wheel_error_names_it(monkeypatch):
    monkeypatch.setattr(wheels, "_files", {"deepspeed-0.18.2.tar.gz": {}})
    with pytest.raises(wheels.WheelError, match="lists no deepspeed-0.17.99.tar.gz"):
        wheels.sdist_file("0.17.99")


def test_when_the_download_is_not_the_indexs_file_then_nothing_is_written(tmp_path, monkeypatch):
    entry = {"filename": "deepspeed-0.18.2.tar.gz", "url": "https://files.example/deepspeed-0.18.2.tar.gz",
             "hashes": {"sha256": hashlib.sha256(b"the real sdist").hexdigest()}}
    monkeypatch.setattr(wheels, "_files", {entry["filename"]: entry})
    monkeypatch.setattr(wheels.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(b"something else"))
    with pytest.raises(wheels.WheelError, match="sha256 is not the index's"):
        wheels.download_sdist("0.18.2", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_when_the_sdist_builds_then_its_wheel_is_returned_built_with_the_given_environment(tmp_path, monkeypatch):
    setup_py = ("import os\nfrom setuptools import setup\n"
                "open('marker.py', 'w').write(f'BUILD_OPS = {os.environ[\"DS_BUILD_OPS\"]!r}\\n')\n"
                "setup(name='deepspeed', version='9.9.9', py_modules=['marker'])\n")
    monkeypatch.setattr(wheels, "download_sdist", lambda release, into: _sdist(tmp_path, setup_py))
    wheel = wheels.build_wheel("9.9.9", tmp_path / "out", {**wheels.os.environ, "DS_BUILD_OPS": "0"})
    assert wheel.name == "deepspeed-9.9.9-py3-none-any.whl" and wheel.parent == tmp_path / "out"
    assert zipfile.ZipFile(wheel).read("marker.py") == b"BUILD_OPS = '0'\n"


def test_when_the_build_fails_then_the_wheel_error_carries_its_last_lines_and_its_sources_are_gone(tmp_path,
                                                                                                      monkeypatch):
    made = []

    def sdist(release, into):
        made.append(into)
        return _sdist(tmp_path, "raise SystemExit('setup.py: no torch here')\n")

    monkeypatch.setattr(wheels, "download_sdist", sdist)
    with pytest.raises(wheels.WheelError, match="no torch here"):
        wheels.build_wheel("9.9.9", tmp_path / "out")
    assert made and not made[0].exists()
