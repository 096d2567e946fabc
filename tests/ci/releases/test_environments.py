"""The (Python, torch) environments of ci/environments.toml: parsing, requirements, kernels, and the
sweep's environment axis (rows of another environment kept beside the default cpu rows)."""
import json

import pytest

from ci.releases import environments
from ci import releases, sweep
from fixes import measured


def write_file(tmp_path, monkeypatch, text):
    path = tmp_path / "environments.toml"
    path.write_text(text)
    monkeypatch.setattr(environments, "FILE", path)
    monkeypatch.setattr(environments, "ENVS", tmp_path / "envs")


def test_when_the_file_is_read_then_every_environment_has_its_python_torch_and_pins():
    known = environments.load()
    assert {"colab-shape", "torch-2.0"} <= set(known)
    old = known["torch-2.0"]
    assert (old.python, old.torch, old.requirements) == ("3.11", "2.0.1", ("numpy<2",))
    assert environments.DEFAULT not in known  # the project venv is not built from the file


def test_when_an_environment_pins_a_package_then_the_pin_replaces_the_runtime_line():
    wanted = environments.get("torch-2.0").install_requirements()
    assert wanted[0] == "torch==2.0.1" and "numpy<2" in wanted
    assert not [line for line in wanted if line.startswith("numpy==")], wanted
    assert "hjson==3.1.0" in wanted and any(line.startswith("ipykernel==") for line in wanted)
    colab = environments.get("colab-shape").install_requirements()
    assert any(line.startswith("numpy==") for line in colab)


def test_when_a_key_is_unknown_or_missing_then_loading_names_the_environment(tmp_path, monkeypatch):
    write_file(tmp_path, monkeypatch, '["x-1"]\npython = "3.11"\ntorch = "2.0.1"\npins = ["numpy<2"]\n')
    with pytest.raises(environments.EnvironmentError_, match="environment x-1 .*unknown keys: pins"):
        environments.load()
    write_file(tmp_path, monkeypatch, '["x-1"]\npython = "3.11"\n')
    with pytest.raises(environments.EnvironmentError_, match="environment x-1 needs python and torch"):
        environments.load()


def test_when_an_environment_is_not_built_then_require_and_run_python_fail_naming_it(tmp_path, monkeypatch):
    write_file(tmp_path, monkeypatch, '["old-torch"]\npython = "3.11"\ntorch = "2.0.1"\n')
    with pytest.raises(environments.EnvironmentError_, match="environment old-torch .*is not built"):
        environments.require("old-torch")
    with pytest.raises(environments.EnvironmentError_, match="environment old-torch .*is not built"):
        environments.run_python(environments.get("old-torch"), "0.17.6", ["-c", "pass"])
    with pytest.raises(environments.EnvironmentError_, match="unknown environment 'nope'"):
        environments.get("nope")


def test_when_the_requirements_change_then_the_environment_is_no_longer_ready(tmp_path, monkeypatch):
    write_file(tmp_path, monkeypatch, '["e"]\npython = "3.11"\ntorch = "2.0.1"\nrequirements = ["numpy<2"]\n')
    env = environments.get("e")
    env.venv.mkdir(parents=True)
    env.marker.write_text("\n".join(env.install_requirements()) + "\n")
    assert env.is_installed()
    write_file(tmp_path, monkeypatch, '["e"]\npython = "3.11"\ntorch = "2.0.1"\nrequirements = ["numpy<1.26"]\n')
    assert not environments.get("e").is_installed()


def test_when_a_kernel_is_written_then_it_runs_the_environments_python_with_the_release_and_checkout(
        tmp_path, monkeypatch):
    write_file(tmp_path, monkeypatch, '["e"]\npython = "3.11"\ntorch = "2.0.1"\n')
    env = environments.get("e")
    env.venv.mkdir(parents=True)
    env.marker.write_text("\n".join(env.install_requirements()) + "\n")
    monkeypatch.setattr(environments, "kernels_dir", lambda: tmp_path / "kernels")
    monkeypatch.setattr(releases, "is_installed", lambda release: True)
    name = environments.kernel("e", "0.17.6")
    assert name == "deepspeed-0.17.6-e"
    spec = json.loads((tmp_path / "kernels" / name / "kernel.json").read_text())
    assert spec["argv"][:3] == [str(env.executable), "-m", "ipykernel_launcher"]
    path = spec["env"]["PYTHONPATH"].split(":")
    assert path == [str(releases.install_dir("0.17.6")), str(environments.ROOT)]
    assert spec["env"]["FIXBOOK_ENVIRONMENT"] == "e" and spec["env"]["DS_ACCELERATOR"] == "cpu"
    assert environments.kernel(environments.DEFAULT, "0.17.6") == "deepspeed-0.17.6"


def test_when_two_environments_run_one_release_then_their_extension_builds_are_kept_apart():
    """Another Python or torch builds another binary of DeepSpeed's JIT ops: one shared directory made each side
    rebuild the other's build, behind one lock."""
    colab = environments.variables(environments.get("colab-shape"), "0.16.0")["TORCH_EXTENSIONS_DIR"]
    own = releases.environment("0.16.0")["TORCH_EXTENSIONS_DIR"]
    assert colab != own and colab.endswith("0.16.0/.torch_extensions/colab-shape")


def row(release, status, environment=measured.DEFAULT_ENVIRONMENT, **fields):
    return measured.Observation(release, status, environment=environment, **fields)


def test_when_rows_of_another_environment_are_merged_then_the_cpu_rows_stay_and_both_read_back(tmp_path,
                                                                                                  monkeypatch):
    monkeypatch.setattr(sweep, "environment_versions", lambda name: ("2.0.1", "3.11.7"))
    old = measured.SweepData(releases=["0.17.6"], torch="2.13.0", python="3.11.7",
                             results={"x": measured.EntrySweep("x", {"0.17.6": row("0.17.6", "affected", fix="fixed")})})
    new = {sweep.Pair("x", "0.17.6"): row("0.17.6", "not affected", "torch-2.0"),
           sweep.Pair("x", "0.16.0"): row("0.16.0", "could not run", "torch-2.0", reason="ImportError: no")}
    merged = sweep.merge(old, new, ["0.16.0", "0.17.6"], {"environment": "torch-2.0"}, environment="torch-2.0")
    assert merged.results == old.results and merged.releases == old.releases and merged.torch == "2.13.0"
    part = merged.environment("torch-2.0")
    assert (part.torch, part.python, part.releases) == ("2.0.1", "3.11.7", ["0.16.0", "0.17.6"])
    assert part.entry("x").get("0.17.6").status == "not affected"
    assert merged.environment(measured.DEFAULT_ENVIRONMENT).entry("x").get("0.17.6").status == "affected"

    path = tmp_path / "sweep.json"
    measured.write(merged, path)
    back = measured.read(path)
    assert back == merged
    assert back.environment("torch-2.0").entry("x").get("0.16.0").environment == "torch-2.0"
    assert back.entry("x").get("0.17.6").environment == "cpu"
    assert "environment" not in json.loads(path.read_text())["results"]["x"]["0.17.6"]  # old rows unchanged

    again = sweep.merge(back, {sweep.Pair("x", "0.17.6"): row("0.17.6", "affected", fix="fixed", reason="again")},
                        ["0.17.6"], {})
    assert again.environments == back.environments and again.entry("x").get("0.17.6").reason == "again"


def test_when_the_committed_file_is_read_then_its_rows_are_the_default_environments():
    data = measured.read()
    assert all(o.environment == "cpu" for s in data.results.values() for o in s.observations.values())
    for name, part in data.environments.items():
        assert name in environments.load(), f"sweep.json has rows of an unknown environment {name}"
        assert all(o.environment == name for s in part.results.values() for o in s.observations.values())


def test_when_a_sweep_runs_in_an_environment_then_its_child_is_that_pythons(tmp_path, monkeypatch):
    write_file(tmp_path, monkeypatch, '["e"]\npython = "3.11"\ntorch = "2.0.1"\n')
    env = environments.get("e")
    env.venv.mkdir(parents=True)
    env.marker.write_text("\n".join(env.install_requirements()) + "\n")
    started = []

    class Popen:
        def __init__(self, args, env, **kwargs):
            started.append((args, env))
            self.pid, self.returncode = 0, 0

        def communicate(self, timeout=None):
            return sweep.MARK + json.dumps({"entry": "x", "probe": True, "reproduced": True, "done": True,
                                            "fix": "fixed"}) + "\n", ""

    monkeypatch.setattr(sweep.subprocess, "Popen", Popen)
    found = sweep.run_release("0.17.6", ["x"], timeout=10, environment="e")
    [(args, child_env)] = started
    assert args[0] == str(env.executable) and child_env["FIXBOOK_ENVIRONMENT"] == "e"
    assert found["x"].status == "affected" and found["x"].environment == "e"


def test_when_an_environment_names_notebooks_then_each_is_a_known_entry_with_a_notebook():
    import fixes
    from ci.notebooks import runner

    runs = environments.notebook_runs()
    assert ("zero-grad-hook-lifetime", "torch-2.0") in runs
    for entry, name in runs:
        assert fixes.get(entry).info.reproduce_release in releases.load().releases, (entry, name)
        assert runner.notebook_path(entry).exists(), entry


def test_when_installed_then_one_pip_run_gets_every_requirement_and_the_marker_comes_last(tmp_path, monkeypatch):
    write_file(tmp_path, monkeypatch, '["e"]\npython = "3.11"\ntorch = "2.0.1"\nrequirements = ["numpy<2"]\n')
    env = environments.get("e")
    ran = []

    def run(args, check, env=None):
        ran.append(args)
        assert not installed.marker.exists(), "the marker is written before the install finished"
        if args[1:3] == ["-m", "venv"]:
            installed.executable.parent.mkdir(parents=True)
            installed.executable.touch()

    installed = env
    monkeypatch.setattr(environments, "installer", lambda: None)  # no uv here: pip builds it
    monkeypatch.setattr(environments, "interpreter", lambda version: "/usr/bin/python3.11")
    monkeypatch.setattr(environments.subprocess, "run", run)
    assert environments.install(env) >= 0 and env.is_installed()
    venv, pip = ran
    assert venv[:3] == ["/usr/bin/python3.11", "-m", "venv"]
    assert pip[:4] == [str(env.executable), "-m", "pip", "install"] and pip[-len(env.install_requirements()):] == \
        env.install_requirements()
    assert set(env.build_info()) == {"built"}
    assert environments.install(env) == 0.0 and len(ran) == 2  # ready: nothing runs
    monkeypatch.setattr(environments, "interpreter", lambda version: None)
    env.marker.unlink()
    with pytest.raises(environments.EnvironmentError_, match="environment e: CPython 3.11 is not on this machine"):
        environments.install(env)


def test_when_pip_fails_then_the_error_names_the_environment_and_the_free_disk_and_no_marker_is_left(
        tmp_path, monkeypatch):
    write_file(tmp_path, monkeypatch, '["e"]\npython = "3.11"\ntorch = "2.0.1"\n')
    env = environments.get("e")
    ran = []

    def run(args, check, env=None):
        ran.append(args)
        if args[1:3] == ["-m", "venv"]:
            failing.executable.parent.mkdir(parents=True)
            failing.executable.touch()
        else:  # pip: what a full disk looks like from here (ERROR: ... [Errno 28] No space left on device)
            raise environments.subprocess.CalledProcessError(1, args)

    failing = env
    monkeypatch.setattr(environments, "installer", lambda: None)
    monkeypatch.setattr(environments, "interpreter", lambda version: "/usr/bin/python3.11")
    monkeypatch.setattr(environments.subprocess, "run", run)
    with pytest.raises(environments.EnvironmentError_, match=r"environment e: pip exited 1 \(\d+\.\d GiB free "):
        environments.install(env)
    assert "--no-cache-dir" in ran[-1]  # PyPI's CUDA wheels are not kept twice on disk
    assert not env.is_installed()


def test_when_an_environment_is_set_up_then_its_torch_and_every_release_are_byte_compiled_for_its_python():
    """Its processes (kernels, ranks, checks) read .pyc files instead of compiling torch's and DeepSpeed's modules
    again, also where ``PYTHONDONTWRITEBYTECODE`` is set (``ci/setup.sh`` -> ``python -m ci.releases.environments install``)."""
    import subprocess
    from pathlib import Path

    built = [env for env in environments.load().values() if env.is_installed()]
    if not built:
        pytest.skip("no environment is built here (bash ci/setup.sh builds them)")
    for env in built:
        tag = subprocess.run([str(env.executable), "-c", "import sys; print(sys.implementation.cache_tag)"],
                             capture_output=True, text=True, check=True).stdout.strip()
        torch_init = next(env.venv.glob("lib/python*/site-packages/torch/__init__.py"))
        modules = [torch_init, *(releases.install_dir(r) / "deepspeed" / "__init__.py" for r in releases.installed_releases())]
        missing = [str(m) for m in modules if not (m.parent / "__pycache__" / f"{m.stem}.{tag}.pyc").is_file()]
        assert not missing, f"{env.name}: not byte-compiled for its Python ({tag}): {missing[:3]} (run `bash ci/setup.sh`)"


def test_when_uv_is_at_hand_then_it_makes_the_venv_and_installs_every_requirement_in_one_run_with_its_cache(
        tmp_path, monkeypatch):
    write_file(tmp_path, monkeypatch, '["e"]\npython = "3.12"\ntorch = "2.14.1"\n')
    env = environments.get("e")
    ran = []

    def run(args, check, env=None):
        ran.append((args, env))
        if args[1] == "venv":
            built.executable.parent.mkdir(parents=True)
            built.executable.touch()

    built = env
    monkeypatch.setattr(environments, "installer", lambda: "/opt/uv")
    monkeypatch.setattr(environments, "interpreter", lambda version: "/usr/bin/python3.12")
    monkeypatch.setattr(environments.subprocess, "run", run)
    assert environments.install(env) >= 0 and env.is_installed()
    (venv, _), (install, variables) = ran
    assert venv[:2] == ["/opt/uv", "venv"] and venv[-2:] == ["/usr/bin/python3.12", str(env.venv)]
    assert install[:6] == ["/opt/uv", "pip", "install", "--quiet", "--compile-bytecode", "-p"]  # .pyc files, as pip
    assert install[6] == str(env.executable)
    assert install[7:] == env.install_requirements() and variables["UV_CACHE_DIR"] == str(environments.UV_CACHE)


def test_when_environments_are_installed_then_they_build_at_once_and_one_failing_leaves_the_other_built(
        tmp_path, monkeypatch, capsys):
    import threading

    write_file(tmp_path, monkeypatch, '["a"]\npython = "3.11"\ntorch = "2.0.1"\n\n["b"]\npython = "3.12"\ntorch = "2.14.1"\n')
    both_running = threading.Barrier(2, timeout=10)  # each install waits for the other: fails unless concurrent

    def install(env):
        both_running.wait()
        if env.name == "a":
            raise environments.EnvironmentError_("environment a: pip exited 1")
        return 1.0

    compiled = []
    monkeypatch.setattr(environments, "install", install)
    monkeypatch.setattr(environments, "write_kernel", lambda env, release: f"k-{env.name}-{release}")
    monkeypatch.setattr(environments.releases, "compile_bytecode", lambda python, dirs: compiled.append((python, dirs)))
    monkeypatch.setattr(environments, "ROOT", tmp_path)
    assert environments.main(["install"]) == 1
    # the releases (and the checkout's fixes) byte-compiled for the Python of the environment that was built
    assert compiled == [(environments.get("b").executable,
                         [*(releases.install_dir(r) for r in releases.installed_releases()), tmp_path / "fixes"])]
    out, err = capsys.readouterr()
    assert "environment b (Python 3.12, torch 2.14.1): built in 1 s" in out
    assert "environment a could not be built: environment a: pip exited 1" in err and "not built: a" in err


def test_when_only_the_tests_environments_are_installed_then_the_others_are_left_alone(tmp_path, monkeypatch, capsys):
    write_file(tmp_path, monkeypatch, '["a"]\npython = "3.11"\ntorch = "2.0.1"\n\n["b"]\npython = "3.12"\ntorch = "2.14.1"\n'
                                      'tests = true\n')
    built = []
    monkeypatch.setattr(environments, "install", lambda env: built.append(env.name) or 1.0)
    monkeypatch.setattr(environments, "write_kernel", lambda env, release: f"k-{env.name}-{release}")
    monkeypatch.setattr(environments.releases, "compile_bytecode", lambda python, dirs: None)
    monkeypatch.setattr(environments, "ROOT", tmp_path)
    assert environments.main(["install", "--tests"]) == 0  # `bash ci/setup.sh`
    assert built == ["b"]
    assert environments.main(["install"]) == 0  # `bash ci/setup.sh matrix`
    assert built[0] == "b" and sorted(built[1:]) == ["a", "b"]
    write_file(tmp_path, monkeypatch, '["c"]\npython = "3.11"\ntorch = "2.0.1"\ntests = "yes"\n')
    with pytest.raises(environments.EnvironmentError_, match="environment c: tests is true or false"):
        environments.load()


def test_when_the_committed_file_is_read_then_the_tests_build_only_the_environment_they_use():
    """The tests apply every fix under Python 3.12 (tests/fixes/test_registry.py): colab-shape; the notebook matrix's
    other environments and the older releases' sweeps are CI's."""
    assert [env.name for env in environments.load().values() if env.tests] == ["colab-shape"]
