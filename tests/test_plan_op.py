"""`qkv.plan.OpPlan`: the plan as a custom op's arguments, the one problem description every
kernel op takes after `(q, k, v)` and reads back inside."""

from __future__ import annotations

import pytest
import torch

from qkv import masks
from qkv.layout import block_layout
from qkv.plan import OpPlan, make_plan

from .helpers import make_qkv

# What an op's plan cannot know, or fixes: the caller's return flags, its rank, a score modifier.
NOT_CARRIED = {"score_mod", "return_lse", "return_weights", "input_rank"}


def _requests():
    g = torch.Generator().manual_seed(0)
    q, k, v = make_qkv(B=2, H=4, Hkv=2, Nq=12, Nk=20, D=8, Dv=6, requires_grad=True)
    window = masks.sliding_window(5)
    return {
        "plain": (q, k, v, {}),
        "causal + rule + dropout": (q, k, v, {"mask": window, "causal": True, "dropout_p": 0.3}),
        "bool mask + scale": (q, k, v, {"mask": torch.rand(2, 1, 12, 20, generator=g) > 0.4,
                                         "scale": 0.7, "finite_inputs": True}),
        "bias": (q, k, v, {"mask": torch.randn(1, 4, 12, 20, generator=g)}),
        "held layout": (q, k, v, {"mask": block_layout(window, 12, 20, block_q=4, block_k=8)}),
        "int seed": (q, k, v, {"dropout_p": 0.1, "dropout_seed": 1234}),
    }  # fmt: skip


@pytest.mark.parametrize("name", list(_requests()))
@pytest.mark.parametrize("grad", [False, True])
def test_an_op_reads_back_the_plan_it_was_given(name, grad):
    q, k, v, kwargs = _requests()[name]
    with torch.set_grad_enabled(grad):
        plan = make_plan(q, k, v, **kwargs)
    op = plan.op_plan()
    assert all(x is None or isinstance(x, (torch.Tensor, bool, int, float)) for x in op)
    back = OpPlan(*tuple(op)).plan(q, k, v)  # as an op gets it: its fields, flat
    for field in plan.__dataclass_fields__:
        if field in NOT_CARRIED:
            continue
        got, want = getattr(back, field), getattr(plan, field)
        if field == "pairs":
            for part in ("q_len", "kv_len", "causal", "rule", "mask", "bias", "layout"):
                assert getattr(got, part) is getattr(want, part), part
        elif field == "dropout_seed" and isinstance(want, int):
            assert got.dtype == torch.int64 and got.dim() == 0 and int(got) == want
        else:
            assert got is want or got == want, field
    assert back.wants_grad is grad
    assert op.alive() == (plan.pairs.rule, plan.pairs.layout)


def test_every_op_takes_the_op_plan_right_after_q_k_v():
    # One problem description past the op boundary: each op's schema names the OpPlan's fields,
    # in order, after (q, k, v); what follows is the op's own.
    from qkv.kernels.cpu import op as cpu_op
    from qkv.kernels.tiled import op as tiled_op

    fields = list(OpPlan._fields)
    for op in (tiled_op.tiled_forward, tiled_op.tiled_backward, cpu_op.cpu_forward,
               cpu_op.cpu_backward):  # fmt: skip
        names = [a.name for a in op._opoverload._schema.arguments]
        assert names[:3] == ["q", "k", "v"], op
        assert names[3 : 3 + len(fields)] == fields, op
    tail = [a.name for a in cpu_op.cpu_forward._opoverload._schema.arguments][3 + len(fields) :]
    assert tail == list(cpu_op.CpuSettings._fields)
