"""Which head makes one word look at another *specifically*: the answer to "where does 'it'
look?" that a head where every word looks at "cat" cannot give by coincidence.

A head's weight from "it" to "cat" says little on its own: in all-MiniLM-L6-v2's layer 5 head
11 "it" gives "cat" 0.68, and so do "the", "sat" and nearly every other word. The head is
*specific* to the pair when "it" looks at "cat" more than the other words do:

    specificity(layer, head) = A[layer, head, it, cat] − mean over the other words w of
                               A[layer, head, w, cat]

(the other words: the text's words but "it" and "cat" themselves; special tokens left out).
`specific_heads` ranks every head by it; `contrast` asks the same head of a second sentence
whose answer should differ ("… because it was dirty" → "mat"), and `sinks` says how much of the
attention rollout ends on the special tokens, and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .words import is_special as _special


class WordMap(Protocol):
    """What these questions read of an attention map (`qkv.inspect.AttentionMap`; read-only,
    as the frozen map's fields are)."""

    @property
    def words(self) -> list[str]: ...

    @property
    def weights(self) -> torch.Tensor: ...  # (L, H, W, W)

    @property
    def text(self) -> str: ...

    @property
    def heads(self) -> int: ...

    def index(self, word: str) -> int: ...

    def rollout(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class Specific:
    """How specifically one head makes `word` look at `target`."""

    layer: int
    head: int
    weight: float  # A[layer, head, word, target]: what `word` gives `target`
    others: float  # the mean weight the other words give `target` in this head
    specificity: float  # weight − others


def _other_words(amap: WordMap, i: int, j: int) -> list[int]:
    """The words that are neither `i` nor `j` nor a special token."""
    return [x for x, w in enumerate(amap.words) if x not in (i, j) and not _special(w)]


def specific_heads(amap: WordMap, word: str | int, target: str | int, k: int = 3):
    """The `k` heads most specific to `word` → `target`, most specific first:
    `[Specific, ...]`. With no other word to compare against, the weight itself ranks them."""
    i = word if isinstance(word, int) else amap.index(word)
    j = target if isinstance(target, int) else amap.index(target)
    col = amap.weights[:, :, :, j]  # (L, H, W): every word's weight on the target
    others = _other_words(amap, i, j)
    mean = col[:, :, others].mean(-1) if others else torch.zeros_like(col[:, :, i])
    spec = col[:, :, i] - mean  # (L, H)
    vals, flat = spec.flatten().topk(min(k, spec.numel()))
    found = []
    for v, f in zip(vals.tolist(), flat.tolist(), strict=True):
        layer, head = divmod(f, amap.heads)
        found.append(Specific(layer, head, col[layer, head, i].item(), mean[layer, head].item(), v))
    return found


def specific_head(amap: WordMap, word: str | int, target: str | int) -> Specific:
    """The head most specific to `word` → `target` (see `specific_heads`)."""
    return specific_heads(amap, word, target, k=1)[0]


def strongest(amap: WordMap, word: str | int, target: str | int) -> Specific:
    """The head where `word` gives `target` the most weight, with its specificity beside."""
    i = word if isinstance(word, int) else amap.index(word)
    j = target if isinstance(target, int) else amap.index(target)
    col = amap.weights[:, :, :, j]
    layer, head = divmod(int(col[:, :, i].argmax()), amap.heads)
    others = _other_words(amap, i, j)
    mean = col[layer, head, others].mean().item() if others else 0.0
    weight = col[layer, head, i].item()
    return Specific(layer, head, weight, mean, weight - mean)


@dataclass(frozen=True)
class Sinks:
    """Where a word's attention rollout ends after all layers."""

    special: float  # the share on the special tokens ([CLS], [SEP], ...)
    itself: float  # the share on the word itself
    target: float  # the share on the target word
    rank: int  # the target's place among the text's words by rollout (1: first)
    words: int  # how many real words the text has


def sinks(amap: WordMap, word: str | int, target: str | int) -> Sinks:
    """How much of `word`'s rollout ends on special tokens, on itself and on `target`."""
    i = word if isinstance(word, int) else amap.index(word)
    j = target if isinstance(target, int) else amap.index(target)
    final = amap.rollout()[-1, i]  # (W,)
    special = [x for x, w in enumerate(amap.words) if _special(w)]
    real = [x for x in range(len(amap.words)) if x not in special]
    order = sorted(real, key=lambda x: -final[x].item())
    return Sinks(
        final[special].sum().item() if special else 0.0,
        final[i].item(),
        final[j].item(),
        order.index(j) + 1,
        len(real),
    )


TEXT = {
    "en": {
        "which": 'Which head links "{w}" to "{t}"? Chosen by specificity: the weight "{w}" gives '
        '"{t}" minus the mean weight the other words give "{t}".',
        "best": '  layer {l} head {h}: "{w}" → "{t}" {weight:.3f}; the other words → "{t}" '
        "{others:.3f} on average (specificity {spec:+.3f})",
        "same": '  It is also the head where "{w}" gives "{t}" the most weight.',
        "crowd": '  Layer {l} head {h} gives "{t}" the most weight from "{w}" ({weight:.3f}), but '
        'the other words give "{t}" {others:.3f} on average there: every word looks at "{t}" '
        'in that head, so it says nothing about "{w}".',
        "strong": '  Layer {l} head {h} gives "{t}" the most weight from "{w}" ({weight:.3f}; the '
        "other words {others:.3f}).",
        "contrast": '  The same head on "{text}": "{w}" → "{t2}" {w2:.3f}, → "{t}" {w1:.3f} '
        '(on the first sentence: "{t2}" {f2:.3f}, "{t}" {f1:.3f})',
        "follows": '  → the head follows the meaning: the adjective decides which noun "{w}" '
        "looks at.",
        "stays": '  → the head does not switch to "{t2}": here it does not follow the meaning.',
        "sinks": '  After all layers, {special:.0%} of "{w}"\'s attention rollout sits on the '
        "special tokens ({names}): heads with nothing to look for park their weight there "
        '(attention sinks); {itself:.0%} stays on "{w}" itself.',
        "drowned": '  After all layers, "{t}" gets {target:.3f} of "{w}"\'s attention rollout, '
        "{rank} of {words} words: rollout averages every head, so one specific head is drowned "
        "by the others.",
        "top": '  After all layers, "{t}" gets {target:.3f} of "{w}"\'s attention rollout, the '
        "most of any word.",
        "nth": "{n}th",
    },
    "zh": {
        "which": "哪个头把“{w}”和“{t}”联系起来？按特异性选出：“{w}”给“{t}”的权重，"
        "减去其他词给“{t}”的平均权重。",
        "best": "  层 {l} 头 {h}：“{w}” → “{t}” {weight:.3f}；其他词 → “{t}”平均为 {others:.3f}"
        "（特异性 {spec:+.3f}）",
        "same": "  它也正是“{w}”给“{t}”权重最大的头。",
        "crowd": "  层 {l} 头 {h} 中“{w}”给“{t}”的权重最大（{weight:.3f}），但在这个头里其他词给"
        "“{t}”的平均权重也有 {others:.3f}：每个词都看向“{t}”，所以它说明不了“{w}”指代什么。",
        "strong": "  层 {l} 头 {h} 中“{w}”给“{t}”的权重最大（{weight:.3f}；其他词 {others:.3f}）。",
        "contrast": "  同一个头处理“{text}”：“{w}” → “{t2}” {w2:.3f}，→ “{t}” {w1:.3f}"
        "（第一句中：“{t2}” {f2:.3f}，“{t}” {f1:.3f}）",
        "follows": "  → 这个头跟着句意走：形容词决定了“{w}”看向哪个名词。",
        "stays": "  → 这个头没有转向“{t2}”：在这里它并不跟着句意走。",
        "sinks": "  经过全部层之后，“{w}”的注意力展开有 {special:.0%} 落在特殊词元（{names}）上："
        "无处可看的头把权重停放在那里（注意力汇聚点，attention sink）；{itself:.0%} 留在“{w}”"
        "自身。",
        "drowned": "  经过全部层之后，“{t}”在“{w}”的注意力展开中只分到 {target:.3f}，"
        "在 {words} 个词中排第 {rank} 位：注意力展开对所有头取平均，"
        "一个有特异性的头被其他头淹没了。",
        "top": "  经过全部层之后，“{t}”在“{w}”的注意力展开中分到 {target:.3f}，是所有词中最多的。",
    },
}

ORDINALS = ("1st", "2nd", "3rd")  # English ranks; Chinese writes the number


def _rank(n: int, lang: str) -> str:
    if lang == "zh":
        return str(n)
    return ORDINALS[n - 1] if n <= 3 else TEXT["en"]["nth"].format(n=n)


def question_lines(
    amap: WordMap,
    word: str,
    target: str,
    *,
    contrast: WordMap | None = None,
    contrast_target: str | None = None,
    lang: str = "en",
) -> list[str]:
    """The answer to "which head links `word` to `target`?" as lines of text: the most specific
    head, the strongest one when it differs (and why it is not the answer), the same head on a
    `contrast` sentence whose answer is `contrast_target`, and what share of the word's rollout
    the target gets (`summary` says why most of it sits on the special tokens)."""
    if lang not in TEXT:
        raise ValueError(f"lang must be en or zh, got {lang!r}")
    t = TEXT[lang]
    w, tg = amap.words[amap.index(word)], amap.words[amap.index(target)]
    best, top = specific_head(amap, word, target), strongest(amap, word, target)
    lines = [t["which"].format(w=w, t=tg)]
    lines.append(t["best"].format(**_values(best), w=w, t=tg))
    if (top.layer, top.head) == (best.layer, best.head):
        lines.append(t["same"].format(w=w, t=tg))
    else:
        crowd = top.others >= 0.5 * top.weight  # the others give the target as much, nearly
        lines.append(t["crowd" if crowd else "strong"].format(**_values(top), w=w, t=tg))
    if contrast is not None and contrast_target is not None:
        lines += _contrast_lines(amap, contrast, best, word, target, contrast_target, t)
    s = sinks(amap, word, target)
    key = "top" if s.rank == 1 else "drowned"
    ranked = {"rank": _rank(s.rank, lang), "words": s.words}
    lines.append(t[key].format(t=tg, w=w, target=s.target, **ranked))
    return lines


def sink_line(amap: WordMap, word: str | int, lang: str = "en") -> list[str]:
    """The share of `word`'s rollout on the special tokens, and why (none without them)."""
    i = word if isinstance(word, int) else amap.index(word)
    special = [x for x, w in enumerate(amap.words) if _special(w)]
    if not special:
        return []
    final = amap.rollout()[-1, i]
    names = ("、" if lang == "zh" else ", ").join(dict.fromkeys(amap.words[x] for x in special))
    share, itself = final[special].sum().item(), final[i].item()
    return [TEXT[lang]["sinks"].format(w=amap.words[i], special=share, itself=itself, names=names)]


def _values(s: Specific) -> dict[str, float]:
    return {
        "l": s.layer,
        "h": s.head,
        "weight": s.weight,
        "others": s.others,
        "spec": s.specificity,
    }


def _contrast_lines(amap, contrast, best: Specific, word, target, contrast_target, t) -> list[str]:
    """The most specific head of the first sentence, asked about the contrast sentence."""
    at = (best.layer, best.head)
    first = amap.weights[at][amap.index(word)]
    second = contrast.weights[at][contrast.index(word)]
    t1, t2 = contrast.index(target), contrast.index(contrast_target)
    f1, f2 = first[amap.index(target)].item(), first[amap.index(contrast_target)].item()
    w1, w2 = second[t1].item(), second[t2].item()
    names = {"w": amap.words[amap.index(word)], "t": contrast.words[t1], "t2": contrast.words[t2]}
    line = t["contrast"].format(**names, text=contrast.text, w1=w1, w2=w2, f1=f1, f2=f2)
    flipped = w2 > w1 and f1 > f2
    return [line, t["follows" if flipped else "stays"].format(**names)]
