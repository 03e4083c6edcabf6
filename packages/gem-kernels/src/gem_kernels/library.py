"""Defining gem's kernels as PyTorch operators (``torch.ops.<namespace>.*``).

:class:`OperatorLibrary` is how ``gem_kernels.ops`` and ``gem_precision.ops`` register their
operators: ``torch.library.Library`` definitions whose fake and autograd implementations come
from ``register_fake`` / ``register_autograd``. Not ``torch.library.custom_op``: that wraps the
implementation in ``torch._disable_dynamo``, which imports ``torch._dynamo`` at the first call,
and with it ``triton.language`` compiled, after which the Triton interpreter (CPU tests) cannot
run in the process; and its wrapper and aliasing check cost host time on every eager call. The
operator is the same to the dispatcher, ``opcheck`` and ``torch.compile``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["OperatorLibrary"]


class OperatorLibrary:
    """The operators of one namespace (``torch.ops.<namespace>``), as decorators."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._lib = torch.library.Library(namespace, "FRAGMENT")  # owns the registrations

    def operator(self, name: str, schema: str) -> Callable[[Callable], Callable]:
        """Decorator: defines ``<namespace>::<name>`` with ``schema`` (``"(Tensor x, ...) ->
        Tensor"``) and registers the function as its implementation for every device (it
        picks its backend itself)."""

        def register(impl: Callable) -> Callable:
            self._lib.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
            self._lib.impl(name, impl, "CompositeExplicitAutograd")
            return impl

        return register

    def fake(self, name: str) -> Callable[[Callable], Callable]:
        """Decorator: the function is the fake (meta) implementation of ``<namespace>::<name>``."""
        return torch.library.register_fake(f"{self.namespace}::{name}", lib=self._lib)

    def autograd(
        self, name: str, backward: Callable, setup_context: Callable | None = None
    ) -> None:
        """Registers ``backward`` (and ``setup_context``) as the operator's autograd formula."""
        torch.library.register_autograd(
            f"{self.namespace}::{name}", backward, setup_context=setup_context, lib=self._lib
        )

    def once_differentiable(self, name: str) -> None:
        """A backward operator's own gradient is not implemented: differentiating it raises
        instead of returning nothing."""
        qualified = f"{self.namespace}::{name}"

        def backward(ctx, *grads):
            raise RuntimeError(f"{qualified} is not differentiable (no double backward)")

        self.autograd(name, backward)
