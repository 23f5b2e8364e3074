"""Every ``train.py`` command the docs show composes, as a user would run it, without training.

The commands are read from README.md and docs/**/*.md: lines of fenced and indented code blocks (shell line
continuations joined, ``$`` prompts, comments and ``sudo`` skipped) and inline code spans, in every form the
docs use: ``python train.py ...`` (any path to python or train.py), ``torchrun ... train.py ...`` (composed
with the ``RANK`` and ``WORLD_SIZE`` its first worker sees) and ``make train ARGS="..."``, with or without
``VAR=value`` prefixes. Each is composed the way ``train.py`` does it before any worker starts
(``engine.config.check_override_keys``, Hydra's ``compose``, ``engine.config.prepare``), so a documented
override that no longer exists, or a value no longer allowed, fails here (an absolute path the command names
that does not exist on this machine, ``data.root=/data/imagenet``, is the reader's: its check is let pass).
A multirun (``-m``) is composed at the first value of every sweep and at each other value of each sweep in turn.

A command shown on purpose as an error (to show the message) is marked in the doc: an HTML comment starting
with ``<!-- invalid`` on the lines just before its code block, or just before the inline span. Such a command
must be refused. Relative links of the docs are checked too: every file exists and every ``#anchor`` names a
heading of its page.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

INVALID = re.compile(r"<!--\s*invalid\b", re.IGNORECASE)
FENCE = re.compile(r"^\s*(```|~~~)")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SHELL_BREAK = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "2>&1"}
# Hydra's command-line flags: those that take a value, and those that do not (neither is an override).
HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--info", "-i"}
HYDRA_FLAGS = {"--help", "-h", "--hydra-help", "--resolve", "--version", "--run", "-r", "--shell-completion"}
HYDRA_UNSUPPORTED = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun"}


@dataclass(frozen=True)
class Command:
    doc: str  # path relative to the repository root
    line: int  # 1-based line where the command starts
    text: str  # as written (continuations joined)
    invalid: bool  # marked in the doc as an example of an error


# ---- extraction ----------------------------------------------------------------------------------------------
def _marked_invalid(lines: list[str], index: int) -> bool:
    """True when an ``<!-- invalid`` comment precedes line ``index`` (only blank lines in between)."""
    i = index - 1
    while i >= 0 and not lines[i].strip():
        i -= 1
    return i >= 0 and bool(INVALID.search(lines[i]))


def _is_train_command(text: str) -> bool:
    return re.search(r"(^|[\s/])train\.py(\s|$)", text) is not None or re.search(r"\bmake\s+train\b", text) is not None


def _code_commands(block: list[tuple[int, str]], doc: str, invalid: bool) -> list[Command]:
    """Commands in one code block: logical lines (``\\`` continuations joined), ``$`` prompts removed."""
    found, pending, start = [], "", 0
    for number, raw in block:
        line = raw.strip()
        if not pending:
            start = number
            if line.startswith("$ "):
                line = line[2:]
            elif line.startswith("#"):
                continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        if _is_train_command(text) and _parses_as_program(text):
            found.append(Command(doc, start, text, invalid))
    return found


def extract(path: Path) -> list[Command]:
    """Every train.py command of one markdown file."""
    doc = str(path.relative_to(ROOT))
    lines = path.read_text().split("\n")
    found: list[Command] = []
    prose: list[tuple[int, str]] = []  # lines outside code blocks, for inline spans
    i = 0
    while i < len(lines):
        line = lines[i]
        if FENCE.match(line):  # fenced code block
            invalid, fence = _marked_invalid(lines, i), FENCE.match(line).group(1)
            i += 1
            block = []
            while i < len(lines) and not lines[i].strip().startswith(fence):
                block.append((i + 1, lines[i]))
                i += 1
            found += _code_commands(block, doc, invalid)
            i += 1
            continue
        indent = len(line) - len(line.lstrip(" "))
        if line.strip() and indent >= 4 and (i == 0 or not lines[i - 1].strip()) and line.lstrip()[0] not in "-*|":
            # an indented code block: it starts after a blank line and runs while lines stay indented
            invalid = _marked_invalid(lines, i)
            block = []
            while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip(" ")) >= indent):
                block.append((i + 1, lines[i]))
                i += 1
            found += _code_commands(block, doc, invalid)
            continue
        prose.append((i + 1, line))
        i += 1
    # inline code spans, which may wrap across the lines of a paragraph
    text = "\n".join(line for _, line in prose)
    numbers = [number for number, _ in prose]
    for match in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
        span = " ".join(match.group(1).split())
        if not (_is_train_command(span) and _parses_as_program(span)):
            continue
        before = text[: match.start()]
        invalid = re.search(r"<!--\s*invalid\b[^>]*-->\s*$", before, re.IGNORECASE) is not None
        found.append(Command(doc, numbers[before.count("\n")], span, invalid))
    return found


def _parses_as_program(text: str) -> bool:
    """A command line (not, say, a line of the layout that names train.py)."""
    try:
        return _program(shlex.split(text, comments=True)) is not None
    except ValueError:  # unbalanced quotes: prose
        return False


def _program(tokens: list[str]) -> tuple[str, int] | None:
    """(program, index of its first argument) after prompts, ``sudo``, ``env`` and ``VAR=value`` prefixes."""
    i = 0
    while i < len(tokens) and (tokens[i] in ("$", "sudo", "env") or ENV_ASSIGNMENT.match(tokens[i])):
        i += 1
    if i >= len(tokens):
        return None
    name = os.path.basename(tokens[i])
    if name == "make" or re.fullmatch(r"python[0-9.]*|torchrun", name):
        return name, i + 1
    return None


def all_commands() -> list[Command]:
    return [command for path in DOCS for command in extract(path)]


# ---- from a command line to what train.py composes -----------------------------------------------------------
def arguments(command: Command) -> tuple[list[str], bool, dict[str, str]]:
    """(train.py's arguments that are overrides, whether it is a multirun, the environment the workers see)."""
    tokens = shlex.split(command.text, comments=True)
    program, i = _program(tokens)
    env = dict(t.split("=", 1) for t in tokens[: i - 1] if ENV_ASSIGNMENT.match(t))  # VAR=value before the program
    for n, token in enumerate(tokens[i:], i):  # the command ends at the first pipe, redirection or separator
        if token in SHELL_BREAK:
            tokens = tokens[:n]
            break
    if program == "make":
        assert tokens[i : i + 1] == ["train"], f"not a train command: {command.text}"
        args = [t.split("=", 1)[1] for t in tokens[i + 1 :] if t.startswith("ARGS=")]
        argv = shlex.split(args[-1]) if args else []
    else:
        scripts = [n for n in range(i, len(tokens)) if os.path.basename(tokens[n]) == "train.py"]
        assert scripts, f"no train.py in: {command.text}"
        if program == "torchrun":  # the workers see the world torchrun starts
            env.update(_torchrun_world(tokens[i : scripts[0]]))
        argv = tokens[scripts[0] + 1 :]
    overrides, multirun, skip = [], False, False
    for n, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg in ("-m", "--multirun"):
            multirun = True
        elif arg in HYDRA_FLAGS_WITH_VALUE:
            skip = n + 1 < len(argv) and not argv[n + 1].startswith("-") and "=" not in argv[n + 1]
        elif arg in HYDRA_FLAGS or arg.split("=", 1)[0] in HYDRA_FLAGS_WITH_VALUE:
            pass
        elif arg in HYDRA_UNSUPPORTED or arg.split("=", 1)[0] in HYDRA_UNSUPPORTED:
            pytest.fail(f"{arg} is not composed by this test; show the command without it: {command.text}")
        else:
            overrides.append(arg)
    return overrides, multirun, env


def _torchrun_world(args: list[str]) -> dict[str, str]:
    """RANK and WORLD_SIZE of the first worker of a torchrun command (nodes x processes per node)."""
    values: dict[str, str] = {}
    for n, arg in enumerate(args):
        key, _, value = arg.partition("=")
        if key in ("--nnodes", "--nproc-per-node", "--nproc_per_node"):
            values[key.replace("_", "-")] = value or (args[n + 1] if n + 1 < len(args) else "1")
    nodes = int(values.get("--nnodes", "1").split(":")[0])
    per_node = values.get("--nproc-per-node", "1")
    per_node = int(per_node) if per_node.isdigit() else 1
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(nodes * per_node)}


def compositions(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override lists a command composes: itself, or for a multirun its sweeps taken one value at a time."""
    if not multirun:
        return [overrides]
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    base, sweeps = [], []
    for o in parsed:
        if not o.is_sweep_override():
            base.append(o.input_line)
            continue
        try:
            values = list(o.sweep_string_iterator())
        except Exception:  # noqa: BLE001 - an interval (Optuna samples it): compose at its lower end
            values = [str(o.value().start)]
        sweeps.append((len(base), o.get_key_element(), values))
        base.append(f"{o.get_key_element()}={values[0]}")
    runs = [base]
    for position, key, values in sweeps:
        for value in values[1:]:
            runs.append([*base[:position], f"{key}={value}", *base[position + 1 :]])
    return runs


_checked: dict[tuple, BaseException | None] = {}  # the docs repeat commands: check and compose each one once
_composed: dict[tuple, BaseException | None] = {}


def check_keys(overrides: list[str]) -> None:
    """train.py's first step, on its arguments as given (a multirun's sweeps included): no unknown key."""
    from engine.config import check_override_keys

    key = tuple(overrides)
    if key not in _checked:
        try:
            check_override_keys(overrides, str(CONF_DIR))
            _checked[key] = None
        except Exception as error:  # noqa: BLE001 - kept to be raised again for the same command
            _checked[key] = error
    if _checked[key] is not None:
        raise _checked[key]


def compose_as_train_py(overrides: list[str]) -> None:
    """Compose and validate one job's config as train.py does before any worker starts; raise what it reports."""
    from hydra import compose, initialize_config_dir

    from engine.config import prepare

    key = (tuple(overrides), os.environ.get("WORLD_SIZE"), os.environ.get("RANK"))
    if key not in _composed:
        try:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                prepare(compose(config_name="train", overrides=overrides))
            _composed[key] = None
        except Exception as error:  # noqa: BLE001 - kept to be raised again for the same command
            _composed[key] = error
    if _composed[key] is not None:
        raise _composed[key]


def first_error(overrides: list[str], multirun: bool) -> tuple[list[str], Exception] | None:
    """The first error train.py would report for these arguments, with the overrides it composed; or None."""
    from hydra.errors import HydraException

    from errors import ConfigError

    try:
        check_keys(overrides)
        runs = compositions(overrides, multirun)
    except (ConfigError, HydraException) as exception:
        return overrides, exception
    for run in runs:
        try:
            compose_as_train_py(run)
        except ConfigError as exception:
            if not _readers_path(exception, run):
                return run, exception
        except HydraException as exception:
            return run, exception
    return None


def _readers_path(error: Exception, overrides: list[str]) -> bool:
    """The error is about an absolute path the command names that does not exist on this machine (a data set on
    the reader's cluster, say): the reader's path, not a mistake of the doc."""
    value = getattr(error, "value", None)
    return (
        "a key of the config" not in getattr(error, "allowed", "")
        and isinstance(value, str)
        and value.startswith("/")
        and not os.path.exists(value)
        and any(o.endswith("=" + value) for o in overrides)
    )


def _shown(text: str) -> str:
    """A command as a test id: its words without the comment."""
    return shlex.join(shlex.split(text, comments=True))


# ---- the tests -----------------------------------------------------------------------------------------------
COMMANDS = all_commands()


def test_the_docs_show_commands():
    """The extractor finds the docs' commands (a broken extractor must not pass by finding none)."""
    assert len(COMMANDS) >= 20, [c.text for c in COMMANDS]
    docs = {c.doc for c in COMMANDS}
    assert {"README.md", "docs/outputs.md", "docs/multinode.md", "docs/failures.md"} <= docs, docs
    forms = " ".join(c.text for c in COMMANDS)
    for form in ("train.py -m ", "torchrun ", "make train ARGS="):
        assert form in forms, form
    assert any(c.invalid for c in COMMANDS), "the README's error examples are marked <!-- invalid -->"
    assert any(len(compositions(*arguments(c)[:2])) > 1 for c in COMMANDS), "a multirun sweep is expanded"


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.doc}:{c.line}: {_shown(c.text)}" for c in COMMANDS])
def test_documented_command_composes(command: Command, monkeypatch):
    overrides, multirun, env = arguments(command)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        if key in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and value.isdigit():
            monkeypatch.setenv(key, value)
    error = first_error(overrides, multirun)
    if command.invalid:
        assert error is not None, f"{command.doc}:{command.line}: marked invalid, yet it composes: {command.text}"
    elif error is not None:
        run, exception = error
        pytest.fail(
            f"{command.doc}:{command.line}: {command.text}\n  composing: {' '.join(run)}\n  error: {exception}",
            pytrace=False,
        )


# ---- links ---------------------------------------------------------------------------------------------------
def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"`|\*\*|\*|\[|\]\([^)]*\)", "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors, in_fence = set(), False
    for line in path.read_text().split("\n"):
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and (m := re.match(r"#{1,6}\s+(.*)", line)):
            slug = _slug(m.group(1))
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _links(path: Path) -> list[str]:
    text, out, in_fence = path.read_text(), [], False
    for line in text.split("\n"):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            out.append(re.sub(r"`[^`]*`", "", line))
    return re.findall(r"\]\(([^)\s]+)\)", "\n".join(out))


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_relative_links_resolve(path: Path):
    broken = []
    for link in _links(path):
        if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        if not file.exists():
            broken.append(f"{link}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{link}: no heading with that anchor")
    assert not broken, broken
