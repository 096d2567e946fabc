"""ci.releases.ops: the JIT ops the notebooks declare, built once their release is installed."""
import json
import threading

import pytest

from ci import releases
from ci.releases import ops


def _notebook(directory, name, metadata):
    (directory / f"{name}.ipynb").write_text(json.dumps({"cells": [], "metadata": metadata, "nbformat": 4,
                                                         "nbformat_minor": 5}))


def test_when_notebooks_declare_ops_then_they_are_merged_per_release(tmp_path):
    _notebook(tmp_path, "a", {"fixbook": {"jit_ops": {"0.16.0": ["FusedAdamBuilder"]}}})
    _notebook(tmp_path, "b", {"fixbook": {"jit_ops": {"0.16.0": ["CPUAdamBuilder", "FusedAdamBuilder"],
                                                      "0.19.8": ["CPUAdamBuilder"]}}})
    _notebook(tmp_path, "c", {"kernelspec": {"name": "python3"}})
    assert ops.declared(tmp_path) == {"0.16.0": ["CPUAdamBuilder", "FusedAdamBuilder"], "0.19.8": ["CPUAdamBuilder"]}


@pytest.mark.parametrize("jit_ops", [["FusedAdamBuilder"], {"0.16.0": "FusedAdamBuilder"}, {"0.16.0": [""]}])
def test_when_a_declaration_is_malformed_then_it_is_refused_with_the_notebooks_name(tmp_path, jit_ops):
    _notebook(tmp_path, "bad-entry", {"fixbook": {"jit_ops": jit_ops}})
    with pytest.raises(ops.OpsDeclarationError, match="bad-entry.ipynb"):
        ops.declared(tmp_path)


def test_when_releases_install_then_those_with_ops_go_first_and_each_build_starts_after_its_install(monkeypatch):
    events: list[str] = []
    lock = threading.Lock()

    def build(release, names, run):
        with lock:
            events.append(f"build {release} {'+'.join(names)}")
        return release != "0.17.1"  # one build fails: reported, set-up goes on

    monkeypatch.setattr(ops, "build", build)
    builder = ops.Builder({"0.16.0": ["FusedAdamBuilder"], "0.17.1": ["CPUAdamBuilder"]}, releases.run_python_any)
    order = builder.first(["0.15.4", "0.16.0", "0.17.1", "0.19.8"])
    assert order == ["0.16.0", "0.17.1", "0.15.4", "0.19.8"]
    for release in order:
        with lock:
            events.append(f"install {release}")
        builder.installed(release)
    assert builder.wait() == ["0.17.1"]
    assert events.index("install 0.16.0") < events.index("build 0.16.0 FusedAdamBuilder")
    assert events.index("install 0.17.1") < events.index("build 0.17.1 CPUAdamBuilder")
    assert sum(event.startswith("build") for event in events) == 2  # no build for a release with no ops


def test_when_a_build_fails_then_a_line_names_the_release_and_false_is_returned(monkeypatch, capsys):
    class Done:
        returncode, stdout, stderr = 1, "", "RuntimeError: Error building extension 'fused_adam'"

    assert ops.build("0.16.0", ["FusedAdamBuilder"], lambda *args, **kwargs: Done()) is False
    assert "DeepSpeed 0.16.0: building FusedAdamBuilder ahead failed (RuntimeError: Error building extension " \
           "'fused_adam')" in capsys.readouterr().err


def test_when_the_book_declares_ops_then_each_names_a_release_of_the_set_and_a_cpu_op_builder_of_it():
    declared = ops.declared()
    assert declared, "zero3-reload-states-wrong-order declares FusedAdam on 0.16.0"
    for release, names in declared.items():
        assert release in releases.load().releases
        if not releases.is_installed(release):
            pytest.skip(f"DeepSpeed {release} is not installed")
        sources = "".join(path.read_text() for path in
                          (releases.install_dir(release) / "deepspeed" / "ops" / "op_builder" / "cpu").glob("*.py"))
        for name in names:
            assert f"class {name}(" in sources, f"{name} is no CPU op builder of DeepSpeed {release}"
