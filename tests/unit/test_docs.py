"""The docs against the code: the config reference is what its generator prints from the schemas, every `rtp`
command the docs show passes its command's checks (tests/support/doc_commands.py), and no page narrates the
project's own development."""
from __future__ import annotations

import re
import subprocess
import sys
from typing import Iterator

import pytest

from pipelines.config_reference import REFERENCE, reference
from tests.conftest import ROOT
from tests.support.doc_commands import check_doc, doc_paths, module_blocks, pipeline_call, shell_commands

DIARY = re.compile(r"stop [0-9]+|the issue|#[0-9]+ asks", re.IGNORECASE)
# Code comments say what the code does and why: no history of a change, no one run's figures
CODE_DIARY = re.compile(r"stop [0-9]+|the issue|#[0-9]+ asks|\bCI of [0-9a-f]{7}|\bused to (?:be|come|say|take)\b|"
                        r"\bbefore this change\b|\bmeasured: [0-9]", re.IGNORECASE)
CODE_FOLDERS = ("contract", "trainers", "pipelines", "cluster", "benchmarks", "tests", "conf")


def test_config_reference_is_generated_from_the_schemas():
    assert REFERENCE.read_text() == reference(), \
        "docs/config-reference.md is out of date: python -m pipelines.config_reference --write"


@pytest.mark.slow  # a process per page with plugin modules
def test_every_documented_command_validates():
    """In child processes, as the plugins the docs load register models and datasets for good: a doc with plugin
    modules of its own in a process of its own (another doc's module may share its name), the others together."""
    paths = doc_paths()
    assert {"README.md", "docs/training.md", "docs/slurm.md"} <= {str(p.relative_to(ROOT)) for p in paths}
    with_modules = [path for path in paths if module_blocks(path.read_text())]
    groups = [[path] for path in with_modules] + [[path for path in paths if path not in with_modules]]
    checked, failures = 0, []
    for group in groups:
        done = subprocess.run([sys.executable, "-m", "tests.support.doc_commands", *map(str, group)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        checked += int(re.search(r"checked=(\d+)", done.stdout)[1])
        failures += [line for line in done.stdout.splitlines() if not line.startswith("checked=") and line]
    assert not failures, "\n".join(failures)
    assert checked >= 100  # the extraction itself still finds the docs' commands


@pytest.mark.parametrize("command, error", [
    ("rtp train trainer=ddp trainer.lrr=0.1", "trainer.lrr"),
    ("ray job submit --working-dir . -- rtp train model=resnet", "resnet"),
    ("python -m pipelines.train trainer=tp trainer.tp=3", "trainer"),
    ("rtp sweep sweep=smoke sweep.nope=1", "sweep.nope"),
    ("rtp evaluate model=$RUN_ID batchsize=3", "batchsize"),
])
def test_a_wrong_documented_command_is_caught(tmp_path, command, error):
    doc = tmp_path / "page.md"
    doc.write_text(f"Text.\n\n```bash\n{command}\n```\n")
    checked, failures = check_doc(doc.resolve(), root=tmp_path)
    assert checked == 0 and len(failures) == 1 and error in failures[0]


def test_commands_are_found_across_continuations_and_wrappers():
    body = "export X=1\nsrun -N 2 \\\n  rtp train trainer=fsdp \\\n  model=cnn  # comment\nrtp list && rtp config -v\n"
    commands = shell_commands(body, 10)
    assert commands[1] == (11, "srun -N 2 rtp train trainer=fsdp model=cnn  # comment")
    assert pipeline_call(commands[1][1]) == ("train", ["trainer=fsdp", "model=cnn"])
    assert [pipeline_call(c) for _, c in commands[2:]] == [("list", []), ("config", ["-v"])]


def test_no_page_narrates_the_projects_development():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "benchmarks" / "README.md"]
    found = [f"{page.relative_to(ROOT)}:{n}: {line.strip()}" for page in pages
             for n, line in enumerate(page.read_text().splitlines(), 1) if DIARY.search(line)]
    assert not found, "\n".join(found)


def comments_and_docstrings(path) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python module."""
    import ast
    import io
    import tokenize

    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str):
                yield first.lineno, first.value.value


def test_no_code_comment_narrates_the_projects_development():
    found = []
    for folder in CODE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += [f"{path.relative_to(ROOT)}:{line}: {text.strip()[:100]}"
                      for line, text in comments_and_docstrings(path) if CODE_DIARY.search(text)]
        for path in sorted((ROOT / folder).rglob("*.sh")) + sorted((ROOT / folder).rglob("*.yaml")):
            found += [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for n, line in
                      enumerate(path.read_text().splitlines(), 1) if "#" in line and CODE_DIARY.search(line)]
    assert not found, "\n".join(found)
