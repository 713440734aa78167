"""Exact attention over a sequence sharded across processes (`torch.distributed`).

    import qkv.distributed as qd
    q = qd.shard(q_full, dim=2, layout="zigzag")      # this rank's (B, H, N/P, D), same for k, v
    out = qd.ring_attention(q, k, v, causal=True, layout="zigzag")   # this rank's shard of out
    full = qd.unshard(out, dim=2, layout="zigzag")     # every rank gets the whole output

- `ring_attention`: key/value blocks travel a ring of ranks, partial results merge by their
  log-sum-exps; a second ring carries dK/dV home in the backward. Any P, grouped-query heads,
  causal, structured masks (empty blocks skipped).
- `ulysses_attention`: all-to-all from sequence shards to head shards and back (H % P == 0).
- `shard` / `unshard` / `positions`: cut, glue and locate shards in the `"contiguous"` or
  `"zigzag"` layout (zigzag balances causal work).
- `SequenceParallel` / `parallelize`: run `qkv.nn.MultiHeadAttention` (and so a
  `TransformerBlock`) on a sharded sequence.
- `counters` / `reset_counters`: bytes sent and tiles computed by this process;
  `tiles_per_rank`: the work balance of a layout without running it.

Every collective call first checks, with one small all-gather, that all ranks passed the same
problem; if not, every rank raises the same error instead of hanging. Not imported by
`import qkv`; `import qkv.distributed` when you need it.
"""

from ._blocks import tiles_per_rank
from ._comm import Counters, counters, reset_counters
from .parallel import SequenceParallel, parallelize
from .ring import ring_attention
from .sharding import LAYOUTS, positions, shard, unshard
from .ulysses import ulysses_attention

__all__ = [
    "LAYOUTS",
    "Counters",
    "SequenceParallel",
    "counters",
    "parallelize",
    "positions",
    "reset_counters",
    "ring_attention",
    "shard",
    "tiles_per_rank",
    "ulysses_attention",
    "unshard",
]
