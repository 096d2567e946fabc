"""ci.releases: which releases an install takes, and how."""
import sys
from pathlib import Path

import pytest

from ci import releases


def test_when_boundaries_are_left_out_then_only_the_release_set_is_installed(monkeypatch):
    installed: list[str] = []
    compiled: list[tuple[str, list[Path]]] = []
    monkeypatch.setattr(releases, "is_installed", lambda release: False)
    monkeypatch.setattr(releases, "install", installed.append)
    monkeypatch.setattr(releases, "write_kernel", lambda release: None)
    monkeypatch.setattr(releases, "compile_bytecode", lambda python, directories: compiled.append((python, directories)))
    releases.install_all(jobs=1, boundaries=False)
    assert installed == list(releases.load().releases)
    assert compiled == [(sys.executable, [releases.install_dir(r) for r in installed])]  # byte-compiled for this Python
    installed.clear()
    compiled.clear()
    releases.install_all(jobs=1)
    assert installed == [*releases.load().releases, *releases.sample_releases()]
    assert compiled == [(sys.executable, [releases.install_dir(r) for r in installed])]
    assert releases.sample_releases(), "the record has boundary releases outside the set, so the two differ"


def test_when_bytecode_writing_is_off_then_compile_bytecode_still_writes_each_modules_pyc(tmp_path, monkeypatch):
    import importlib.util

    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    modules = [package / "__init__.py", package / "sub" / "mod.py"]
    for module in modules:
        module.write_text("VALUE = 1\n")
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")  # as on machines where no process writes .pyc files
    assert releases.compile_bytecode(sys.executable, [package, tmp_path / "absent"]) is True
    assert all(Path(importlib.util.cache_from_source(str(module))).is_file() for module in modules)


def test_when_a_module_does_not_compile_then_the_others_are_compiled_and_a_line_names_it(tmp_path, capsys):
    import importlib.util

    (tmp_path / "good.py").write_text("VALUE = 1\n")
    (tmp_path / "broken.py").write_text("def (:\n")
    assert releases.compile_bytecode(sys.executable, [tmp_path]) is False  # set-up goes on
    assert Path(importlib.util.cache_from_source(str(tmp_path / "good.py"))).is_file()
    assert not Path(importlib.util.cache_from_source(str(tmp_path / "broken.py"))).exists()
    err = capsys.readouterr().err
    assert "1 module(s) did not compile" in err and "broken.py" in err


def test_when_set_up_then_every_installed_release_is_byte_compiled_for_the_venvs_python():
    """Every process that imports DeepSpeed reads its .pyc files (``ci/setup.sh`` -> ``install_all``) instead of
    compiling its modules again, also where ``PYTHONDONTWRITEBYTECODE`` is set."""
    import importlib.util

    installed = releases.installed_releases()
    assert installed, "no release is installed: run `bash ci/setup.sh`"
    missing = [r for r in installed
               if not Path(importlib.util.cache_from_source(str(releases.install_dir(r) / "deepspeed" / "__init__.py"))).is_file()]
    assert not missing, f"not byte-compiled for this Python: {missing} (run `bash ci/setup.sh`)"


def test_when_uv_is_there_then_a_release_installs_with_it_with_pips_options_and_without_pip():
    with_uv = releases.install_command("0.18.2", Path("/x"), "/venv/bin/uv")
    with_pip = releases.install_command("0.18.2", Path("/x"), None)
    assert with_uv[:3] == ["/venv/bin/uv", "pip", "install"] and "pip" not in with_uv[3:]
    assert with_pip[1:4] == ["-m", "pip", "install"]
    options = ["--no-deps", "--no-build-isolation", "--target", "/x", "deepspeed==0.18.2"]
    assert all(option in with_uv and option in with_pip for option in options)


def test_when_a_release_is_installed_then_it_lands_whole_without_uvs_lock_and_a_failed_install_leaves_nothing(
        tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setattr(releases, "INSTALL_ROOT", tmp_path)
    monkeypatch.setattr(releases, "installer", lambda: "/venv/bin/uv")
    seen: dict[str, str] = {}
    built = tmp_path / "deepspeed-0.18.2-py3-none-any.whl"

    def fake_build(release, out, env):
        if release == "0.17.6":
            raise releases.wheels.WheelError("the index lists no deepspeed-0.17.6.tar.gz")
        assert env["DS_BUILD_OPS"] == "0" and out.parent == tmp_path
        return built

    def fake_run(command, env, check):
        seen.update(env)
        target = Path(command[command.index("--target") + 1])
        assert command[-1] == (str(built) if "0.18.2" in target.name else "deepspeed==0.17.6")
        if "deepspeed==0.17.6" in command:
            (target / "deepspeed").mkdir()
            raise subprocess.CalledProcessError(1, command)
        (target / "deepspeed").mkdir()
        (target / "deepspeed" / "__init__.py").write_text("")
        (target / ".lock").write_text("")

    monkeypatch.setattr(releases.wheels, "build_wheel", fake_build)
    monkeypatch.setattr(releases.subprocess, "run", fake_run)
    releases.install("0.18.2")
    assert (tmp_path / "0.18.2" / "deepspeed" / "__init__.py").is_file() and not (tmp_path / "0.18.2" / ".lock").exists()
    assert seen["DS_BUILD_OPS"] == "0"
    with pytest.raises(subprocess.CalledProcessError):
        releases.install("0.17.6")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.18.2"]


def test_when_an_op_is_compiled_then_the_compiler_gets_every_argument_but_debug_information(tmp_path):
    import subprocess

    from ci import releases

    seen = tmp_path / "argv"
    fake = tmp_path / "compiler"  # stands for FIXBOOK_CXX: writes the arguments it was given, one per line
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {seen}\n")
    fake.chmod(0o755)
    variables = releases.compiler_cache_variables()
    assert variables["CXX"] == str(releases.CXX_WRAPPER) and variables["TORCH_NO_COMPILER_WRAPPER"] == "1"
    arguments = ["-O3", "-g", "-march=native", "-I/a path/with spaces", "-c", "op.cpp", "-o", "op.o"]
    done = subprocess.run([variables["CXX"], *arguments], env={"FIXBOOK_CXX": str(fake), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0
    assert seen.read_text().splitlines() == [a for a in arguments if a != "-g"]


def test_when_ccache_is_installed_then_the_wrapper_compiles_through_it_and_each_release_gets_the_variables(
        tmp_path, monkeypatch):
    from ci import releases

    ccache = tmp_path / "c++"  # where Debian's ccache package puts its compiler
    ccache.touch()
    monkeypatch.setattr(releases, "CCACHE_CXX", ccache)
    variables = releases.environment("0.19.8")
    assert variables["FIXBOOK_CXX"] == str(ccache) and variables["CXX"] == str(releases.CXX_WRAPPER)
    assert variables["CCACHE_BASEDIR"] == str(releases.ROOT)
    monkeypatch.setattr(releases, "CCACHE_CXX", tmp_path / "absent")
    assert "FIXBOOK_CXX" not in releases.compiler_cache_variables()  # the wrapper then runs c++
