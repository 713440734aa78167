"""See attention: the textbook walk-through, attention maps of real models, the cost curve.

- `walkthrough` / `render` / `cost`: the formula on real numbers (`qkv explain`);
- `AttentionMap` (from any weights, or `model_attention` on a transformers encoder), `summary`,
  and the pictures `attention_grid`, `token_heads`, `write_viewer` (`qkv attend`);
- `bench.measure` / `bench.table` / `cost_plot`: time and memory against N (`qkv bench`);
- `flash_steps`: FlashAttention's tiled online softmax as data, step by step (`qkv explain
  --flash`); `specific_head`: which head links one word to another, by specificity;
- `demo.run`: all of it into one folder (`qkv demo`).

Heavy dependencies (matplotlib, transformers, tqdm) are imported inside the functions that
need them, so importing this package costs only torch.
"""

from . import bench
from .attend import (
    AttendError,
    AttentionMap,
    load_encoder,
    load_minilm,
    model_attention,
    summary,
)
from .explain import Walkthrough, cost, render, walkthrough
from .figures import attention_grid, cost_plot, token_heads
from .flash import FlashStep, FlashSteps, flash_steps
from .specific import specific_head
from .viewer import viewer_html, write_viewer

__all__ = [
    "AttendError",
    "AttentionMap",
    "FlashStep",
    "FlashSteps",
    "Walkthrough",
    "attention_grid",
    "bench",
    "cost",
    "cost_plot",
    "flash_steps",
    "load_encoder",
    "load_minilm",
    "model_attention",
    "render",
    "specific_head",
    "summary",
    "token_heads",
    "viewer_html",
    "walkthrough",
    "write_viewer",
]
