"""The chapter's claims as experiments a learner runs in a minute (`qkv lab NAME`).

- `rnn`: an LSTM needs N sequential steps and forgets with distance; attention needs one
  step and reaches every position directly;
- `scale`: without 1/√d_k the scores' variance grows with d_k, the softmax saturates, its
  gradient vanishes and training stalls;
- `routing`: how far information travels per layer in a CNN, an LSTM and attention, and where
  a trained attention model reads from;
- `sparse`: at the same budget of keys per query, a sliding window loses an answer far back
  that blocks chosen by the content (`qkv.sparse.select_blocks`) keep;
- `recall`: the synthetic recall task and the tiny models the labs train;
- `figures`: their PNGs; `common`: progress bar, threads, languages; `command`: `qkv lab`.

Attention rollout (where information ends up after all layers) is `qkv.inspect.rollout`.
Each lab module has `QUICK` and `FULL` presets, `run`, `summary` and `figure`; only torch is
imported here (matplotlib and tqdm inside the functions that draw and report progress).
"""

LABS = ("rnn", "scale", "routing", "sparse")
