"""``compile_modules`` compiles every module it is given: plain ``module.compile()`` of more
than ``recompile_limit`` (8) module types leaves the rest eager (one shared dynamo frame)."""

import torch
from gem_train.trainer import compile_modules
from torch import nn
from torch._dynamo.utils import counters


def _module_types(count: int) -> list[type[nn.Module]]:
    def forward(self, x):
        return self.linear(x).relu() * self.scale

    def init(self, scale):
        nn.Module.__init__(self)
        self.linear, self.scale = nn.Linear(4, 4), scale

    return [type(f"Region{i}", (nn.Module,), {"__init__": init, "forward": forward})
            for i in range(count)]  # fmt: skip


def test_every_module_type_gets_a_graph():
    torch._dynamo.reset()
    counters.clear()
    modules = [kind(i + 1.0) for i, kind in enumerate(_module_types(12))]
    compile_modules(modules, backend="eager")
    x = torch.randn(3, 4)
    for module in modules:
        graphs = counters["stats"]["unique_graphs"]
        module(x)
        assert counters["stats"]["unique_graphs"] == graphs + 1, type(module).__name__
    torch._dynamo.reset()
