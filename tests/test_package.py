"""The ``fixes`` package as pip installs it: what the wheel holds is what the checkout tracks."""
import shutil
import subprocess
import sys
import zipfile

from ci import ROOT


def _tracked(*paths: str) -> list[str]:
    listed = subprocess.run(["git", "ls-files", *paths], cwd=ROOT, capture_output=True, text=True, check=True)
    return listed.stdout.split()


def test_when_wheel_is_built_then_it_holds_every_tracked_file_of_the_package(tmp_path):
    source = tmp_path / "src"  # the tracked files only: no build/ or egg-info of the checkout's own builds
    for name in _tracked("fixes", "pyproject.toml", "README.md"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "--quiet",
                    "-w", str(tmp_path)], check=True, cwd=tmp_path)
    [wheel] = tmp_path.glob("*.whl")
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if name.startswith("fixes/")}
    tracked = set(_tracked("fixes"))
    assert any(name.startswith("fixes/data/") for name in tracked), "no tracked data files under fixes/data"
    assert sorted(tracked - shipped) == [], "tracked but missing from the wheel (pyproject.toml's package-data?)"
