"""qkv in the vision towers of transformers' Qwen2-VL and Qwen2.5-VL: all images in one call.

    from qkv.integrations.hf_vision import use_packed_vision_attention
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(name)
    use_packed_vision_attention(model)        # returns how many attention modules were replaced

**Why a drop-in module, not an attention backend.** A vision block of these models calls its
attention module with the packed patches of all images `(N, dim)` and `cu_seqlens` (images for
the full-attention blocks, 112-pixel windows for Qwen2.5-VL's windowed blocks). The module hands
`cu_seqlens` to the attention function only when `is_flash_attention_requested(config)` is true,
which is a test of the *name*: `"flash" in config._attn_implementation`. Every other
implementation, `attn_implementation="qkv"` included, gets one call per image or window from a
Python loop (`torch.split` on the lengths, one call each, `torch.cat`). A qkv function registered
under a name containing "flash" would receive the packed sequence, but it cannot be switched on
cleanly: `set_attn_implementation` / `from_pretrained` treat any such name as a flash-attention
kernel and try to load it from the Hub (a `ValueError` without one), and the same name test
changes other code paths (mask construction, generation's position handling) for every model
that reads it. So qkv replaces the vision attention *module* instead:

- `PackedVisionAttention` takes the same arguments as transformers' `VisionAttention` (Qwen2-VL)
  and `Qwen2_5_VLVisionAttention` (Qwen2.5-VL) and keeps their parameters under the same names
  (`qkv`, `proj`: the very same `nn.Linear` objects, so `state_dict` keys and weights are
  unchanged). Its forward projects, applies the 2-D rotary embedding transformers passes in, and
  runs all images or windows in ONE `qkv.vision.packed_attention` call (forward and backward).
- `use_packed_vision_attention(model)` swaps every such module of one model instance; nothing
  global changes, and other models (and the language model of this one) are untouched.

Not carried over: `output_attentions` (transformers records the weights from its own attention
class; these modules return none).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from ..vision.mrope import apply_rotary
from ..vision.packed import LAYOUTS, packed_attention

# transformers' vision attention classes this module replaces: (module, class name).
KNOWN = (
    ("transformers.models.qwen2_vl.modeling_qwen2_vl", "VisionAttention"),
    ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLVisionAttention"),
)

__all__ = ["KNOWN", "PackedVisionAttention", "use_packed_vision_attention"]


class PackedVisionAttention(nn.Module):
    """Multi-head self-attention over packed images, the drop-in for the vision attention of
    transformers' Qwen2-VL / Qwen2.5-VL.

    Args:
        dim: the width of the hidden states; `num_heads` divides it.
        num_heads: attention heads.
        layout: how `packed_attention` lays the segments out ("auto", "padded", "varlen").
    """

    def __init__(self, dim: int, num_heads: int, layout: str = "auto"):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        if dim % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide dim={dim}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.dim, self.num_heads, self.layout = dim, num_heads, layout
        self.head_dim = dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    @classmethod
    def from_module(cls, module: nn.Module, layout: str = "auto") -> PackedVisionAttention:
        """The drop-in for a transformers vision attention `module`, sharing its `qkv` and
        `proj` layers (the same objects: no copy, same parameters)."""
        for attr in ("qkv", "proj", "num_heads"):
            if not hasattr(module, attr):
                raise TypeError(f"{type(module).__name__} has no {attr!r}: not a vision attention")
        # transformers' vision attentions: two nn.Linear layers and a plain int attribute
        qkv, proj = cast(nn.Linear, module.qkv), cast(nn.Linear, module.proj)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.dim, new.num_heads, new.layout = qkv.in_features, cast(int, module.num_heads), layout
        new.head_dim = new.dim // new.num_heads
        new.scaling = float(getattr(module, "scaling", new.head_dim**-0.5))
        new.qkv, new.proj = qkv, proj
        new.train(module.training)
        return new

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, layout={self.layout!r}"

    def forward(
        self,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        max_seqlen: int | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """`hidden_states (N, dim)` of all images packed → `(N, dim)`; patches attend within
        their segment of `cu_seqlens`; `position_embeddings` is the rotary `(cos, sin)`, each
        `(N, head_dim)`. `max_seqlen` and other keyword arguments are accepted and unused."""
        n = hidden_states.shape[0]
        # (N, 3·dim) → three (N, H, head_dim)
        q, k, v = self.qkv(hidden_states).reshape(n, 3, self.num_heads, -1).unbind(1)
        if position_embeddings is not None:
            cos, sin = position_embeddings
            q, k = apply_rotary(q, cos, sin, dim=-2), apply_rotary(k, cos, sin, dim=-2)
        out = packed_attention(  # the tower's own projections: finite
            q, k, v, cu_seqlens, scale=self.scaling, layout=self.layout, finite_inputs=True
        )
        return self.proj(out.reshape(n, -1))


def _is_known(module: nn.Module) -> bool:
    return (type(module).__module__, type(module).__name__) in KNOWN


def use_packed_vision_attention(model: nn.Module, layout: str = "auto") -> int:
    """Replace every Qwen2-VL / Qwen2.5-VL vision attention module of `model` (the whole model or
    its vision tower) by a `PackedVisionAttention` sharing its weights. Returns the number
    replaced; raises ValueError when there is none."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    targets = [
        (name, module) for name, module in model.named_modules() if _is_known(module) and name
    ]
    if not targets:
        known = ", ".join(cls for _, cls in KNOWN)
        raise ValueError(f"{type(model).__name__} has no vision attention module ({known})")
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedVisionAttention.from_module(module, layout))
    return len(targets)
