"""A model's gradients replayed without computing, in the order a real backward pass makes them
ready: what the cluster benchmark (``bench.cluster``) communicates.

``backward_order`` records once, from one real backward pass, the order in which the model's
parameters get their gradients (their post-accumulate-grad hooks); ``make_replay`` builds a tiny
autograd graph whose backward hands each parameter a fixed gradient in that order with nothing
computed in between, so the communicators' hooks (and DDP's) fire as in training while the CPU
does almost nothing but communicate.
"""

from __future__ import annotations

from typing import Any, Sequence

from gradientflow_repro.config import compose


def model_spec(experiment: str = "digits_cpu", overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The experiment's model as ``build_model`` takes it (name, classes, image size, width, dropout),
    read from its composed configuration, so the bench follows the experiment."""
    cfg = compose([f"+experiment={experiment}", *overrides])
    return {"experiment": experiment, "name": cfg.model.name, "num_classes": cfg.data.num_classes,
            "image_size": cfg.data.image_size, "width": cfg.model.width, "dropout": cfg.model.dropout}


def build(spec: dict[str, Any]) -> Any:
    from gradientflow_repro.models import build_model

    return build_model(spec["name"], spec["num_classes"], spec["image_size"], spec["width"], spec["dropout"])


def backward_order(spec: dict[str, Any]) -> list[int]:
    """Indices of the model's trainable parameters in the order one real backward pass completes
    their gradients (post-accumulate-grad hooks): the order the replay releases them in."""
    import torch

    torch.manual_seed(0)
    model = build(spec)
    params = [p for p in model.parameters() if p.requires_grad]
    order: list[int] = []
    handles = [p.register_post_accumulate_grad_hook(lambda p, i=i: order.append(i)) for i, p in enumerate(params)]
    images = torch.randn(2, 3, spec["image_size"], spec["image_size"])
    labels = torch.randint(0, spec["num_classes"], (2,))
    torch.nn.functional.cross_entropy(model(images), labels).backward()
    for handle in handles:
        handle.remove()
    if sorted(order) != list(range(len(params))):
        raise RuntimeError(f"backward completed {len(order)} of {len(params)} gradients once each")
    return order


def make_replay(model: Any, order: Sequence[int], gradients: Sequence[Any]) -> Any:
    """A module over ``model`` (same parameters, same order) whose forward builds a chain of
    autograd nodes and returns a scalar: its backward hands parameter ``order[0]`` its gradient
    first, then ``order[1]``, ... with nothing computed in between. Each node's gradient goes to the
    parameter's AccumulateGrad before the chain moves on (autograd runs AccumulateGrad nodes first),
    so post-accumulate-grad hooks and DDP's hooks fire one by one in backward order."""
    import torch

    class Release(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, carry: torch.Tensor, param: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
            ctx.gradient = gradient
            return carry.clone()

        @staticmethod
        def backward(ctx: Any, carried: torch.Tensor) -> tuple:
            return carried, ctx.gradient, None

    class Replay(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model  # its parameters and buffers are this module's, in the same order
            self.params = [p for p in model.parameters() if p.requires_grad]

        def forward(self) -> torch.Tensor:
            carry = torch.zeros(())
            for index in reversed(order):  # the last node applied is the first backward runs
                carry = Release.apply(carry, self.params[index], gradients[index])
            return carry

    return Replay()

