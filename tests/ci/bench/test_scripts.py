"""ci/bench/scripts.py: a notebook's cells as one script, run as a kernel runs them."""
from ci.bench import scripts as bench_scripts


def test_when_a_notebook_is_turned_into_a_script_then_parameters_follow_their_cell_and_magics_are_dropped(tmp_path):
    import nbformat

    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("results_file = None", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("%pip install x\nprint(results_file)"),
        nbformat.v4.new_markdown_cell("# not code")])
    path = tmp_path / "n.ipynb"
    nbformat.write(notebook, path)
    script = bench_scripts.notebook_script(path, {"results_file": ""})
    assert script == "results_file = None\n\nresults_file = ''\n\nprint(results_file)\n"


def test_when_a_notebook_script_starts_ranks_then_they_do_not_re_run_it(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "n.py"
    script.write_text("import multiprocessing as mp, os\nprint('top level', os.getpid())\n"
                      "if __name__ == '__main__':\n"
                      "    p = mp.get_context('spawn').Process(target=os.getpid)\n    p.start(); p.join()\n")
    done = subprocess.run([sys.executable, *bench_scripts.script_command(script)], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("top level") == 1, done.stdout  # `python n.py` prints it twice
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert plain.stdout.count("top level") == 2, plain.stdout  # the hazard the command avoids
