"""Decoding benchmark: `qkv.nn.Transformer.generate` through KV caches against a full
re-forward per token, and against transformers' own `generate` on a model of the same shape.

What it measures, in one run on one machine (fp32, CPU, batch 1, greedy decoding):

- `qkv cache`: `Transformer.generate(prompt, new_tokens)`: the prompt is run once, then each new
  token is one forward of one position through per-layer `qkv.nn.KVCache`s;
- `re-forward`: the same tokens produced the naive way, every step running the whole sequence
  (prompt + what was generated) through the model and keeping the last logits;
- `transformers`: a `LlamaForCausalLM` of the same width, depth, heads and vocabulary with random
  weights, `generate(..., do_sample=False)` with its own dynamic cache (skipped, with a note,
  when transformers is not installed).

Per token = (time − time of the prompt's forward) / new tokens, the prompt's forward measured in
the same run; rounds interleave the implementations (benchmarks/_harness.py). The target of
issue 4: the cache is ≥ 5× faster per token than a full re-forward at a 512-token prompt.

    python benchmarks/decode.py --out docs/benchmarks.md   # writes its section
    python benchmarks/decode.py --quick                    # smoke test, prints
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H
from qkv import nn as qnn

VOCAB, D_MODEL, LAYERS, HEADS, KV_HEADS = 8192, 512, 4, 8, 2


def _model() -> qnn.Transformer:
    torch.manual_seed(H.SEED)
    return qnn.Transformer(
        VOCAB,
        D_MODEL,
        LAYERS,
        HEADS,
        KV_HEADS,
        max_len=4096,
        positions="rope",
        ffn="swiglu",
        norm="rmsnorm",
    ).eval()


def _hf_model():
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as err:
        return None, f"transformers not installed ({err})"
    torch.manual_seed(H.SEED)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=D_MODEL,
        intermediate_size=-(-(8 * D_MODEL // 3) // 8) * 8,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(cfg).eval(), None


@torch.no_grad()
def _reforward(model: qnn.Transformer, ids: torch.Tensor, new: int) -> torch.Tensor:
    for _ in range(new):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def run(prompt_lens: list[int], new_tokens: int, repeats: int) -> list[dict]:
    model = _model()
    hf, hf_note = _hf_model()
    rows = []
    for n in prompt_lens:
        ids = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(n))
        runners = {
            "prompt forward": lambda ids=ids: model(ids),
            "qkv cache": lambda ids=ids: model.generate(ids, new_tokens, temperature=0),
            "re-forward": lambda ids=ids: _reforward(model, ids, new_tokens),
        }
        if hf is not None:
            runners["transformers"] = lambda ids=ids: hf.generate(
                ids,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        with torch.no_grad():
            times = H.interleave(runners, repeats, f"N={n}")
        med = {k: statistics.median(v) for k, v in times.items()}
        prompt = med["prompt forward"]
        per_token = {k: (med[k] - prompt) / new_tokens for k in runners if k != "prompt forward"}
        rows.append(
            {
                "prompt": n,
                "new_tokens": new_tokens,
                "prompt_forward_s": prompt,
                "per_token_s": per_token,
                "hf_note": hf_note,
            }
        )
    return rows


def render(rows: list[dict], info: dict, command: str, runtime_s: float) -> str:
    lines = [
        "## Decoding through the KV cache",
        "",
        f"- **Date:** {info['date_utc']}; **machine:** {info['cpu_model']}, nproc {info['nproc']},"
        f" torch {info['torch']} ({info['torch_threads']} threads)",
        f"- **Command:** `{command}` (runtime {runtime_s / 60:.1f} min)",
        f"- **Model:** `qkv.nn.Transformer` vocab {VOCAB}, d_model {D_MODEL}, {LAYERS} layers, "
        f"{HEADS} heads / {KV_HEADS} KV heads, RoPE, SwiGLU, RMSNorm, fp32, batch 1, greedy; "
        "`transformers`: a random-weight `LlamaForCausalLM` of the same shape with its own cache.",
        "- **Per token** = (median time of the whole generation − median time of the prompt's "
        "forward) / new tokens, all measured in the same interleaved run.",
        "",
        "| prompt | new tokens | prompt forward ms | qkv cache ms/token | re-forward ms/token "
        "| transformers ms/token | re-forward ÷ cache |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        pt = r["per_token_s"]
        hf = pt.get("transformers")
        lines.append(
            f"| {r['prompt']} | {r['new_tokens']} | {r['prompt_forward_s'] * 1e3:.1f} | "
            f"{pt['qkv cache'] * 1e3:.2f} | {pt['re-forward'] * 1e3:.2f} | "
            f"{H.fmt(hf and hf * 1e3, '.2f')} | {pt['re-forward'] / pt['qkv cache']:.1f}× |"
        )
    notes = {r["hf_note"] for r in rows if r["hf_note"]}
    lines += [f"\n{n}" for n in notes]
    target = next((r for r in rows if r["prompt"] == 512), None)
    if target is not None:
        ratio = target["per_token_s"]["re-forward"] / target["per_token_s"]["qkv cache"]
        lines += [
            "",
            "| target | threshold | measured | result |",
            "|:---|:---|---:|:---|",
            f"| cache vs full re-forward per token, prompt 512 | ≥ 5× | {ratio:.1f}× | "
            f"{'PASS' if ratio >= 5 else 'FAIL'} |",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="prompt 128, 8 new tokens, 1 round")
    ap.add_argument("--out", type=Path, help="write the decode section of this Markdown file")
    args = ap.parse_args()
    start = time.perf_counter()
    rows = run([128], 8, 1) if args.quick else run([128, 512, 2048], 32, 3)
    command = "python benchmarks/decode.py" + (" --quick" if args.quick else "")
    if args.out:
        command += f" --out {args.out}"
    text = render(rows, H.machine_info(), command, time.perf_counter() - start)
    if args.out:
        H.write_section(args.out, "decode", text)
        H.progress(f"wrote the decode section of {args.out}")
    else:
        print(text)


if __name__ == "__main__":
    main()
