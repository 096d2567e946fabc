"""The autograd.Function audit on a small package written here (no DeepSpeed needed)."""
import textwrap

import torch

from fixes.entries.zero3_hooks_torch_func import autograd_audit

SOURCE = textwrap.dedent("""
    import torch
    from torch.autograd import Function
    class Legacy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x): return x
        @staticmethod
        def backward(ctx, g): return g
    class NewStyle(Function):
        generate_vmap_rule = True
        @staticmethod
        def forward(x): return x
        @staticmethod
        def setup_context(ctx, inputs, output): pass
    class Derived(Legacy):
        pass
    def factory(module):
        class Nested(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x): return x.detach()
        return Nested
    class NotAFunction:
        def forward(self, ctx): return ctx
""")


def test_when_package_audited_then_every_function_subclass_is_found_with_its_style_and_reached_ones_marked(tmp_path):
    package = tmp_path / "deepspeed"
    (package / "sub").mkdir(parents=True)
    for path, text in (("__init__.py", ""), ("sub/__init__.py", ""), ("sub/funcs.py", SOURCE)):
        (package / path).write_text(text)
    functions = autograd_audit.audit_autograd_functions(package)
    assert autograd_audit.audit_file(package / "sub" / "funcs.py") == functions  # one file: the same names
    found = {f.name: f for f in functions}
    assert set(found) == {"Legacy", "NewStyle", "Derived", "Nested"}
    assert found["Legacy"].legacy and found["Nested"].legacy
    assert not found["NewStyle"].legacy and found["NewStyle"].has_setup_context and found["NewStyle"].has_vmap_rule
    assert found["Derived"].forward_args is None and not found["Derived"].legacy  # inherits forward
    assert found["Nested"].qualname == "factory.Nested"
    assert found["Legacy"].file == "deepspeed/sub/funcs.py"
    rows = autograd_audit.audit_table(functions, {("deepspeed/sub/funcs.py", "Nested")})
    marked = {row["class"]: row["reached by ZeRO-3 training"] for row in rows}
    assert marked["factory.Nested"] == "REACHED" and marked["Legacy"] == ""
    assert {row["class"]: row["legacy forward(ctx, ...)"] for row in rows}["Derived"] == "inherits forward"


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
