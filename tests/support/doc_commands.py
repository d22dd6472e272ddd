"""The commands the docs tell users to run, checked without running them: every `rtp ...` (or
`python -m pipelines.<name> ...`) line of a ```bash block in README.md, docs/ and examples/ is validated as its
command validates it before taking any resource, minus what needs prepared data, a cluster or a tracking server.
Shell variables (`$RUN_ID`) stand for any value. A doc's ```python blocks whose first line is `# <module>.py` are
its plugin modules: written out, and importable while that doc's commands are checked.

`python -m tests.support.doc_commands DOC.md ...` prints one line per failing command and exits 1 if any failed;
a plugin module of one doc may register what another's does, so check a doc with modules in a process of its own
(tests/unit/test_docs.py does)."""
from __future__ import annotations

import re
import shlex
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC_GLOBS = ("README.md", "docs/**/*.md", "examples/*/README.md", "benchmarks/README.md")
MODULES = {"pipelines.train": "train", "pipelines.sweep.run": "sweep", "pipelines.evaluate": "evaluate",
           "pipelines.predict": "predict", "pipelines.prepare": "prepare", "pipelines.export": "export"}
MODULE_FILE = re.compile(r"#\s*(\w+)\.py\b")
SHELL_VARIABLE = re.compile(r"\$\(\([^)]*\)\)|\$\([^)]*\)|\$\{\w+[^}]*\}|\$\w+")


def doc_paths() -> list[Path]:
    return sorted({path for pattern in DOC_GLOBS for path in ROOT.glob(pattern)})


def fenced_blocks(text: str) -> list[tuple[str, int, str]]:
    """(language, line number of its first line, body) of each fenced block."""
    blocks, language, start, body = [], None, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^\s*```(\S*)", line)
        if fence and language is None:
            language, start, body = fence[1].lower(), number + 1, []
        elif fence:
            blocks.append((language, start, "\n".join(body)))
            language = None
        elif language is not None:
            body.append(line)
    return blocks


def module_blocks(text: str) -> dict[str, str]:
    """{module name: source} of the doc's plugin modules."""
    modules = {}
    for language, _, body in fenced_blocks(text):
        first = body.lstrip().splitlines()[0] if body.strip() else ""
        if language == "python" and (named := MODULE_FILE.match(first)):
            modules[named[1]] = body
    return modules


def shell_commands(body: str, start: int) -> list[tuple[int, str]]:
    """(line number, command) of a shell block: continuations joined, comments dropped, `&&`/`;`/`|` split."""
    commands, pending, first = [], "", start
    for number, line in enumerate(body.splitlines(), start):
        if not pending:
            first = number
        stripped = line.strip()
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        whole, pending = (pending + stripped).strip(), ""
        if whole and not whole.startswith("#"):
            commands.extend((first, part.strip()) for part in re.split(r"&&|\|\||;|\|", whole) if part.strip())
    return commands


def pipeline_call(command: str) -> tuple[str, list[str]] | None:
    """(rtp command, its arguments) of a shell command that runs one (after `ray job submit ... --`, `srun`, an
    environment assignment...), else None. Shell variables become a plain value."""
    try:
        words = shlex.split(SHELL_VARIABLE.sub("x", command), comments=True)
    except ValueError:
        return None
    for i, word in enumerate(words):
        if Path(word).name == "rtp" and i + 1 < len(words):
            return words[i + 1], words[i + 2:]
        if word == "-m" and i + 1 < len(words) and words[i + 1] in MODULES:
            return MODULES[words[i + 1]], words[i + 2:]
    return None


def check_call(command: str, args: list[str]) -> bool:
    """Validate one call as its command would before starting anything (raises its error); False if this command
    is not one whose arguments can be checked so (list, report, replay...) or asks for help."""
    from pipelines.config import checked_values
    from contract.checks import ConfigError

    from pipelines.cli import with_verbose_key

    args = with_verbose_key(command, args)  # as `rtp` passes it on
    if any(arg in ("-h", "--help") for arg in args):
        return False
    if command in ("train", "config"):
        checked_values(args)
    elif command == "sweep":
        from pipelines.sweep.space import load_sweep, split_argv

        name, sweep_overrides, train_overrides = split_argv(args)
        spec = load_sweep(name, sweep_overrides)
        checked_values([*spec.overrides, *train_overrides])
    elif command in ("evaluate", "predict", "export"):
        import importlib

        importlib.import_module(f"pipelines.{command}").parse(args)
    elif command == "prepare":
        from pipelines.prepare import load_dataset_plugins, parse_args

        try:
            load_dataset_plugins(args)
            parse_args(args)
        except SystemExit as exit_:
            if exit_.code:
                raise ConfigError(f"rtp prepare: its arguments do not parse (exit {exit_.code})") from None
    else:
        return False
    return True


def check_doc(path: Path, root: Path = ROOT) -> tuple[int, list[str]]:
    """(commands checked, one line per failing command) of one doc, its plugin modules importable meanwhile."""
    text = path.read_text()
    checked, failures = 0, []
    modules = module_blocks(text)
    with tempfile.TemporaryDirectory() as modules_dir:
        for name, source in modules.items():
            sys.modules.pop(name, None)  # another doc's module of the same name
            (Path(modules_dir) / f"{name}.py").write_text(source)
        sys.path[:0] = [modules_dir, str(path.parent)]
        try:
            for language, start, body in fenced_blocks(text):
                if language not in ("bash", "sh", "shell", "console"):
                    continue
                for number, command in shell_commands(body, start):
                    call = pipeline_call(command)
                    if call is None:
                        continue
                    try:
                        checked += check_call(*call)
                    except Exception as err:  # ConfigError, a plugin's ImportError...: the doc is wrong
                        failures.append(f"{path.relative_to(root)}:{number}: {command}\n    {type(err).__name__}: "
                                        f"{err}")
        finally:
            del sys.path[:2]
    return checked, failures


def main(paths: list[str]) -> int:
    total, failures = 0, []
    for path in paths:
        checked, failed = check_doc(Path(path).resolve())
        total += checked
        failures += failed
    print("\n".join(failures))
    print(f"checked={total} failed={len(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
