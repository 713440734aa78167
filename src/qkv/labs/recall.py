"""The recall task and the two tiny models the labs train on it.

The task: a sequence of (key, value) pairs ends with a query key; the answer is the value that
was paired with that key, `distance` positions before the query.

    position   0       1       …   n−1−d   …   n−2     n−1
    key        k₀      k₁          q           k_{n−2} q      ← the query (no value)
    value      v₀      v₁          v*          v_{n−2} −      answer: v*

The queried key occurs exactly once before the query (every other position holds one of the
other keys) and values are uniform, so nothing but the pair at distance d gives the answer.
An LSTM, which reads left to right into a fixed-size state, must keep every key's latest value
for as long as it may be asked; attention can compare the query with every key directly.

Each position is encoded as `one_hot(key, K) ⊕ one_hot(value, V) ⊕ [is the query]`:
`x (B, n, K + V + 1)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..functional import attention


@dataclass(frozen=True)
class Task:
    """The recall task's vocabulary."""

    keys: int = 4  # K distinct keys
    values: int = 8  # V distinct values (chance accuracy 1/V)

    @property
    def width(self) -> int:
        """Features per position: key one-hot, value one-hot, query flag."""
        return self.keys + self.values + 1


@dataclass(frozen=True)
class Batch:
    x: torch.Tensor  # (B, n, K + V + 1) the encoded sequences
    answer: torch.Tensor  # (B,) the value to recall
    source: torch.Tensor  # (B,) the position that holds it: n − 1 − distance
    keys: torch.Tensor  # (B, n) the key at each position (the query's at n − 1)
    values: torch.Tensor  # (B, n) the value at each position (−1 at the query)


def make_batch(
    task: Task,
    size: int,
    length: int,
    distance: int | torch.Tensor,
    generator: torch.Generator,
) -> Batch:
    """`size` sequences of `length` positions; the answer sits `distance` (an int, or one per
    sequence `(size,)`) positions before the query at `length − 1`."""
    if length < 2:
        raise ValueError(f"length must be at least 2 (a pair and the query), got {length}")
    d = torch.as_tensor(distance).expand(size).long()
    if int(d.min()) < 1 or int(d.max()) > length - 1:
        raise ValueError(f"distance must be in 1..{length - 1} for length {length}")
    query = torch.randint(0, task.keys, (size,), generator=generator)
    other = torch.randint(0, task.keys - 1, (size, length), generator=generator)
    keys = other + (other >= query[:, None]).long()  # any key but the queried one
    values = torch.randint(0, task.values, (size, length), generator=generator)
    rows = torch.arange(size)
    source = length - 1 - d
    keys[rows, source] = query
    keys[:, -1] = query
    values[:, -1] = -1
    x = torch.cat(
        [
            F.one_hot(keys, task.keys).float(),
            F.one_hot(values.clamp(min=0), task.values).float(),
            torch.zeros(size, length, 1),
        ],
        dim=-1,
    )  # (B, n, K + V + 1)
    x[:, -1, task.keys : task.keys + task.values] = 0.0
    x[:, -1, -1] = 1.0
    return Batch(x, values[rows, source], source, keys, values)


class AttentionReader(nn.Module):
    """One attention layer that answers from the last position:
    `h = LayerNorm(x W_in)`, `q = h_last W_q`, `K = h W_k`, `V = h W_v`,
    `out = softmax(q Kᵀ · scale) V` (through `qkv.attention`), then a linear read-out.

    `W_q`, `W_k` start with entries of variance 1/d_model, so q and k have unit-variance
    entries as the chapter assumes; `scale=None` is 1/√d_k."""

    def __init__(
        self,
        d_in: int,
        d_model: int,
        n_out: int,
        d_k: int | None = None,
        scale: float | None = None,
    ):
        super().__init__()
        d_k = d_model if d_k is None else d_k
        self.scale = scale
        self.inp = nn.Linear(d_in, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.W_q = nn.Linear(d_model, d_k, bias=False)
        self.W_k = nn.Linear(d_model, d_k, bias=False)
        self.W_v = nn.Linear(d_model, d_model, bias=False)
        self.out = nn.Linear(d_model, n_out)
        for w in (self.W_q, self.W_k):
            nn.init.normal_(w.weight, std=d_model**-0.5)

    def forward(self, x: torch.Tensor, return_weights: bool = False):
        """`x (B, n, d_in)` → logits `(B, n_out)` (and the query's weights `(B, n)`)."""
        h = self.norm(self.inp(x))  # (B, n, d_model)
        q = self.W_q(h[:, -1:]).unsqueeze(1)  # (B, 1, 1, d_k): only the query asks
        k = self.W_k(h).unsqueeze(1)  # (B, 1, n, d_k)
        v = self.W_v(h).unsqueeze(1)  # (B, 1, n, d_model)
        res = attention(q, k, v, scale=self.scale, return_weights=return_weights)
        if isinstance(res, tuple):  # (out, weights)
            return self.out(res[0][:, 0, 0]), res[1][:, 0, 0]  # (B, n_out), (B, n)
        return self.out(res[:, 0, 0])  # (B, n_out)


class LSTMReader(nn.Module):
    """A one-layer LSTM read left to right; the answer is read out of its last state."""

    def __init__(self, d_in: int, hidden: int, n_out: int):
        super().__init__()
        self.rnn = nn.LSTM(d_in, hidden, batch_first=True)
        self.out = nn.Linear(hidden, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (B, n, d_in)` → logits `(B, n_out)`."""
        y, _ = self.rnn(x)  # (B, n, hidden)
        return self.out(y[:, -1])


def parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def lstm_hidden_for(budget: int, d_in: int, n_out: int) -> int:
    """The largest LSTM width whose `LSTMReader` has at most `budget` parameters."""
    hidden = 1
    while parameters_of_lstm(hidden + 1, d_in, n_out) <= budget:
        hidden += 1
    return hidden


def parameters_of_lstm(hidden: int, d_in: int, n_out: int) -> int:
    """4 gates × (input and recurrent weights + two biases), then the read-out."""
    return 4 * hidden * (d_in + hidden + 2) + hidden * n_out + n_out


def train(
    model: nn.Module,
    task: Task,
    steps: int,
    *,
    max_length: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    generator: torch.Generator,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Adam on fresh batches; returns the loss of every step.

    Each step draws one length n log-uniformly in [8, max_length] (short sequences are cheap and
    teach the mechanism, long ones test it) and, per sequence, a distance uniform in 1..n−1."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    lo, hi = math.log(min(8, max_length)), math.log(max_length)
    losses = []
    model.train()
    for step in range(steps):
        u = torch.rand((), generator=generator).item()
        n = max(2, round(math.exp(lo + (hi - lo) * u)))
        d = torch.randint(1, n, (batch_size,), generator=generator)
        b = make_batch(task, batch_size, n, d, generator)
        loss = F.cross_entropy(model(b.x), b.answer)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses


@torch.no_grad()
def accuracy(
    model: nn.Module,
    task: Task,
    distance: int,
    *,
    length: int,
    samples: int,
    generator: torch.Generator,
) -> float:
    """The fraction of `samples` fresh sequences of `length` answered right at `distance`."""
    b = make_batch(task, samples, length, distance, generator)
    return (model(b.x).argmax(-1) == b.answer).float().mean().item()
