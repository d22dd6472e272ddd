"""How long the commands that start nothing take, whole processes as a user runs them: `rtp --help`, `rtp list`,
`rtp train --help`, `rtp config` (the demo's config, validated), and `python -c pass` on the same interpreter, the
floor any Python command pays.

    python -m benchmarks.cli_startup [--repeats 7]

Each command `--repeats` times after one warm-up, from a directory outside the checkout; prints the median and the
range of wall seconds of each, and the framework and Ray modules each imported (none is the point: those take
seconds). Last line: `rtp_help_s=<median seconds of rtp --help>`.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import MNIST, ensure_mnist

RTP = Path(sys.executable).with_name("rtp")
PROBE = ("import runpy, sys; sys.argv = ['rtp', *sys.argv[1:]]; code = 0\n"
         "try:\n    runpy.run_module('pipelines.cli', run_name='__main__')\nexcept SystemExit as end:\n"
         "    code = end.code or 0\n"
         "heavy = sorted(m for m in sys.modules if m in ('torch', 'tensorflow', 'ray', 'tf_keras', 'horovod'))\n"
         "print('imported:', ','.join(heavy) or 'none', file=sys.stderr)\nsys.exit(code)")


def timed(command: list[str], cwd: str, repeats: int) -> list[float]:
    subprocess.run(command, cwd=cwd, capture_output=True, check=True)  # warm-up: the page cache, bytecode
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, cwd=cwd, capture_output=True, check=True)
        seconds.append(time.perf_counter() - start)
    return seconds


def imported(args: list[str], cwd: str) -> str:
    """The framework and Ray modules `rtp <args>` imported, from the same command run under a probe."""
    probe = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=cwd, capture_output=True, text=True)
    return probe.stderr.strip().splitlines()[-1].removeprefix("imported: ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    ensure_mnist()
    commands = {"python -c pass": [sys.executable, "-c", "pass"], "rtp --help": [str(RTP), "--help"],
                "rtp list": [str(RTP), "list"], "rtp train --help": [str(RTP), "train", "--help"],
                "rtp config (the demo's)": [str(RTP), "config", f"data.path={MNIST}"]}
    medians = {}
    with tempfile.TemporaryDirectory() as away:
        for name, command in commands.items():
            seconds = timed(command, away, args.repeats)
            medians[name] = statistics.median(seconds)
            heavy = imported(command[1:], away) if command[0] == str(RTP) else "-"
            print(f"{name:<26} median {medians[name]:.2f} s  (min {min(seconds):.2f}, max {max(seconds):.2f}; "
                  f"{args.repeats} runs)  framework/Ray modules imported: {heavy}", flush=True)
    print(f"rtp_help_s={medians['rtp --help']:.2f}")


if __name__ == "__main__":
    main()
