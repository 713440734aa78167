"""The `qkv` command.

- `qkv explain`: the textbook walk-through on real numbers;
- `qkv attend TEXT --token WORD`: where a word looks in the real all-MiniLM-L6-v2;
- `qkv bench`: the cost curve, time and memory against N;
- `qkv lab NAME`: one of the chapter's claims measured (`rnn`, `scale`, `routing`, `sparse`);
- `qkv demo`: all of them, written to a folder with a report;
- `qkv tokens --image WxH`: how many tokens an image costs (`qkv.vision.report`);
- `qkv build`: compile the CPU attention kernel now (otherwise it is compiled at first use),
  then `qkv tune`;
- `qkv tune`: measure where the kernel beats torch SDPA on this machine (what `auto` reads).

Each subcommand is one entry of `COMMANDS`: a help line, a function that adds its arguments and
a function that runs it. Bad input ends with a one-line message on stderr and a non-zero exit
code, never a traceback: 2 for a bad argument, an output that cannot be written (checked before
the work) or a request the input cannot answer; 1 for a missing optional package or a write that
failed anyway; 130 after Ctrl-C, once what was already measured has been written.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from . import cli_zh
from .cli_zh import LANGS, WORDS
from .inspect.outputs import (
    STDOUT,
    OutputError,
    check_file,
    check_folder,
    say_to,
    slug,
    terminal_safe,
    write_json,
)
from .inspect.seeds import seed_arg
from .labs import command as lab_command

USAGE_ERROR, FAILED, INTERRUPTED = 2, 1, 130
MISSING_PACKAGE = FAILED
LANG_HELP = "en or zh (Chinese): the language of help and errors"


# what the commands say about the files they wrote, in each language
SAID = {
    "en": {
        "page": "\npage: {path} (open it in a browser)",
        "weights": "weights: {path}",
        "pictures": "pictures: {paths}",
        "sep": ", ",
        "note": "note: {note}",
        "viewer": "viewer:   {path} (open it in a browser)",
        "interrupted": "(interrupted: {n} runs measured before Ctrl-C; they are kept)",
        "measurements": "measurements: {path}",
        "plot": "plot: {path}",
    },
    "zh": {
        "page": "\n网页：{path}（用浏览器打开）",
        "weights": "权重：{path}",
        "pictures": "图：{paths}",
        "sep": "、",
        "note": "注意：{note}",
        "viewer": "查看器：{path}（用浏览器打开）",
        "interrupted": "（已中断：Ctrl-C 之前测完的 {n} 次运行已保留）",
        "measurements": "测量结果：{path}",
        "plot": "图：{path}",
        # the text's own CJK words in the figures (`qkv.inspect.figures.CJK_HINT`)
        "cjk": "没有找到 CJK 字体，所以图中的中日韩文字会显示为方框；安装一个即可"
        "（Debian/Ubuntu：apt-get install fonts-noto-cjk）",
    },
}


def _said(lang: str, key: str, **values: object) -> str:
    """What a command says (`SAID`) in `lang`."""
    return SAID[lang if lang in SAID else "en"][key].format(**values)


class _Refused(Exception):
    """An input the command cannot answer; its message is shown without a traceback."""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(_positive(x) for x in text.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected sizes separated by commas such as 512,1024, got {text!r}"
        ) from None


# --------------------------------------------------------------------------- explain


def _explain_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=_positive, default=4, help="tokens N (default 4)")
    p.add_argument("--d", type=_positive, default=8, help="model width d (default 8)")
    p.add_argument("--dk", type=_positive, default=4, help="head width d_k (default 4)")
    p.add_argument("--seed", type=seed_arg(), default=0, help="random seed, 0..2**64-1 (default 0)")
    p.add_argument("--causal", action="store_true", help="hide future tokens")
    p.add_argument("--lang", choices=LANGS, default="en", help="en or zh (Chinese)")
    p.add_argument("--full", action="store_true", help="print large matrices whole")
    p.add_argument(
        "--html", metavar="FILE", help="also write the page you can touch (heatmaps, sliders)"
    )
    p.add_argument(
        "--flash",
        action="store_true",
        help="FlashAttention's walk, tile by tile (with --html: its page instead)",
    )
    p.add_argument("--tile", type=_positive, default=2, help="with --flash: tile size (default 2)")

    def keys(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < 0:
            raise argparse.ArgumentTypeError(f"expected an integer ≥ 0, got {text!r}")
        return value

    p.add_argument(
        "--window",
        type=keys,
        metavar="W",
        help="with --flash: a sliding window of W keys each side",
    )


def _explain(args: argparse.Namespace) -> None:
    from .inspect.explain import ExplainError, render, walkthrough

    if args.window is not None and not args.flash:
        raise _Refused("--window needs --flash")
    if args.html:
        check_file(args.html, "--html")
    options = {"n": args.n, "d": args.d, "d_k": args.dk, "seed": args.seed, "causal": args.causal}
    try:
        if args.flash:  # FlashAttention's walk over the same Q, K, V
            from .inspect.flash_text import render_walk

            text = render_walk(**options, tile=args.tile, window=args.window, lang=args.lang)
            if args.html:
                from .inspect.flash_page import write_flash_page

                write_flash_page(args.html, **options, tile=args.tile, lang=args.lang)
        else:
            w = walkthrough(**options)
            if args.html:
                from .inspect.formula import write_formula_page

                write_formula_page(args.html, **options, lang=args.lang)
            text = render(w, args.lang, full=args.full)
    except ExplainError as e:
        raise _Refused(str(e)) from None
    print(text)
    if args.html:
        print(_said(args.lang, "page", path=args.html))


# --------------------------------------------------------------------------- attend


def _attend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("text", nargs="?", default=None, help="the text (default: the cat example)")
    p.add_argument(
        "--token",
        "--word",
        dest="token",
        help='the word to ask about (default "it", else the first word)',
    )
    p.add_argument(
        "--target",
        help="a second word: which head links the word to it, chosen by specificity",
    )
    p.add_argument(
        "--model",
        metavar="FOLDER",
        help="a local transformers encoder folder (default: the packaged all-MiniLM-L6-v2)",
    )
    p.add_argument("--layer", type=int, help="show this layer's heads in full")
    p.add_argument("--head", type=int, help="with --layer: show only this head")
    p.add_argument(
        "--json", metavar="FILE", help="write every layer's and head's weights ('-': stdout)"
    )
    p.add_argument("--out", default="qkv-attend", help="folder for the PNGs and the viewer")
    p.add_argument("--no-files", action="store_true", help="print only; write no PNG or HTML")
    p.add_argument(
        "--lang", choices=LANGS, default="en", help="en or zh (Chinese): answer and viewer"
    )


def _attend(args: argparse.Namespace) -> None:
    from .inspect.attend import (
        EXAMPLE,
        AttendError,
        default_word,
        load_encoder,
        model_attention,
        summary,
    )
    from .inspect.specific import question_lines

    text = EXAMPLE if args.text is None else args.text
    if args.head is not None and args.layer is None:
        raise _Refused("--head needs --layer")
    if args.json:
        check_file(args.json, "--json", allow_stdout=True)
    out = None if args.no_files else check_folder(args.out, "--out")
    say = say_to(args.json)
    try:
        amap = (
            model_attention(text, *load_encoder(args.model))
            if args.model
            else model_attention(text)
        )
        word = args.token or default_word(amap)
        say(summary(amap, word, args.layer, args.head, lang=args.lang))
        if args.target:
            say("\n".join(question_lines(amap, word, args.target, lang=args.lang)))
    except AttendError as e:
        raise _Refused(str(e)) from None
    lang = args.lang
    if args.json:
        write_json(amap.to_dict(), args.json)
        if args.json != STDOUT:
            say(_said(lang, "weights", path=args.json))
    if out is not None:
        from .inspect.figures import (
            FontWarning,
            attention_grid,
            cjk_note,
            font_note,
            rollout_figure,
            token_heads,
        )
        from .inspect.viewer import write_viewer

        out.mkdir(parents=True, exist_ok=True)
        safe = slug(word)  # bounded: a 300-letter word must not name the file
        pictures = [out / "attention-grid.png", out / f"attention-{safe}.png"]
        pictures.append(out / f"attention-{safe}-rollout.png")
        with warnings.catch_warnings():  # no CJK font: said once below, as a note
            warnings.simplefilter("ignore", FontWarning)
            attention_grid(amap, pictures[0], lang=lang)
            token_heads(amap, word, pictures[1], lang=lang)
            rollout_figure(amap, word, pictures[2], lang=lang)
        layer, head = _viewer_head(amap, word, args)
        write_viewer(amap, out / "viewer.html", lang=lang, word=word, layer=layer, head=head)
        say(_said(lang, "pictures", paths=_said(lang, "sep").join(str(p) for p in pictures)))
        notes = [font_note(lang)]
        if cjk_note(amap.words):  # the text's own words (their labels: `font_note`)
            notes.append(_said(lang, "cjk") if lang == "zh" else cjk_note(amap.words))
        for note in filter(None, notes):
            say(_said(lang, "note", note=note))
        say(_said(lang, "viewer", path=out / "viewer.html"))


def _viewer_head(amap, word: str, args: argparse.Namespace) -> tuple[int | None, int | None]:
    """The layer and head the viewer opens on, the word selected: the one asked for with
    `--layer` (`--head`); else, with `--target`, the head most specific to the word → target
    (the answer printed); else the first of the summary's most focused heads."""
    if args.layer is not None:
        return args.layer, args.head
    if args.target:
        from .inspect.specific import specific_head

        best = specific_head(amap, word, args.target)
        return best.layer, best.head
    top = amap.focused_heads(word, 1)
    return (top[0][0].layer, top[0][0].head) if top else (None, None)


# --------------------------------------------------------------------------- bench


def _bench_args(p: argparse.ArgumentParser) -> None:
    from .inspect import bench

    p.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    p.add_argument("--sizes", type=_sizes, help="sequence lengths, e.g. 1024,2048,4096")
    p.add_argument("--window", type=_positive, help="the sliding window's reach each side")
    p.add_argument("--methods", default=",".join(bench.METHODS), help="which methods")
    p.add_argument(
        "--passes",
        choices=("forward", "backward", "both"),
        default="both",
        help="forward, backward or both (default)",
    )
    p.add_argument("--json", metavar="FILE", help="write the measurements as JSON ('-': stdout)")
    p.add_argument("--png", metavar="FILE", help="write the log-log plot")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def check_png(path: str | None) -> None:
    """Refuse a figure path before the work: a bad folder or an extension matplotlib lacks."""
    if path:
        from .inspect.outputs import image_formats

        check_file(path, "--png", formats=image_formats())


def _bench(args: argparse.Namespace) -> None:
    from dataclasses import replace

    from .inspect import bench

    sizes = bench.QUICK if args.quick else bench.FULL
    if args.sizes:
        sizes = replace(sizes, ns=args.sizes)
    if args.window:
        sizes = replace(sizes, window=args.window)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in bench.METHODS]
    if unknown or not methods:
        raise _Refused(f"unknown method {unknown}; choose from {', '.join(bench.METHODS)}")
    passes = {"forward": ["forward"], "backward": ["forward+backward"]}.get(
        args.passes, bench.PASSES
    )
    if args.json:
        check_file(args.json, "--json", allow_stdout=True)
    check_png(args.png)
    say = say_to(args.json)
    records: list[dict] = []
    interrupted = False
    try:
        for rec in bench.iter_measure(sizes, methods, passes, progress=not args.no_progress):
            records.append(rec)
    except KeyboardInterrupt:
        if not records:
            raise
        interrupted = True
        say(_said(args.lang, "interrupted", n=len(records)))
    say(bench.table(records, lang=args.lang))
    if args.json:
        write_json(bench.report(records, sizes, complete=not interrupted), args.json, indent=1)
        if args.json != STDOUT:
            say(_said(args.lang, "measurements", path=args.json))
    if args.png:
        from .inspect.figures import FontWarning, cost_plot, font_note

        with warnings.catch_warnings():  # no CJK font: said once below, as a note
            warnings.simplefilter("ignore", FontWarning)
            cost_plot(records, args.png, lang=args.lang)
        say(_said(args.lang, "plot", path=args.png))
        if note := font_note(args.lang):
            say(_said(args.lang, "note", note=note))
    if interrupted:
        raise KeyboardInterrupt


# --------------------------------------------------------------------------- demo


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="qkv-demo", help="the folder (default qkv-demo)")
    p.add_argument("--full", action="store_true", help="the labs' full runs (several minutes)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--lang", choices=LANGS, default="en", help="en or zh (Chinese): the report and its pages"
    )


def _demo(args: argparse.Namespace) -> None:
    from .inspect import demo

    out = check_folder(args.out, "--out")
    labs = "full" if args.full else "quick"
    demo.run(out, progress=not args.no_progress, labs=labs, lang=args.lang)


# --------------------------------------------------------------------------- build


def _build_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--force",
        action="store_true",
        help="rebuild even a good build (a failed one is always retried)",
    )
    p.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    p.add_argument("--no-tune", action="store_true", help="skip `qkv tune` after the build")


def _build(args: argparse.Namespace) -> None:
    from .kernels.cpu import build, isa

    try:
        ops = build.load(force=args.force, verbose=args.verbose, retry=True)
    except build.KernelUnavailable as e:
        cause = e.__cause__
        if cause is not None and args.verbose:
            print(str(cause).strip()[-4000:], file=sys.stderr)
        raise ImportError(f"the CPU kernel could not be built: {e}") from None
    have = ", ".join(f"{name} {'yes' if ops.isa_supported(name) else 'no'}" for name in isa.ISAS)
    chosen, why = isa.choose(ops)
    print(f"CPU attention kernel: {build.build_dir() / (build.NAME + '.so')}")
    print(f"instruction sets on this CPU: {have}")
    print(f"runs: {chosen} ({isa.ENV} forces one)" if why is None else f"cannot run: {why}")
    if why is None and not args.no_tune:
        _tune(argparse.Namespace(quick=False, show=False, no_progress=False))


# --------------------------------------------------------------------------- tune


def _tune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a few sizes, a few seconds (a smoke run)")
    p.add_argument("--show", action="store_true", help="print the table in use, measure nothing")
    p.add_argument("--no-progress", action="store_true", help="no line per measured point")


def _tune(args: argparse.Namespace) -> None:
    from . import tune
    from .kernels.cpu import crossover
    from .kernels.cpu.backend import kernel_status

    isa, why = kernel_status()
    if isa is None:
        raise _Refused(f"nothing to tune: {why}")
    if not args.show:
        if (why_busy := tune.busy()) is not None:
            print(
                f"qkv tune: the machine is busy ({why_busy}): crossovers measured now may be "
                "off; run it again when it is quiet",
                file=sys.stderr,
            )
        say = None if args.no_progress else lambda line: print(line, file=sys.stderr)
        table = tune.measure(quick=args.quick, progress=say)
        try:
            print(f"crossovers stored in {tune.save(table)}")
        except OSError as e:
            print(f"crossovers not stored ({e}); `auto` keeps its defaults", file=sys.stderr)
    print(f"auto's crossovers for the {isa} path: {crossover.basis(isa)}")
    print("  class: work (crossover.work_of) : SDPA's time ÷ the kernel's, at each measured size")
    stored = crossover.table(isa)
    for cls, points in sorted(({} if stored is None else stored.points).items()):
        shown = " ".join(f"{w:.2g}:{r:.2f}" for w, r in points)
        print(f"  {cls:<30} {shown}")


# --------------------------------------------------------------------------- the command


def _tokens_args(p: argparse.ArgumentParser) -> None:
    from .vision import report

    report.add_arguments(p)


def _tokens(args: argparse.Namespace) -> None:
    from .vision import report

    try:
        report.run(args)
    except ValueError as e:
        raise _Refused(str(e)) from None


class Command(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], None]


COMMANDS: dict[str, Command] = {
    "explain": Command("the textbook walk-through on real numbers", _explain_args, _explain),
    "attend": Command(
        "where a word looks in the real all-MiniLM-L6-v2 (or a model of yours)",
        _attend_args,
        _attend,
    ),
    "bench": Command("time and memory of attention against N", _bench_args, _bench),
    "lab": Command(
        "the chapter's claims, measured: rnn, scale, routing, sparse",
        lab_command.add_arguments,
        lab_command.run,
    ),
    "demo": Command("explain, attend, bench and the labs, in a folder", _demo_args, _demo),
    "tokens": Command(
        "how many tokens an image costs (Qwen2-VL, LLaVA-NeXT)", _tokens_args, _tokens
    ),
    "build": Command(
        "compile the CPU attention kernel now (else at first use)", _build_args, _build
    ),
    "tune": Command("measure where the CPU kernel beats torch SDPA here", _tune_args, _tune),
}


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its errors in the command's language (`lang`: en or zh). A command
    may set `required_message`: what to say instead of argparse's "the following arguments are
    required: ..." (`qkv lab` lists its labs)."""

    required_message: str | None = None

    def __init__(self, *args, lang: str = "en", **kwargs):
        super().__init__(*args, **kwargs)
        self.lang = lang

    def error(self, message: str):
        if self.required_message and message.startswith("the following arguments are required"):
            message = self.required_message
        if self.lang == "zh":
            self.print_usage(sys.stderr)
            self.exit(USAGE_ERROR, f"{self.prog}: {WORDS['error']}：{cli_zh.error(message)}\n")
        super().error(message)


def language(argv: list[str]) -> str:
    """The language asked for anywhere on the command line (`--lang zh`, `--lang=zh`): help
    and errors follow it even before (or when) the arguments parse."""
    lang = "en"
    for i, arg in enumerate(argv):
        if arg == "--lang" and i + 1 < len(argv):
            lang = argv[i + 1]
        elif arg.startswith("--lang="):
            lang = arg.partition("=")[2]
    return lang if lang in LANGS else "en"


def _parser(lang: str = "en") -> argparse.ArgumentParser:
    from . import __version__

    formatter = cli_zh.Formatter if lang == "zh" else argparse.HelpFormatter
    ap = _Parser(
        prog="qkv",
        description="Self-attention, from the formula up.",
        lang=lang,
        formatter_class=formatter,
    )
    ap.add_argument("--version", action="version", version=f"qkv {__version__}")
    ap.add_argument("--lang", choices=LANGS, default="en", help=LANG_HELP)
    sub = ap.add_subparsers(dest="command", title="commands")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(
            name, help=cmd.help, description=cmd.help, lang=lang, formatter_class=formatter
        )
        cmd.add_arguments(p)
        if not any(a.dest == "lang" for a in p._actions):
            p.add_argument("--lang", choices=LANGS, default="en", help=LANG_HELP)
    if lang == "zh":
        cli_zh.localize(ap)
    return ap


def _undecodable(argv: list[str]) -> int | None:
    """The position of the first argument holding bytes that are not UTF-8, or None."""
    for i, arg in enumerate(argv):
        if any("\udc80" <= c <= "\udcff" for c in arg):
            return i
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit code (argparse exits with 2 on bad arguments)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    lang = language(argv)
    bad = _undecodable(argv)
    if bad is not None:  # bytes that are not UTF-8 (Python keeps them as lone surrogates)
        said = (
            f"qkv：错误：第 {bad + 1} 个参数不是有效的 UTF-8 文本；请用 UTF-8 编码输入"
            if lang == "zh"
            else f"qkv: error: argument {bad + 1} is not valid UTF-8 text; give it in UTF-8"
        )
        print(said, file=sys.stderr)
        return USAGE_ERROR
    parser = _parser(lang)
    args = parser.parse_args(argv)
    args.lang = lang  # `qkv --lang zh explain` as `qkv explain --lang zh`
    if args.command is None:  # bare `qkv`: what it can do
        parser.print_help()
        return 0

    def error(message: str) -> None:
        if lang == "zh":
            message = f"{WORDS['error']}：{cli_zh.error(message)}"
        else:
            message = f"error: {message}"
        print(terminal_safe(f"qkv {args.command}: {message}"), file=sys.stderr)

    try:
        COMMANDS[args.command].run(args)
    except (_Refused, OutputError) as e:
        error(str(e))
        return USAGE_ERROR
    except ImportError as e:
        error(str(e))
        return MISSING_PACKAGE
    except BrokenPipeError:  # the reader closed the pipe (`| head`): the entry point ends quietly
        raise
    except OSError as e:  # a write that the up-front checks could not foresee (disk full, ...)
        where = f" {Path(e.filename)}" if e.filename else ""
        error(f"could not write{where}: {e.strerror or e}")
        return FAILED
    except KeyboardInterrupt:
        word = WORDS["interrupted"] if lang == "zh" else "interrupted"
        print(f"\nqkv {args.command}: {word}", file=sys.stderr)
        return INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
