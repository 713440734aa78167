"""The `qkv` command in Chinese: its help and its errors under `--lang zh`.

`HELP` maps every English help line of the command to its Chinese; `localize` swaps them into a
built parser (a test checks that no help line is left in English). `error` translates a one-line
error by the patterns of `ERRORS`: argparse's own messages and qkv's, each keeping the values
(paths, numbers, words) it quotes. A message no pattern knows is shown in English rather than
lost.
"""

from __future__ import annotations

import argparse
import re

LANGS = ("en", "zh")

WORDS = {
    "usage": "用法：",
    "positional arguments": "位置参数",
    "options": "选项",
    "commands": "命令",
    "error": "错误",
    "interrupted": "已中断",
}

HELP = {
    # the command and its subcommands
    "Self-attention, from the formula up.": "自注意力：从公式讲起。",
    "show this help message and exit": "显示此帮助并退出",
    "show program's version number and exit": "显示版本号并退出",
    "en or zh (Chinese): the language of help and errors": "en 或 zh（中文）：帮助和错误信息的语言",
    "the textbook walk-through on real numbers": "用真实的数字逐步演示教科书里的公式",
    "a second word: which head links the word to it, chosen by specificity": (
        "第二个词：哪个头把这个词和它联系起来（按特异性选出）"
    ),
    "where a word looks in the real all-MiniLM-L6-v2 (or a model of yours)": (
        "一个词在真实模型 all-MiniLM-L6-v2（或你自己的模型）中把注意力放在哪里"
    ),
    "time and memory of attention against N": "注意力的时间和内存随序列长度 N 的变化",
    "the chapter's claims, measured: rnn, scale, routing, sparse": (
        "实测本章的论断：rnn、scale、routing、sparse"
    ),
    "explain, attend, bench and the labs, in a folder": (
        "explain、attend、bench 和各个实验，结果写入一个文件夹"
    ),
    "how many tokens an image costs (Qwen2-VL, LLaVA-NeXT)": (
        "一张图像要占多少个词元（Qwen2-VL、LLaVA-NeXT）"
    ),
    "compile the CPU attention kernel now (else at first use)": (
        "现在就编译 CPU 注意力内核（否则在首次使用时编译）"
    ),
    "measure where the CPU kernel beats torch SDPA here": (
        "在本机测量 CPU 内核在哪些规模上快于 torch SDPA"
    ),
    # explain
    "tokens N (default 4)": "词元数 N（默认 4）",
    "model width d (default 8)": "模型维度 d（默认 8）",
    "head width d_k (default 4)": "查询/键的维度 d_k（默认 4）",
    "random seed, 0..2**64-1 (default 0)": "随机种子，0..2**64-1（默认 0）",
    "hide future tokens": "遮住后面的词元（因果注意力）",
    "en or zh (Chinese)": "en 或 zh（中文）",
    "print large matrices whole": "完整打印大矩阵",
    "also write the page you can touch (heatmaps, sliders)": (
        "同时写出可交互的网页（热力图、滑块）"
    ),
    "FlashAttention's walk, tile by tile (with --html: its page instead)": (
        "逐块演示 FlashAttention 的计算过程（与 --html 同用：改为写出它的网页）"
    ),
    "with --flash: tile size (default 2)": "与 --flash 同用：块的大小（默认 2）",
    "with --flash: a sliding window of W keys each side": (
        "与 --flash 同用：滑动窗口，每侧 W 个键"
    ),
    # attend
    "the text (default: the cat example)": "要分析的文本（默认：猫的例句）",
    'the word to ask about (default "it", else the first word)': (
        "要查看的词（默认 “it”，没有则取第一个词）"
    ),
    "show this layer's heads in full": "完整显示这一层的各个注意力头",
    "with --layer: show only this head": "与 --layer 同用：只显示这个头",
    "write every layer's and head's weights ('-': stdout)": (
        "写出每一层、每个头的注意力权重（'-'：标准输出）"
    ),
    "folder for the PNGs and the viewer": "存放 PNG 图和查看器网页的文件夹",
    "print only; write no PNG or HTML": "只打印，不写 PNG 或 HTML 文件",
    "en or zh (Chinese): answer and viewer": "en 或 zh（中文）：回答和查看器的语言",
    "a local transformers encoder folder (default: the packaged all-MiniLM-L6-v2)": (
        "本地的 transformers 编码器模型文件夹（默认：随包提供的 all-MiniLM-L6-v2）"
    ),
    # bench
    "small sizes, under a minute": "小规模，一分钟以内",
    "sequence lengths, e.g. 1024,2048,4096": "序列长度，例如 1024,2048,4096",
    "the sliding window's reach each side": "滑动窗口向每一侧覆盖的距离",
    "which methods": "测哪些方法",
    "forward, backward or both (default)": "前向、反向或两者（默认）",
    "write the measurements as JSON ('-': stdout)": "把测量结果写成 JSON（'-'：标准输出）",
    "write the log-log plot": "画出双对数坐标图",
    "no progress bar": "不显示进度条",
    # lab
    "which lab: rnn, scale, routing, sparse": "哪个实验：rnn、scale、routing、sparse",
    "the short run (default)": "短时运行（默认）",
    "the longer run, smoother curves": "较长的运行，曲线更平滑",
    "folder for the figure NAME.png": "存放图 NAME.png 的文件夹",
    "print only; write no figure": "只打印，不画图",
    "random seed, 0..2**32-1 (default 0)": "随机种子，0..2**32-1（默认 0）",
    # demo
    "the folder (default qkv-demo)": "输出文件夹（默认 qkv-demo）",
    "the labs' full runs (several minutes)": "各实验的完整运行（需要几分钟）",
    "en or zh (Chinese): the report and its pages": "en 或 zh（中文）：报告及其网页的语言",
    # tokens
    "an image size such as 1344x1344, or a file": "图像尺寸，例如 1344x1344，或一个图像文件",
    "which model": "哪个模型",
    "Qwen2-VL's min_pixels (default 3136)": "Qwen2-VL 的 min_pixels（默认 3136）",
    "Qwen2-VL's max_pixels (default 1003520)": "Qwen2-VL 的 max_pixels（默认 1003520）",
    "draw tokens and attention cost from 224² to 4K (default file qkv-tokens.png)": (
        "画出从 224² 到 4K 的词元数和注意力开销（默认文件 qkv-tokens.png）"
    ),
    # build
    "rebuild even a good build (a failed one is always retried)": (
        "即使已有可用的构建也重新编译（失败的构建总会重试）"
    ),
    "show the compiler's commands": "显示编译器命令",
    "skip `qkv tune` after the build": "编译后不运行 `qkv tune`",
    # tune
    "a few sizes, a few seconds (a smoke run)": "只测几个规模，几秒钟（冒烟测试）",
    "print the table in use, measure nothing": "只打印正在使用的表，不做测量",
    "no line per measured point": "不逐点打印测量结果",
}

ERRORS: list[tuple[str, str]] = [
    # argparse's own
    (r"argument (\S+): (.+)", "参数 {0}：{1*}"),
    (r"invalid choice: (.+) \(choose from (.+)\)", "无效的选项 {0}（可选：{1}）"),
    (r"the following arguments are required: (.+)", "缺少必需的参数：{0}"),
    (r"unrecognized arguments: (.+)", "无法识别的参数：{0}"),
    (r"expected one argument", "需要一个值"),
    (r"not allowed with argument (.+)", "不能与参数 {0} 同时使用"),
    (r"invalid (\w+) value: (.+)", "无效的值：{1}"),
    # the command's argument types
    (r"expected a positive integer, got (.+)", "需要一个正整数，得到的是 {0}"),
    (r"expected an integer seed, got (.+)", "随机种子须为整数，得到的是 {0}"),
    (r"the seed must be (?:an int )?in (\S+), got (.+)", "随机种子须在 {0} 之内，得到的是 {1}"),
    (
        r"expected sizes separated by commas such as 512,1024, got (.+)",
        "需要以逗号分隔的长度，例如 512,1024，得到的是 {0}",
    ),
    # outputs that cannot be written (checked before the work)
    (r"(.+) is a folder; give a file name", "{0} 是一个文件夹；请给出文件名"),
    (r"(.+) is an existing file; give a folder", "{0} 是一个已有的文件；请给出文件夹"),
    (r"(.+): the folder (.+) does not exist", "{0}：文件夹 {1} 不存在"),
    (r"(.+): (.+) is a file, not a folder", "{0}：{1} 是文件，不是文件夹"),
    (r"(.+): cannot write there \((.+)\)", "{0}：无法写入该位置（{1}）"),
    (r"(.+): cannot write in (.+) \((.+)\)", "{0}：无法在 {1} 中写入（{2}）"),
    (
        r"(.+): unknown image format (.+); use one of (.+)",
        "{0}：未知的图像格式 {1}；可用的格式：{2}",
    ),
    (r"could not write(.*?): (.+)", "无法写入{0}：{1}"),
    # the commands' refusals
    (r"--head needs --layer", "--head 需要同时给出 --layer"),
    (
        r"qkv lab needs a lab's name: (\S+), (\S+), (\S+) or (\S+) \(e\.g\. (.+)\)",
        "qkv lab 需要实验的名字：{0}、{1}、{2} 或 {3}（例如 {4}）",
    ),
    (r"unknown method (.+); choose from (.+)", "未知的方法 {0}；可选：{1}"),
    (r"nothing to tune: (.+)", "没有可调的内容：{0}"),
    (
        r"the word (.+) is not in the text; its words are: (.*)",
        "文本中没有词 {0}；文本中的词有：{1}",
    ),
    (r"the text is empty; give a sentence, e\.g\. (.+)", "文本为空；请给出一个句子，例如 {0}"),
    (
        r"the text is (\d+) tokens long; the model reads at most (\d+)",
        "文本有 {0} 个词元，而模型最多只读 {1} 个",
    ),
    (r"the text has no words", "文本中没有词"),
    (
        r"layer (\d+) is out of range; the model has layers (.+)",
        "层 {0} 超出范围；模型的层编号为 {1}",
    ),
    (
        r"head (\d+) is out of range; each layer has heads (.+)",
        "头 {0} 超出范围；每层的头编号为 {1}",
    ),
    (
        r"a walk-through with (.+) needs about (.+) \(.*\), but only (.+) of memory is "
        r"available; .*",
        "{0} 的演示大约需要 {1} 内存，但只有 {2} 可用；逐步演示适合较小的 N，例如 --n 8",
    ),
    (
        r"the page shows up to (\d+) tokens of width up to (\d+), got (.+) \(the text "
        r"walk-through takes any size\)",
        "网页最多显示 {0} 个词元、宽度最多 {1}，得到的是 {2}（文字版的逐步演示不限大小）",
    ),
    (r"the page's d_k is one of (.+)", "网页的 d_k 只能取 {0}"),
    (r"expected an integer ≥ 0, got (.+)", "需要一个 ≥ 0 的整数，得到的是 {0}"),
    (r"--window needs --flash", "--window 需要同时给出 --flash"),
    (
        r"the walk prints every tile: N=(\d+) with tiles of (\d+) makes (\S+) steps \(at most "
        r"(\S+)\); use a larger --tile or a smaller --n",
        "逐块演示会打印每一块：N={0}、块大小 {1} 共 {2} 步（最多 {3} 步）；"
        "请用更大的 --tile 或更小的 --n",
    ),
    (
        r"the flash page takes (\S+) from 1 to (\d+), got (.+) \(the text walk, "
        r"`qkv explain --flash`, takes larger ones\)",
        "FlashAttention 网页的 {0} 取值为 1 到 {1}，得到的是 {2}（文字演示 "
        "`qkv explain --flash` 可以更大）",
    ),
    (r"tile must be at most n, got (.+)", "块大小不能超过 N，得到的是 {0}"),
    (r"--image: no such file: (.+)", "--image：没有这个文件：{0}"),
    (
        r"(\S+): a name of (\d+) bytes \((.+)\); a file or folder name may have at most (\d+)",
        "{0}：名字有 {1} 字节（{2}）；文件名或文件夹名最多 {3} 字节",
    ),
    (r"width must be a positive number of pixels, got (.+)", "宽度须为正的像素数，得到的是 {0}"),
    (r"height must be a positive number of pixels, got (.+)", "高度须为正的像素数，得到的是 {0}"),
    (
        r"absolute aspect ratio must be at most (\S+), got (\S+) for (.+)",
        "宽高比最多为 {0}，而 {2} 的宽高比为 {1}",
    ),
    (r"(min_pixels=\d+) must be ≤ (max_pixels=\d+)", "{0} 须 ≤ {1}"),
    (
        r"--image expects WIDTHxHEIGHT such as 1344x1344 or an image file, got (.+)",
        "--image 需要 宽x高（例如 1344x1344）或一个图像文件，得到的是 {0}",
    ),
    (
        r"give --image WIDTHxHEIGHT \(or an image file\), --plot, or both",
        "请给出 --image 宽x高（或一个图像文件）、--plot，或两者都给",
    ),
    (
        r"(.+) is not a transformers model folder \((.+)\)",
        "{0} 不是 transformers 模型文件夹（{1}）",
    ),
    # missing packages
    (
        r"`qkv attend --model` needs transformers \((.+) is missing\); install it with: (.+)",
        "`qkv attend --model` 需要 transformers（缺少 {0}）；安装命令：{1}",
    ),
    (r"qkv demo needs (.+); install with: (.+)", "qkv demo 需要 {0}；安装命令：{1}"),
    (
        r"`qkv attend` needs transformers and the packaged all-MiniLM-L6-v2 \((.+) is "
        r"missing\); install them with: (.+)",
        "`qkv attend` 需要 transformers 和随包提供的 all-MiniLM-L6-v2（缺少 {0}）；安装命令：{1}",
    ),
    (
        r"qkv's figures need matplotlib; install it with: (.+)",
        "qkv 的图需要 matplotlib；安装命令：{0}",
    ),
    (r"the CPU kernel could not be built: (.+)", "CPU 内核无法编译：{0}"),
]
_COMPILED = [(re.compile(p, re.DOTALL), zh) for p, zh in ERRORS]


def error(message: str) -> str:
    """`message` in Chinese: the first pattern of `ERRORS` that matches it whole, with the values
    it quotes kept (`{i*}` translates a quoted part again); unknown messages stay English."""
    for pattern, zh in _COMPILED:
        m = pattern.fullmatch(message.strip())
        if m is None:
            continue
        parts: list[str] = list(m.groups())

        def again(r: re.Match[str], parts: list[str] = parts) -> str:
            return error(parts[int(r[1])])

        zh = re.sub(r"\{(\d)\*\}", again, zh)
        return zh.format(*parts)
    return message


class Formatter(argparse.HelpFormatter):
    """argparse's help with a Chinese usage line."""

    def add_usage(self, usage, actions, groups, prefix=None):
        super().add_usage(usage, actions, groups, WORDS["usage"] if prefix is None else prefix)


def localize(parser: argparse.ArgumentParser) -> None:
    """Put the Chinese of every help line, description and section title into `parser` and its
    subcommands' parsers (a line `HELP` lacks stays English)."""
    parser.formatter_class = Formatter
    if parser.description:
        parser.description = HELP.get(parser.description, parser.description)
    for group in parser._action_groups:  # argparse has no public setter for these titles
        group.title = WORDS.get(group.title or "", group.title)
    for action in parser._actions:
        if action.help and action.help is not argparse.SUPPRESS:
            action.help = HELP.get(action.help, action.help)
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                choice.help = HELP.get(choice.help or "", choice.help)
            for sub in dict.fromkeys(action.choices.values()):
                localize(sub)
