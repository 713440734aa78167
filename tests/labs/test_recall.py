"""The recall task puts the answer where it says, and the models have the sizes they claim."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from qkv.labs import recall

TASK = recall.Task(keys=5, values=7)


@pytest.mark.parametrize("length,distance", [(2, 1), (9, 1), (9, 8), (40, 17)])
def test_the_answer_sits_distance_positions_before_the_query(length, distance):
    b = recall.make_batch(TASK, 64, length, distance, torch.Generator().manual_seed(length))
    rows = torch.arange(64)
    assert b.x.shape == (64, length, TASK.width)
    assert (b.source == length - 1 - distance).all()
    query = b.keys[:, -1]
    assert (b.keys[rows, b.source] == query).all()
    # the queried key occurs nowhere else before the query: only that pair can answer
    before = b.keys[:, :-1] == query[:, None]
    assert (before.sum(-1) == 1).all()
    assert (b.answer == b.values[rows, b.source]).all()


def test_the_encoding_is_key_value_and_query_flag():
    b = recall.make_batch(TASK, 16, 12, 5, torch.Generator().manual_seed(0))
    K, V = TASK.keys, TASK.values
    assert torch.equal(b.x[:, :, :K], F.one_hot(b.keys, K).float())
    assert torch.equal(b.x[:, :-1, K : K + V], F.one_hot(b.values[:, :-1], V).float())
    assert (b.x[:, -1, K : K + V] == 0).all() and (b.values[:, -1] == -1).all()
    assert (b.x[:, -1, -1] == 1).all() and (b.x[:, :-1, -1] == 0).all()


def test_a_distance_per_sequence():
    d = torch.tensor([1, 3, 7, 2])
    b = recall.make_batch(TASK, 4, 8, d, torch.Generator().manual_seed(1))
    assert b.source.tolist() == [6, 4, 0, 5]
    assert (b.answer == b.values[torch.arange(4), b.source]).all()


@pytest.mark.parametrize(
    "length,distance,message",
    [(1, 1, "length must be at least 2"), (8, 8, "distance must be in 1..7"), (8, 0, "1..7")],
)
def test_bad_batches(length, distance, message):
    with pytest.raises(ValueError, match=message):
        recall.make_batch(TASK, 2, length, distance, torch.Generator())


def test_lstm_width_fits_the_parameter_budget():
    for budget in (500, 13_832, 40_000):
        h = recall.lstm_hidden_for(budget, TASK.width, TASK.values)
        model = recall.LSTMReader(TASK.width, h, TASK.values)
        assert recall.parameters(model) == recall.parameters_of_lstm(h, TASK.width, TASK.values)
        assert recall.parameters(model) <= budget
        assert recall.parameters_of_lstm(h + 1, TASK.width, TASK.values) > budget


@pytest.mark.parametrize("scale", [None, 1.0, 0.3])
def test_attention_reader_is_the_formula_at_the_query(scale):
    torch.manual_seed(0)
    model = recall.AttentionReader(TASK.width, 16, TASK.values, d_k=8, scale=scale).double()
    x = recall.make_batch(TASK, 3, 6, 2, torch.Generator().manual_seed(2)).x.double()
    logits, w = model(x, return_weights=True)
    h = model.norm(model.inp(x))
    q, k, v = model.W_q(h[:, -1]), model.W_k(h), model.W_v(h)
    s = 8**-0.5 if scale is None else scale
    a = torch.einsum("bd,bnd->bn", q, k).mul(s).softmax(-1)
    torch.testing.assert_close(w, a)
    torch.testing.assert_close(logits, model.out(torch.einsum("bn,bnd->bd", a, v)))
    assert logits.shape == (3, TASK.values)


def test_training_is_repeatable_and_logs_every_step():
    def once():
        torch.manual_seed(0)
        model = recall.AttentionReader(TASK.width, 8, TASK.values)
        g = torch.Generator().manual_seed(3)
        return recall.train(model, TASK, 5, max_length=12, batch_size=4, generator=g)

    first = once()
    assert len(first) == 5 and first == once()
