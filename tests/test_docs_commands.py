"""Every command the README and the docs show is checked against the code, without running it, so
a flag that is renamed, a default that moves or a config rule that changes fails CI, not a reader.

Where: README.md and every page under docs/ (docs/benchmarks/ included). What: each
`python -m MODULE ...` line of a code block (fenced, or indented four spaces; lines ending in `\\`
joined, `# comments` dropped, and so are leading `VAR=value` words and what comes before `&&`),
for MODULE in pipeline, benchmarks, engines or examples.

- `python -m pipeline.launch ...` is loaded as the launcher loads it, `load_config(argv)`: the flags
  parse, every bound and cross-field rule holds, and the load step finds what it reads (the prompt
  file, the plugins, the model folder, the device, the extras a setting needs, installed as the
  `test` extra installs them). `--print-config` is left out (the launcher takes it), and
  `--node-rank K -- FLAGS` checks FLAGS.
- A block whose commands need what CI has not (a GPU, SGLang, a model folder or files of the
  reader's) is marked on a line of its own before it: `<!-- docs-check: rules (why) -->`. Its
  launcher commands get the pure part only: flags, bounds and cross-field rules, no files, no
  imports. `<!-- docs-check: skip (why) -->` skips a block (a record of a command as it ran once).
  The marker is an HTML comment: neither GitHub nor the site shows it.
- Any other module (pipeline.replay, .plot, .eval, .timeline, benchmarks.*, engines.*, examples.*)
  is parsed by its own argparse parser in a separate process (`tests/docs_argv_check.py`), which
  stops the module before it does anything. `python -m pipeline.eval` hands what it does not take
  to the launcher's config, which is then checked as above.
- In benchmark pages' records of commands, `[...]` marks an optional part (checked as given), `A|B`
  alternatives (the first is checked) and `...` an elision (dropped).
- Inline code in prose that is such a command (with arguments: a bare `python -m X` names the
  module) gets the launcher's pure checks, or its module's parser.
- Every `--flag` written in the README and the docs (not the benchmark pages, which record the flags
  of their day) is a flag of the launcher, of a parser met above or of the built-in engines and
  tools, or one of `OTHER_TOOLS_FLAGS` (SGLang's, slime's, ...), so prose cannot name a flag that
  is gone either.

Figures the docs quote are not measured here; speed goals belong in benchmarks/.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from core.errors import ConfigError
from pipeline.config.draft import Draft
from pipeline.config.load import load_config
from pipeline.config.parsing import build_parser, read_argv
from pipeline.config.rules import check_bounds, check_rules

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MODULES = re.compile(r"(pipeline|benchmarks|engines|examples)(\.\w+)+")
MARKER = re.compile(r"<!--\s*docs-check:\s*(rules|skip)\b")
# Tools whose flags the prose names: the engines' and the pipeline's own, parsed for their flags
# even where no command of theirs is shown.
TOOLS = [
    "engines.builtin",
    "engines.sim",
    "engines.instant",
    "pipeline.replay",
    "pipeline.plot",
    "pipeline.timeline",
    "examples.embedding",
]
# Flags of other programs that the prose names: SGLang's server (what --rollout-engine sglang passes
# it), slime's and verl's flags named for comparison, and the commands CI runs.
OTHER_TOOLS_FLAGS = {
    "--tp-size",
    "--mem-fraction-static",
    "--enable-memory-saver",
    "--enable-return-routed-experts",
    "--calculate-per-token-loss",
    "--load-debug-rollout-data",
    "--kl-coef",
    "--use-kl-in-reward",
    "--check",
    "--strict",
}


@dataclass(frozen=True)
class Command:
    where: str  # page:line
    module: str
    argv: tuple[str, ...]
    mode: str  # "load" (the launcher's whole check), "rules" (the pure part), "parse" (a module's parser)

    def __str__(self) -> str:
        return f"{self.where}: python -m {self.module} {shlex.join(self.argv)}"


def _code_lines(text: str) -> list[tuple[int, str, str | None]]:
    """(line number, command line with its continuations joined, the block's marker) for every code
    line that runs `python -m`."""
    out: list[tuple[int, str, str | None]] = []
    lines = text.split("\n")
    fence: str | None = None
    marker: str | None = None  # the marker of the block being read, or the next one
    in_block = False
    i = 0
    while i < len(lines):
        line, number = lines[i], i + 1
        stripped = line.strip()
        i += 1
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip()
            in_block = fence is not None
            if fence is None:
                marker = None
            continue
        code = (fence is not None and fence in ("", "bash", "sh", "console")) or (
            fence is None and line.startswith("    ") and stripped != ""
        )
        if not code:
            if fence is None and stripped and in_block:
                in_block, marker = False, None  # a paragraph ends the block the marker was for
            if found := MARKER.search(line):
                marker = found.group(1)
            continue
        in_block = True
        while stripped.endswith("\\") and i < len(lines):
            stripped = stripped[:-1] + " " + lines[i].strip()
            i += 1
        # A command starts the line (after VAR=value words, or a pip install and its &&); an indented
        # line of prose in a list item that names `python -m` does not.
        if re.match(r"([A-Z_]+=\S+\s+)*(python3? -m |pip install .*&& *python3? -m )", stripped):
            out.append((number, stripped, marker))
    return out


def _argv(tokens: list[str]) -> list[str]:
    """A benchmark record's notation taken apart: `[...]` optional, `A|B` alternatives, `...` elided."""
    argv = []
    for token in tokens:
        if (token.strip("[]") == "" and token != "") or token.startswith("..."):
            continue
        token = token.lstrip("[").rstrip("]")
        if "|" in token and not token.startswith("-"):
            token = token.split("|")[0]
        argv.append(token)
    return argv


def _commands_in(page: Path) -> list[Command]:
    text = page.read_text(encoding="utf-8")
    name = page.relative_to(ROOT).as_posix()
    found = []
    for number, line, marker in _code_lines(text):
        if marker == "skip":
            continue
        tokens = shlex.split(line, comments=True)
        while "&&" in tokens:
            tokens = tokens[tokens.index("&&") + 1 :]
        while tokens and re.fullmatch(r"[A-Z_]+=.*", tokens[0]):
            tokens = tokens[1:]
        if len(tokens) < 3 or tokens[0] not in ("python", "python3") or tokens[1] != "-m":
            continue
        module, args = tokens[2], _argv(tokens[3:])
        if not MODULES.fullmatch(module):
            continue
        launch = module == "pipeline.launch"
        found.append(
            Command(f"{name}:{number}", module, tuple(args), ("rules" if marker else "load") if launch else "parse")
        )
    # Inline code in prose (a span may wrap a line): the launcher's pure checks, or the module's parser.
    prose = re.sub(r"(?m)^(    .*|```.*)$", "", text)
    for span in re.finditer(r"`python3? -m ((?:pipeline|benchmarks|engines|examples)\.\w+)((?: [^`]*)?)`", prose):
        number = prose.count("\n", 0, span.start()) + 1
        module, args = span.group(1), tuple(_argv(shlex.split(span.group(2).replace("\n", " "))))
        if not args:
            continue  # the module named, not a command line
        found.append(Command(f"{name}:{number}", module, args, "rules" if module == "pipeline.launch" else "parse"))
    return found


@cache
def all_commands() -> tuple[Command, ...]:
    return tuple(c for page in PAGES for c in _commands_in(page))


def _launcher_argv(argv: tuple[str, ...]) -> list[str]:
    args = [a for a in argv if a != "--print-config"]
    if args[:1] == ["--node-rank"]:
        args = args[args.index("--") + 1 :]
    return args


def _problems(argv: list[str], mode: str) -> list[str]:
    """What the launcher would refuse: the whole load (`load`), or flags, bounds and rules (`rules`)."""
    if any(a in ("--help", "-h", "--version") for a in argv):
        return []
    if mode == "load":
        try:
            load_config(argv)
        except ConfigError as exc:
            return list(exc.problems)
        return []
    draft = Draft()
    try:
        read_argv(draft, argv)
    except ConfigError as exc:
        return list(exc.problems)
    check_bounds(draft)
    check_rules(draft)
    return list(draft.problems)


@cache
def parsed() -> dict[tuple[str, tuple[str, ...] | None], dict[str, Any]]:
    """Every non-launcher command, and every tool in TOOLS, through its own parser (one process)."""
    pairs: list[tuple[str, tuple[str, ...] | None]] = [(m, None) for m in TOOLS]
    pairs += [(c.module, c.argv) for c in all_commands() if c.mode == "parse"]
    pairs = list(dict.fromkeys(pairs))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.docs_argv_check"],
        input=json.dumps([[m, None if a is None else list(a)] for m, a in pairs]),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(zip(pairs, json.loads(proc.stdout), strict=True))


def test_the_docs_show_commands_of_every_kind() -> None:
    """The extraction finds what it checks (a regex that found nothing would pass everything)."""
    modes = {c.mode for c in all_commands()}
    modules = {c.module for c in all_commands()}
    assert modes == {"load", "rules", "parse"}
    assert {"pipeline.launch", "pipeline.eval", "benchmarks.modes", "benchmarks.learning"} <= modules
    readme = [c for c in all_commands() if c.where.startswith("README.md:")]
    assert any(c.argv == () and c.mode == "load" for c in readme), "the README's set-up command"
    assert len(all_commands()) >= 40


@pytest.mark.parametrize("command", [c for c in all_commands() if c.module == "pipeline.launch"], ids=str)
def test_every_launcher_command_loads(command: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # relative paths (runs/...) resolve where nothing is
    problems = _problems(_launcher_argv(command.argv), command.mode)
    assert not problems, f"{command}\n" + "\n".join(problems)


def test_every_other_command_parses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    failures = []
    for c in all_commands():
        if c.mode != "parse":
            continue
        result = parsed()[c.module, c.argv]
        if result["error"] is not None:
            failures.append(f"{c}\n  {result['error']}")
        elif c.module == "pipeline.eval" and (problems := _problems(result["extra"], "load")):
            failures.append(f"{c}\n  " + "\n  ".join(problems))
    assert not failures, "\n".join(failures)


def test_every_flag_the_docs_name_exists() -> None:
    known = {*OTHER_TOOLS_FLAGS, "--node-rank"}  # the launcher reads --node-rank before its parser
    for action in build_parser()._actions:
        known.update(action.option_strings)
    for result in parsed().values():
        known.update(result["flags"])
    unknown = []
    for page in PAGES:
        if "benchmarks" in page.relative_to(ROOT).parts:
            continue
        text = page.read_text(encoding="utf-8")
        for match in re.finditer(r"(?<![\w-])--[a-z][a-z0-9-]*", text):
            if match.group(0) not in known:
                line = text.count("\n", 0, match.start()) + 1
                unknown.append(f"{page.relative_to(ROOT)}:{line}: {match.group(0)}")
    assert not unknown, "flags no parser knows:\n" + "\n".join(unknown)


def test_the_readme_opens_with_the_two_set_up_commands_and_ci_runs_its_test_command() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    head = readme[: readme.index("\n## ")]
    assert "    pip install -e . torch==2.13.0 && python -m pipeline.launch\n" in head
    assert "    pip install -e '.[test]' torch==2.13.0 && python -m pytest\n" in head
    assert "python -m pytest" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert len(readme.encode()) <= 25_000, "the README is a front page: details go to docs/"


def test_links_from_the_root_pages_resolve() -> None:
    """mkdocs --strict checks the links between docs pages; these pages are outside the site."""
    broken = []
    for name in ("README.md", "BENCHMARKS.md", "ARCHITECTURE.md", "CHANGELOG.md"):
        text = (ROOT / name).read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not re.match(r"[a-z]+:", target) and not (ROOT / target).exists():
                broken.append(f"{name}: {target}")
    assert not broken, broken
