"""The README and docs/ cannot rot: every command they show is run or checked, every Python
example runs, every link and reference points at something that exists, and no date is in them.

The convention (docs/architecture.md, "The docs"):

- A **command** is a line starting with ``$ `` in a fenced ```` ```console ```` block; a line
  ending in ``\\`` continues on the next. The lines after a command, up to the next command or
  the end of the block, are its output; a line ``...`` in it stands for any number of lines.
- **Fast** commands (``memsim`` on ``examples/nanogpt_block.py``, ``memsim gpus``) are run, in a
  scratch directory that sees the repository's ``examples/``; they must exit 0 and print the
  output shown, if any (a command shown in several places runs once). **Every other** command is checked without running it: ``memsim ...`` is
  parsed by ``memsim.cli``'s own parser (target file and name, ``--gpu``, each ``--config``
  checked too); ``python3 -m benchmarks.X`` / ``python3 examples/X.py``: the module's file
  (``benchmarks/X.py``) or the script exists and accepts every option used (``--help`` for
  argparse scripts, run once each; the source for the others, which would run the benchmark on
  ``--help``), and a benchmark is run as a module (it imports ``benchmarks`` and
  ``tests.support`` from the repository's root); ``pip install``: the torch pin is in
  ``pyproject.toml``'s range and the extras exist; ``python3 -m pytest``: the test paths and
  markers exist, and the README's test command is the one ``.ci/run`` runs.
- Inline code in running text that starts like a command (``memsim analyze``, ``python3 -m
  benchmarks...``, ``python3 -m pytest``), and such a line in a plain fenced block (a
  synopsis), is checked the same way, never run; an elided ``TARGET ...`` is allowed there.
- ```` ```pycon ```` blocks run as doctests; ```` ```python ```` blocks must parse.
- Every relative link and image resolves (file, and heading for ``.md#anchor``); every
  ``tests/x.py::name`` names a test that exists; every repository path in backticks exists.
- No line of the README or docs/ holds a date (``YYYY-MM-DD``): history is in CHANGELOG.md and
  dated measurements in benchmarks/RESULTS.md, which are exempt.
"""

from __future__ import annotations

import ast
import doctest
import functools
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:                 # Python 3.10: pip vendors the same parser
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
HISTORY = [ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "RESULTS.md"]   # dates allowed
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
# memsim commands on these targets are run (each takes a few seconds); others are parsed only
FAST_TARGETS = ("examples/nanogpt_block.py:",)
RUN_TIMEOUT = 120
# the top-level entries whose paths in backticks must exist
REPO_TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")} | {".ci"}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---------------------------------------------------------------------------------------------
# reading the markdown


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int          # 1-based line of the opening fence
    lang: str
    lines: tuple[str, ...]


@dataclass(frozen=True)
class Command:
    doc: Path
    line: int
    text: str
    output: tuple[str, ...] | None     # None: inline, in running text

    @property
    def id(self) -> str:
        return f"{rel(self.doc)}:{self.line}"


FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


def blocks(doc: Path) -> list[Block]:
    out, lines = [], doc.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        out.append(Block(doc, i + 1, lang, tuple(body)))
        i = j + 1
    return out


def prose(doc: Path) -> str:
    """The text outside fenced blocks (fences blanked, so line numbers stay)."""
    lines, keep, fence = doc.read_text(encoding="utf-8").splitlines(), [], None
    for line in lines:
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(2)
            keep.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            keep.append("")
        else:
            keep.append(line)
    return "\n".join(keep)


MALFORMED: list[str] = []     # console lines that are neither a command nor its output


def console_commands(doc: Path) -> list[Command]:
    out = []
    for b in blocks(doc):
        if b.lang != "console":
            continue
        i = 0
        while i < len(b.lines):
            line = b.lines[i]
            if not line.startswith("$ "):
                MALFORMED.append(f"{rel(doc)}:{b.line + 1 + i}: {line!r}")
                i += 1
                continue
            start, text = i, line[2:]
            while text.endswith("\\") and i + 1 < len(b.lines):
                i += 1
                text = text[:-1].rstrip() + " " + b.lines[i].strip()
            i += 1
            output = []
            while i < len(b.lines) and not b.lines[i].startswith("$ "):
                output.append(b.lines[i])
                i += 1
            out.append(Command(doc, b.line + 1 + start, text, tuple(output)))
    return out


INLINE = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)?)`(?!`)")
COMMAND_START = re.compile(r"^(memsim (analyze|fit|checkpoint|compare|gpus)\b|python3? "
                           r"(benchmarks|examples)/|python3? -m (pytest|benchmarks\.)\b)")


def inline_spans(doc: Path) -> list[tuple[int, str]]:
    text = prose(doc)
    out = []
    for m in INLINE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        out.append((line, " ".join(m.group(1).split())))
    return out


def inline_commands(doc: Path) -> list[Command]:
    """Commands in running text, and synopses in plain fenced blocks (``memsim checkpoint
    TARGET ... [--json]``): checked for their options, never run."""
    out = [Command(doc, line, span, None) for line, span in inline_spans(doc)
           if COMMAND_START.match(span)]
    for b in blocks(doc):
        if b.lang in ("", "text"):
            out += [Command(doc, b.line + 1 + i, " ".join(line.split()), None)
                    for i, line in enumerate(b.lines) if COMMAND_START.match(line)]
    return out


ALL_COMMANDS = [c for d in DOCS for c in console_commands(d)]
ALL_INLINE = [c for d in DOCS for c in inline_commands(d)]


# ---------------------------------------------------------------------------------------------
# checking one command


def parts(text: str) -> list[list[str]]:
    """The command's words, split at ``&&``."""
    words, out = shlex.split(text), [[]]
    for w in words:
        if w == "&&":
            out.append([])
        else:
            out[-1].append(w)
    return [p for p in out if p]


def is_fast(words: list[str]) -> bool:
    if words[0] != "memsim":
        return False
    if words[1:2] == ["gpus"]:
        return True
    return len(words) > 2 and words[2].startswith(FAST_TARGETS)


def flags(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if re.match(r"^--?[A-Za-z]", w)]


@functools.lru_cache(maxsize=None)
def memsim_parser():
    from memsim import options
    return options.parser()


def subparser(sub: str):
    p = memsim_parser()
    action = next(a for a in p._actions if a.__class__.__name__ == "_SubParsersAction")
    assert sub in action.choices, f"memsim has no command {sub!r}"
    return action.choices[sub]


def joined_configs(argv: list[str]) -> list[str]:
    """``memsim compare``'s ``--config VALUE`` as the command line joins it (a value may
    itself start with ``--``)."""
    from memsim.options import join_configs
    return join_configs(argv)


def check_target(target: str, where: str) -> None:
    path, _, name = target.rpartition(":")
    if not path.endswith(".py"):
        return      # package.module:NAME: importing it is the run's business
    src = ROOT / path
    assert src.is_file(), f"{where}: no such file {path}"
    assert re.search(rf"^(def|class) {re.escape(name)}\b|^{re.escape(name)}\s*=",
                     src.read_text(encoding="utf-8"), re.M), f"{where}: {path} defines no {name!r}"


def check_memsim_static(words: list[str], where: str) -> None:
    from memsim import options
    from memsim.analysis.gpus import gpu
    argv = joined_configs(words[1:])
    try:
        args = memsim_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: memsim's parser refuses: {' '.join(words)}")
    if getattr(args, "target", None):
        check_target(args.target, where)
    if getattr(args, "gpu", None):
        gpu(args.gpu)           # an unknown name raises, listing the known ones
    for text in getattr(args, "configs", []) or []:
        options.config_args(args, text)    # parses without tracing; raises UsageError


def run_memsim(words: list[str], scratch: Path) -> subprocess.CompletedProcess:
    if not (scratch / "examples").exists():
        (scratch / "examples").symlink_to(ROOT / "examples")
    code = "from memsim.entry import script; script()"
    return subprocess.run([sys.executable, "-c", code, *words[1:]], cwd=scratch,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT)


def matches(shown: tuple[str, ...], printed: str) -> bool:
    """``printed`` equals the doc's ``shown`` lines, each ``...`` line any number of lines."""
    pattern = "".join(r"(?:.*\n)*?" if line.strip() == "..." else re.escape(line.rstrip()) + r"\n"
                      for line in shown)
    text = "".join(line.rstrip() + "\n" for line in printed.splitlines())
    return re.fullmatch(pattern, text) is not None


@functools.lru_cache(maxsize=None)
def script_help(script: str, run: tuple[str, ...]) -> str | None:
    """``run --help``'s text for an argparse script (``run``: how the doc runs ``script``, a
    file or ``-m`` and a module); None for a script that reads ``sys.argv`` itself, whose
    ``--help`` would run it."""
    path = ROOT / script
    if not path.is_file() or "ArgumentParser" not in path.read_text(encoding="utf-8"):
        return None
    done = subprocess.run([sys.executable, *run, "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT)
    if done.returncode != 0:
        return f"<--help failed, exit {done.returncode}>\n{done.stdout}{done.stderr}"
    return done.stdout


def check_script(words: list[str], where: str) -> None:
    """``python3 examples/X.py ...`` or ``python3 -m benchmarks.X ...``: the file exists and
    accepts every option the doc gives it."""
    if words[1] == "-m":
        module, args = words[2], words[3:]
        script, run = module.replace(".", "/") + ".py", ("-m", module)
    else:
        script, args, run = words[1], words[2:], (str(ROOT / words[1]),)
        assert not script.startswith("benchmarks/"), \
            f"{where}: a benchmark runs as a module from the repository's root: python3 -m " \
            f"{script.removesuffix('.py').replace('/', '.')}"
    path = ROOT / script
    assert path.is_file(), f"{where}: no such script {script}"
    ast.parse(path.read_text(encoding="utf-8"))
    source = path.read_text(encoding="utf-8")
    help_text = script_help(script, run) if flags(args) else None
    if help_text is not None:
        assert not help_text.startswith("<--help failed"), f"{where}: {script}: {help_text}"
    for flag in flags(args):
        declared = re.search(rf"""["']{re.escape(flag)}["']""", source)
        if help_text is not None:
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) or declared, \
                f"{where}: {script} --help has no {flag}"
        else:
            assert flag in source, f"{where}: {script} does not read {flag}"
    if "ArgumentParser" not in source:  # sys.argv scripts: their named arguments are in the source
        for word in args:
            if not word.startswith("-"):
                assert word in source, f"{where}: {script} knows no {word!r}"


MARKERS = {m.split(":")[0].strip() for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}


def check_pytest(words: list[str], where: str) -> None:
    i = words.index("pytest") + 1
    rest = words[i:]
    for j, w in enumerate(rest):
        if w == "-m":
            expr = rest[j + 1]
            for name in re.findall(r"\w+", expr):
                assert name in {"and", "or", "not"} | MARKERS, f"{where}: unknown marker {name}"
        elif w.startswith("tests/"):
            path, _, name = w.partition("::")
            assert (ROOT / path).exists(), f"{where}: no such test path {path}"
            if name:
                check_test_ref(path, name, where)


def check_pip(words: list[str], where: str) -> None:
    spec = PYPROJECT["project"]
    extras = spec["optional-dependencies"]
    for w in words[2:]:
        if w.startswith("torch=="):
            from packaging.specifiers import SpecifierSet
            wanted = next(d for d in spec["dependencies"] if d.startswith("torch"))
            assert w.split("==")[1] in SpecifierSet(wanted[len("torch"):]), \
                f"{where}: {w} is outside pyproject's {wanted}"
        m = re.fullmatch(r"\.\[([\w,]+)\]", w)
        if m:
            for extra in m.group(1).split(","):
                assert extra in extras, f"{where}: pyproject has no extra {extra!r}"


def check_static(words: list[str], where: str) -> None:
    head = words[0]
    if head == "memsim":
        check_memsim_static(words, where)
    elif head in ("pip", "pip3"):
        assert words[1] == "install", where
        check_pip(words, where)
    elif head in ("python", "python3") and words[1:3] == ["-m", "pytest"]:
        check_pytest(words, where)
    elif head in ("python", "python3") and len(words) > 2 and words[1] == "-m" and \
            words[2].startswith("benchmarks."):
        check_script(words, where)
    elif head in ("python", "python3") and len(words) > 1 and \
            words[1].startswith(("benchmarks/", "examples/")):
        check_script(words, where)
    else:
        pytest.fail(f"{where}: a command this test does not know how to check: "
                    f"{' '.join(words)} (teach tests/test_docs.py, or leave it out)")


# ---------------------------------------------------------------------------------------------
# the tests


def test_the_docs_have_commands():
    """Nothing found is a failure, not a pass."""
    assert any(is_fast(w) for c in ALL_COMMANDS for w in parts(c.text))
    assert len(ALL_COMMANDS) > 20 and len(ALL_INLINE) > 10


FAST_ALL = [c for c in ALL_COMMANDS if all(is_fast(w) for w in parts(c.text))]
SLOW = [c for c in ALL_COMMANDS if c not in FAST_ALL]
# a fast command shown in several places runs once; each place's output is compared
FAST: dict[str, list[Command]] = {}
for _c in FAST_ALL:
    FAST.setdefault(_c.text, []).append(_c)


@pytest.mark.parametrize("text", list(FAST), ids=[FAST[t][0].id for t in FAST])
def test_fast_command_runs_and_prints_what_the_doc_shows(text, tmp_path_factory):
    scratch = tmp_path_factory.getbasetemp() / "docs-scratch"
    scratch.mkdir(exist_ok=True)
    places = FAST[text]
    for words in parts(text):
        check_static(words, places[0].id)
        done = run_memsim(words, scratch)
        assert done.returncode == 0, \
            f"{places[0].id}: exit {done.returncode}\n{done.stderr[-3000:]}"
        for cmd in places:
            if cmd.output:
                assert matches(cmd.output, done.stdout), \
                    f"{cmd.id}: the output shown is not what `{text}` prints:\n{done.stdout}"


@pytest.mark.parametrize("cmd", SLOW, ids=[c.id for c in SLOW])
def test_slow_command_is_accepted_without_running(cmd):
    for words in parts(cmd.text):
        check_static(words, cmd.id)


@pytest.mark.parametrize("cmd", ALL_INLINE, ids=[c.id for c in ALL_INLINE])
def test_command_in_running_text_is_accepted(cmd):
    """Inline commands may elide (``TARGET ...``): their options are checked, not a parse."""
    where = cmd.id
    if cmd.text.startswith("memsim "):
        sub = cmd.text.split()[1]
        options = subparser(sub)._option_string_actions
        for flag in re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", cmd.text):
            assert flag in options, f"{where}: memsim {sub} has no option {flag}"
        target = next((w for w in cmd.text.split()[2:] if ":" in w and not w.startswith("-")),
                      None)
        if target and target.split(":")[0].startswith(("examples/", "tests/")):
            check_target(target, where)
        return
    for words in parts(cmd.text):
        check_static(words, where)


def test_console_blocks_start_with_a_command():
    assert not MALFORMED, "a console block starts with a '$ ' command:\n" + "\n".join(MALFORMED)


def test_the_readme_sets_up_with_the_ci_commands():
    """Exactly two set-up commands: install and run the main job; install and run the tests,
    with the test command ``.ci/run`` runs, installed as ``.ci/run`` installs."""
    readme = ROOT / "README.md"
    lines = readme.read_text(encoding="utf-8").splitlines()
    start = lines.index("## Set-up") + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("## ")) + 1
    cmds = [c for c in console_commands(readme) if start < c.line < end]
    assert len(cmds) == 2, [c.text for c in cmds]
    main, tests = (parts(c.text) for c in cmds)
    assert main[0][:2] == ["pip", "install"] and main[1][:2] == ["memsim", "analyze"]
    assert tests[0][:2] == ["pip", "install"] and "pytest" in tests[1]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    test_command = " ".join(tests[1])
    assert re.search(rf"^{re.escape(test_command)}$", ci, re.M), \
        f".ci/run does not run the README's test command {test_command!r}"
    install = next(shlex.split(line) for line in ci.splitlines() if "pip install" in line)
    for w in tests[0][2:]:
        assert w in install, f".ci/run installs otherwise than the README ({w!r})"


PYCON = [b for d in DOCS for b in blocks(d) if b.lang == "pycon"]
PYTHON = [b for d in DOCS for b in blocks(d) if b.lang == "python"]


@pytest.mark.parametrize("block", PYCON, ids=[f"{rel(b.doc)}:{b.line}" for b in PYCON])
def test_pycon_example_runs(block, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    test = doctest.DocTestParser().get_doctest("\n".join(block.lines) + "\n", {},
                                               f"{rel(block.doc)}:{block.line}",
                                               str(block.doc), block.line)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.failures == 0 and test.examples, f"{test.name}: see the doctest output above"


@pytest.mark.parametrize("block", PYTHON, ids=[f"{rel(b.doc)}:{b.line}" for b in PYTHON])
def test_python_example_parses(block):
    ast.parse("\n".join(block.lines))


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(doc).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            out.add(s if n == 0 else f"{s}-{n}")
            seen[s] = n + 1
    return out


LINKED = DOCS + HISTORY


@pytest.mark.parametrize("doc", LINKED, ids=[rel(d) for d in LINKED])
def test_every_relative_link_resolves(doc):
    bad = []
    for m in LINK.finditer(prose(doc)):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {rel(dest)}")
    assert not bad, f"{rel(doc)}: " + "; ".join(bad)


def check_test_ref(path: str, name: str, where: str) -> None:
    src = ROOT / path
    assert src.is_file(), f"{where}: no such file {path}"
    text = src.read_text(encoding="utf-8")
    assert re.search(rf"^\s*(def|class) {re.escape(name)}\b", text, re.M), \
        f"{where}: {path} has no test {name}"


TEST_REF = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


@pytest.mark.parametrize("doc", DOCS, ids=[rel(d) for d in DOCS])
def test_references_to_tests_and_files_exist(doc):
    text = doc.read_text(encoding="utf-8")
    for m in TEST_REF.finditer(text):
        check_test_ref(m.group(1), m.group(2), rel(doc))
    for line, span in inline_spans(doc):
        m = re.fullmatch(r"([\w.\-]+(?:/[\w.\-]*)+)(?::\w+)?", span)
        if m and m.group(1).split("/")[0] in REPO_TOP:
            assert (ROOT / m.group(1)).exists(), f"{rel(doc)}:{line}: no such path {span}"


def test_every_docs_page_is_linked_from_the_readme():
    readme = prose(ROOT / "README.md")
    linked = {(ROOT / m.group(1).partition("#")[0]).resolve() for m in LINK.finditer(readme)}
    orphans = [rel(d) for d in DOCS[1:] if d.resolve() not in linked and d.name != "README.md"]
    assert not orphans, f"docs pages the README does not link: {orphans}"


DATE = re.compile(r"20\d\d-\d\d-\d\d")


@pytest.mark.parametrize("doc", DOCS, ids=[rel(d) for d in DOCS])
def test_no_dates(doc):
    """History goes to CHANGELOG.md, dated measurements to benchmarks/RESULTS.md."""
    dated = [f"{rel(doc)}:{i}: {line.strip()}" for i, line in
             enumerate(doc.read_text(encoding="utf-8").splitlines(), 1) if DATE.search(line)]
    assert not dated, "\n".join(dated)


def test_the_family_tables_are_the_benchmarks_results():
    """The model-family tables of the README and docs/accuracy.md are what
    ``python3 -m benchmarks.models --write`` wrote from its saved results, and the results cover
    every family of the benchmark, under its current name: a family added, renamed or dropped
    without measuring it, or a table edited by hand, fails here."""
    import json

    pytest.importorskip("transformers")
    from benchmarks import models
    results = json.loads(models.RESULTS.read_text(encoding="utf-8"))["families"]
    assert list(results) == list(models.MODELS), (
        "benchmarks/models.json does not hold every family of benchmarks/models.py in its "
        "order: run python3 -m benchmarks.models --write FAMILY...")
    renamed = [k for k, e in results.items() if e["name"] != models.MODELS[k][0]]
    assert not renamed, f"families renamed since they were measured: {renamed}"
    for page, full in models.PAGES.items():
        text = (ROOT / page).read_text(encoding="utf-8")
        assert models.generated(text) == models.table(results, full, every=True), (
            f"{page}'s family table is not the saved results: run python3 -m benchmarks.models "
            "--write")
