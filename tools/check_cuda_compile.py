"""Compile-check every CUDA translation unit of csrc/cuda for sm_90a, with CUTLASS, on a machine without a GPU.

The project's machines have a CPU build of torch, so `pip install -e .` never compiles csrc/cuda there and a
C++ or template error in it would only show on a GPU machine. This script compiles each csrc/cuda source to a
throwaway object file with the command a CUDA build of setup.py would run for MOE_CORE_CUDA_ARCHS=90a and
MOE_CORE_SM90_TUNING=1 (so the tuning kernels are checked too): it asks
setup.py's _extension() and torch's BuildExtension for the compile commands (recording them instead of running
them), then runs those commands in parallel and reports per-file times. It needs nvcc on the PATH and the
CUTLASS headers (the nvidia-cutlass wheel or CUTLASS_PATH, as setup.py finds them); no GPU and no CUDA torch.

    python tools/check_cuda_compile.py [-j JOBS] [SOURCE ...]     # SOURCE: e.g. grouped_gemm_sm90.cu
    python tools/check_cuda_compile.py --changed-since BASE       # CI's lane: only what a change can break

With --changed-since, the files changed between the git revision BASE and the work tree pick the sources:
nothing under csrc/cuda, setup.py or this tool changed: none (exit 0); a header that translation units of
several kernels include (a kernel: the Hopper units of one kernel family, rowtile, rowrange or ptrarray, or one
other unit): all of them; otherwise one representative per family that a changed file reaches (a family: the
Hopper units of one kernel family and pass, or one other unit), plus every changed unit itself. setup.py or this
tool changed: one representative per family.

Exits non-zero, printing the compiler's output, if any file fails to compile.
"""

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from setuptools import Distribution
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUTLASS_HINT = "pip install nvidia-cutlass==4.2.0.0, or set CUTLASS_PATH to a CUTLASS checkout"


def _fail(message: str):
    sys.exit(f"check_cuda_compile: {message}")


def _cuda_home(nvcc: str) -> str:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    # nvcc on the PATH may be a wrapper script (the CI machine's /usr/local/bin/nvcc is), so torch's guess,
    # the directory above nvcc, can miss the toolkit's headers: ask nvcc where its toolkit is.
    out = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                         capture_output=True, text=True)
    top = re.search(r"^#\$ TOP=(.*)$", out.stdout + out.stderr, re.MULTILINE)
    if top is None:
        _fail(f"cannot tell where {nvcc}'s CUDA toolkit is; set CUDA_HOME")
    return os.path.realpath(top.group(1))


def _load_setup_py():
    spec = importlib.util.spec_from_file_location("moe_core_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _RecordCommands(cpp_extension.BuildExtension):
    """BuildExtension whose compiler records each command line instead of running it."""

    def build_extensions(self):
        self.commands = []
        # Recent setuptools runs compilers through call(), older ones through spawn().
        self.compiler.call = self.compiler.spawn = lambda command, **kwargs: self.commands.append(list(command))
        super().build_extensions()


def compile_commands(build_dir: str) -> dict[str, list[str]]:
    """Source path (relative to the repository) -> the command that compiles it in an sm_90a CUDA build."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        _fail("nvcc is not on the PATH (a CUDA toolkit is needed to check the CUDA sources)")
    # A CPU build of torch leaves CUDA_HOME unset, and both CUDAExtension and BuildExtension need it.
    cpp_extension.CUDA_HOME = _cuda_home(nvcc)
    os.environ["MOE_CORE_CUDA"] = "1"
    os.environ["MOE_CORE_CUDA_ARCHS"] = "90a"  # the Hopper kernels compile only for sm_90a
    os.environ["MOE_CORE_SM90_TUNING"] = "1"  # and the tuning kernels with them
    setup_py = _load_setup_py()
    cutlass = setup_py._cutlass_include()
    if not cutlass or not os.path.isfile(os.path.join(cutlass[0], "cutlass", "cutlass.h")):
        _fail(f"CUTLASS headers not found ({cutlass or 'no nvidia-cutlass wheel, no CUTLASS_PATH'}): {CUTLASS_HINT}")

    build = _RecordCommands(Distribution({"name": "moe_core", "ext_modules": [setup_py._extension()]}),
                            use_ninja=False)  # ninja would run the compiles itself
    build.build_temp = os.path.join(build_dir, "obj")
    build.build_lib = os.path.join(build_dir, "lib")
    build.force = True
    build.ensure_finalized()
    build.run()
    extra = []
    torch_include = cpp_extension.include_paths()[0]
    if not os.path.isfile(os.path.join(torch_include, "c10", "cuda", "impl", "cuda_cmake_macros.h")):
        # A CPU torch lacks the one header that a CUDA torch's build generates; it only defines
        # C10_CUDA_BUILD_SHARED_LIBS, which matters on Windows alone, so skip it the way torch's ROCm build does.
        extra.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    commands = {}
    for command in build.commands:
        if "-c" not in command:
            continue  # the link, which a CPU torch (no libtorch_cuda) could not do anyway
        source = os.path.relpath(command[command.index("-o") - 1], ROOT)
        if source.startswith(os.path.join("csrc", "cuda", "")):
            commands[source] = command + extra
    if not any("-DMOE_CORE_WITH_SM90=1" in command for command in commands.values()):
        _fail("setup.py no longer defines MOE_CORE_WITH_SM90 for sm_90a; the Hopper kernels would compile empty")
    return commands


# A Hopper unit's kernel family and pass, whatever its dtype, layout, tile and cluster (the file names of
# tools/gen_sm90_instances.py).
_FAMILY = re.compile(r"grouped_gemm_sm90_(rowtile|rowrange|ptrarray)_(fwd|wgrad_accum|wgrad)_")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
_BUILD_FILES = ("setup.py", "tools/check_cuda_compile.py")


def family(source: str) -> str:
    """The family of a csrc/cuda translation unit (see the module docstring)."""
    match = _FAMILY.search(os.path.basename(source))
    if match is None:
        return os.path.basename(source)
    return f"sm90_{match.group(1)}_{match.group(2)}"


def kernel(source: str) -> str:
    """The kernel of a csrc/cuda translation unit: its Hopper kernel family, or the unit itself."""
    match = _FAMILY.search(os.path.basename(source))
    return f"sm90_{match.group(1)}" if match else os.path.basename(source)


def _headers(path: str, seen: set[str]) -> set[str]:
    """The csrc headers ``path`` includes, transitively (repository-relative paths)."""
    with open(path) as f:
        for name in _INCLUDE.findall(f.read()):
            for folder in (os.path.dirname(path), "csrc"):
                header = os.path.normpath(os.path.join(folder, name))
                if os.path.isfile(header) and header not in seen:
                    seen.add(header)
                    _headers(header, seen)
                    break
    return seen


def changed_sources(sources: list[str], changed: set[str]) -> list[str]:
    """The translation units worth compiling when the repository-relative ``changed`` files changed."""
    families: dict[str, list[str]] = {}
    for source in sorted(sources):
        families.setdefault(family(source), []).append(source)
    if changed & set(_BUILD_FILES):
        return sorted({units[0] for units in families.values()} | (changed & set(sources)))
    picked = set(changed & set(sources))
    for units in families.values():
        reached = [unit for unit in units if _headers(unit, set()) & changed]
        if reached:
            picked.add(reached[0])
    reached_kernels = {kernel(s) for s in sources if _headers(s, set()) & changed}
    if len(reached_kernels) > 1:
        return sorted(sources)  # a header shared by several kernels: everything
    return sorted(picked)


def git_changed_files(base: str) -> set[str]:
    """Files that differ between the git revision ``base`` and the work tree, untracked ones included."""
    def git(*args: str) -> list[str]:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        if out.returncode:
            _fail(f"git {' '.join(args)}: {out.stderr.strip()}")
        return out.stdout.split()
    return set(git("diff", "--name-only", base)) | set(git("ls-files", "--others", "--exclude-standard"))


def _compile(command: list[str]) -> tuple[int, str, float]:
    start = time.monotonic()
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return result.returncode, result.stdout, time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="*", help="check only these csrc/cuda files (path or file name)")
    parser.add_argument("--changed-since", metavar="BASE",
                        help="git revision: check only what the files changed since it can break")
    # sched_getaffinity, unlike cpu_count, honours a CPU set given to the container.
    default_jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parser.add_argument("-j", "--jobs", type=int, default=default_jobs, help=f"parallel compiles ({default_jobs})")
    args = parser.parse_args()

    os.chdir(ROOT)  # setup.py's paths are relative to the repository root
    if args.changed_since:
        changed = git_changed_files(args.changed_since)
        relevant = sorted(f for f in changed if f.startswith("csrc/cuda/") or f in _BUILD_FILES
                          or (f.startswith("csrc/") and f.endswith(".h")))
        if not relevant:
            print(f"check_cuda_compile: no CUDA source, setup.py or this tool changed since {args.changed_since}; "
                  "nothing to compile")
            return 0
        print(f"changed since {args.changed_since}: {' '.join(relevant)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="moe_core_cuda_check_") as build_dir:
        commands = compile_commands(build_dir)
        if args.sources:
            wanted = {os.path.basename(s) for s in args.sources}
            commands = {s: c for s, c in commands.items() if os.path.basename(s) in wanted}
            missing = wanted - {os.path.basename(s) for s in commands}
            if missing:
                _fail(f"not CUDA sources of csrc/cuda: {' '.join(sorted(missing))}")
        if args.changed_since:
            commands = {s: commands[s] for s in changed_sources(list(commands), changed)}
        print(f"compiling {len(commands)} CUDA sources for sm_90a, {args.jobs} at a time", flush=True)
        start = time.monotonic()
        failed, warned, times = [], [], {}
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = {pool.submit(_compile, command): source for source, command in commands.items()}
            for future in as_completed(futures):
                source = futures[future]
                code, output, seconds = future.result()
                times[source] = seconds
                status = "FAIL" if code else ("warn" if output.strip() else "ok")
                print(f"{status:4} {seconds:7.1f}s  {source}", flush=True)
                if code:
                    failed.append((source, output))
                elif output.strip():
                    warned.append((source, output))
        wall = time.monotonic() - start

    # The CUTLASS configurations share their headers' warnings: print each distinct output once.
    outputs = {}
    for source, output in warned + failed:
        outputs.setdefault(output.rstrip(), []).append(source)
    for output, sources in outputs.items():
        print(f"\n===== {' '.join(sources)} =====\n{output}")
    slowest = max(times, key=times.get)
    print(f"\n{len(times)} files in {wall:.0f}s wall ({sum(times.values()):.0f}s of compiling, {args.jobs} jobs); "
          f"slowest {slowest} {times[slowest]:.0f}s; {len(warned)} with warnings, {len(failed)} failed")
    if failed:
        print("FAILED: " + " ".join(source for source, _ in failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
