"""The autograd.Function audit on a small package written here (no DeepSpeed needed)."""
import textwrap

import torch

from fixes.entries.zero3_hooks_torch_func import autograd_audit

SOURCE = textwrap.dedent("""
    import torch
    from torch.autograd import Function


    class Legacy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            return g


    class NewStyle(Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return x

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass


    class Derived(Legacy):
        pass


    def factory(module):
        class Nested(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.detach()

        return Nested


    class NotAFunction:
        def forward(self, ctx):
            return ctx
""")


def _package(tmp_path):
    package = tmp_path / "deepspeed"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "funcs.py").write_text(SOURCE)
    return package


def test_when_package_audited_then_every_function_subclass_is_found_with_its_style(tmp_path):
    found = {f.name: f for f in autograd_audit.audit_autograd_functions(_package(tmp_path))}
    assert set(found) == {"Legacy", "NewStyle", "Derived", "Nested"}
    assert found["Legacy"].legacy and found["Nested"].legacy
    assert not found["NewStyle"].legacy and found["NewStyle"].has_setup_context and found["NewStyle"].has_vmap_rule
    assert found["Derived"].forward_args is None and not found["Derived"].legacy  # inherits forward
    assert found["Nested"].qualname == "factory.Nested"
    assert found["Legacy"].file == "deepspeed/sub/funcs.py"


def test_when_one_file_audited_then_names_match_the_package_audit(tmp_path):
    package = _package(tmp_path)
    assert autograd_audit.audit_file(package / "sub" / "funcs.py") == autograd_audit.audit_autograd_functions(package)


def test_when_functions_applied_then_they_are_recorded_and_apply_is_restored():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return 2 * x

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    original = vars(torch.autograd.Function)["apply"]
    with autograd_audit.applied_autograd_functions() as seen:
        assert torch.equal(Double.apply(torch.ones(2)), torch.full((2, ), 2.0))
    assert seen == {Double}
    assert vars(torch.autograd.Function)["apply"] is original


def test_when_table_built_then_reached_classes_are_marked(tmp_path):
    functions = autograd_audit.audit_autograd_functions(_package(tmp_path))
    rows = autograd_audit.audit_table(functions, {("deepspeed/sub/funcs.py", "Nested")})
    marked = {row["class"]: row["reached by ZeRO-3 training"] for row in rows}
    assert marked["factory.Nested"] == "REACHED" and marked["Legacy"] == ""
    assert {row["class"]: row["legacy forward(ctx, ...)"] for row in rows}["Derived"] == "inherits forward"
