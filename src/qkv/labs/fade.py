"""How much a model's answer still depends on an input d positions back: the lab's view of an
RNN forgetting, measured in a second on the models it has just trained.

For the recall task's query at position n − 1 and the key/value pair at n − 1 − d, the
dependence is the gradient norm of the answer's logit with respect to that pair's input,

    dependence(d) = mean over test sequences of ‖∂ logit_answer / ∂ x[n − 1 − d]‖,

reported relative to the shortest distance. An LSTM reaches the pair through d steps of its
recurrence, and each step multiplies the gradient by the step's Jacobian, so its dependence
fades with d (the vanishing gradient: what it no longer responds to, it has forgotten, and
cannot learn to use). Attention reaches every position in one step: its dependence does not
fade. Unlike accuracy, this shows even where training was too short for the LSTM to learn the
task, and it is what keeps it from learning long distances.
"""

from __future__ import annotations

import torch
from torch import nn

from . import recall

FADED = 0.1  # the LSTM "forgets": its dependence at the longest distance ≤ this × the shortest's
KEPT = 0.5  # attention "keeps": its dependence at the longest distance ≥ this × the shortest's


def dependence(
    model: nn.Module,
    task: recall.Task,
    distances: tuple[int, ...],
    *,
    length: int,
    samples: int,
    generator: torch.Generator,
) -> list[float]:
    """`dependence(d)` for each distance (see the module docstring), in the model's eval mode;
    the model's parameters are left without gradients."""
    out = []
    for d in distances:
        b = recall.make_batch(task, samples, length, d, generator)
        x = b.x.clone().requires_grad_(True)  # (samples, length, width)
        logits = model(x)  # (samples, values)
        (grad,) = torch.autograd.grad(logits.gather(1, b.answer[:, None]).sum(), x)
        out.append(grad[:, length - 1 - d].norm(dim=-1).mean().item())
    return out


def relative(values: list[float]) -> list[float]:
    """Each value over the first (the shortest distance's); all 0 if that is 0."""
    first = values[0]
    return [v / first if first > 0 else 0.0 for v in values]


def holds(lstm: list[float], attention: list[float]) -> bool:
    """The claim on these numbers: the LSTM's dependence faded by the longest distance,
    attention's did not."""
    return relative(lstm)[-1] <= FADED and relative(attention)[-1] >= KEPT
