"""Model-level A/B: the callables that compare two ``nn.Module``s (or two configurations of one) as a user runs
them: a forward pass, a training step with an optimizer, or generation of N tokens with a KV cache.

Each helper turns the models into a candidate and a baseline callable with the keywords their comparison needs
(:class:`ModelPair`); the ``kernel_ab`` fixture (``compare_modules``, ``compare_training_steps``,
``compare_generation``) times them with the pairing, statistics, modes, report rows and gate of any comparison.
Outputs are compared before timing (a forward's outputs, a first training step's losses, generated tokens) under
the policy of their dtype unless ``check=`` says otherwise.

>>> import torch
>>> a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
>>> b.load_state_dict(a.state_dict())
<All keys matched successfully>
>>> pair = forward_pair(a, b, (torch.randn(2, 4),))
>>> torch.equal(pair.candidate(), pair.baseline())
True
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

from .outputs import brief_value


@dataclass(frozen=True)
class ModelPair:
    """The two callables of a model comparison, the comparison keywords they need, and notes for its report row."""

    candidate: Callable[[], Any]
    baseline: Callable[[], Any]
    keywords: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def _require_module(model: Any, side: str) -> None:
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{side} must be a torch.nn.Module, got {brief_value(model)}")


def _arguments(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A model's call arguments: a tuple (positional), a dict (keywords) or one value (the only argument)."""
    if isinstance(inputs, tuple):
        return inputs, {}
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if callable(inputs) and not hasattr(inputs, "shape"):
        raise TypeError("inputs of a model comparison are the model's arguments (a tensor, a tuple of arguments or a "
                        f"dict of keyword arguments), got a callable {brief_value(inputs)}")
    return (inputs,), {}


def forward_pair(model_a: Any, model_b: Any, inputs: Any, *, grad: bool = False) -> ModelPair:
    """A forward pass of each model on the same ``inputs`` (a tensor, a tuple of arguments or a dict of keyword
    arguments), under ``torch.no_grad()`` unless ``grad``. The modules are called as they are: put them in
    ``.eval()`` for inference (dropout or batch-norm updates in training mode change outputs between calls).

    >>> import torch
    >>> forward_pair(torch.nn.Linear(2, 2), "not a module", torch.ones(1, 2))
    Traceback (most recent call last):
    ...
    TypeError: baseline must be a torch.nn.Module, got str 'not a module'
    """
    import torch

    _require_module(model_a, "candidate")
    _require_module(model_b, "baseline")
    args, kwargs = _arguments(inputs)

    def run(model: Any) -> Callable[[], Any]:
        def forward() -> Any:
            with torch.set_grad_enabled(grad):
                return model(*args, **kwargs)

        return forward

    return ModelPair(run(model_a), run(model_b), notes=(
        f"model forward: each side one call of its module{' with gradients' if grad else ' under torch.no_grad()'}",))


def training_pair(
    model_a: Any, model_b: Any, inputs: Any, loss: Callable[[Any], Any],
    optimizer: Callable[[Any], Any] | None = None,
) -> ModelPair:
    """One training step a call (zero the gradients, forward, ``loss(output)``, backward, optimizer step) on each
    side's own deep copy of its module and its own optimizer (``optimizer(parameters)``; default SGD, lr 1e-3),
    so the sides never share weights or optimizer state and the given modules are left unchanged. A call returns
    the step's loss (detached): the first steps' losses are compared before timing, which is what two
    configurations of one model (the same weights) must agree on; the loss changes every step, so the check that
    an output is the same after timing is off.

    >>> import torch
    >>> model = torch.nn.Linear(3, 1)
    >>> before = model.weight.detach().clone()
    >>> x, y = torch.randn(8, 3), torch.randn(8, 1)
    >>> pair = training_pair(model, model, (x,), loss=lambda out: torch.nn.functional.mse_loss(out, y))
    >>> first, second = pair.candidate(), pair.candidate()
    >>> bool(second < first), torch.equal(model.weight, before)
    (True, True)
    """
    import torch

    _require_module(model_a, "candidate")
    _require_module(model_b, "baseline")
    if not callable(loss):
        raise TypeError(f"loss must be a callable of the model's output returning a scalar tensor, got "
                        f"{brief_value(loss)}")
    make_optimizer = optimizer or (lambda parameters: torch.optim.SGD(parameters, lr=1e-3))
    args, kwargs = _arguments(inputs)

    def stepper(model: Any, side: str) -> Callable[[], Any]:
        own = copy.deepcopy(model)  # its own weights: the given module and the other side stay untouched
        own.train()
        opt = make_optimizer(own.parameters())
        if not hasattr(opt, "step") or not hasattr(opt, "zero_grad"):
            raise TypeError(f"optimizer must be a callable of the parameters returning a torch optimizer, got "
                            f"{brief_value(opt)} for the {side}")

        def step() -> Any:
            opt.zero_grad(set_to_none=True)
            value = loss(own(*args, **kwargs))
            value.backward()
            opt.step()
            return value.detach()

        return step

    return ModelPair(stepper(model_a, "candidate"), stepper(model_b, "baseline"), keywords={"check_output": False},
                     notes=("model training step: each call is one optimizer step (forward, loss, backward, step) "
                            "on the side's own copy of the weights and optimizer state; times are per step",))


def generation_pair(generate_a: Callable[[], Any], generate_b: Callable[[], Any], tokens: int) -> ModelPair:
    """Generation of ``tokens`` new tokens a call by each side's zero-argument callable (which owns its model and
    KV cache, e.g. ``lambda: model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)``);
    the generated ids are compared before timing (exactly, for integer tensors). The comparison's speedup is the
    ratio of tokens per second (:func:`tokens_per_second`).

    >>> generation_pair(lambda: 1, lambda: 1, tokens=0)
    Traceback (most recent call last):
    ...
    ValueError: tokens must be the whole number of new tokens each call generates (1 or more), got 0
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be the whole number of new tokens each call generates (1 or more), got "
                         f"{tokens!r}")
    for fn, side in ((generate_a, "candidate"), (generate_b, "baseline")):
        if not callable(fn):
            raise TypeError(f"{side} must be a zero-argument callable that generates {tokens} tokens, got "
                            f"{brief_value(fn)}")
    return ModelPair(generate_a, generate_b, notes=(f"model generation: {tokens} new tokens a call",))


def tokens_per_second(tokens: int, candidate_ms: float, baseline_ms: float) -> tuple[float, float]:
    """Each side's tokens per second from its median milliseconds per call of ``tokens`` tokens.

    >>> tokens_per_second(32, 64.0, 80.0)
    (500.0, 400.0)
    """
    return tokens / (candidate_ms * 1e-3), tokens / (baseline_ms * 1e-3)
