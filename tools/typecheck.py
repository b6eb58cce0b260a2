"""mypy over the checkout, with each module under the name it is imported by.

The parts of the package live at the root of the checkout (shared/, producer/, ...) and
pyproject.toml's [tool.setuptools.package-dir] maps them into `rollstream`. mypy does not
follow that mapping (nor setuptools' editable finder): `mypy -p rollstream` would find
rollstream/__init__.py alone and, with ignore_missing_imports, check nothing else. This
runs mypy's own build with every file of the mapped folders named as its module
(shared/buffer.py is rollstream.shared.buffer), so the per-module settings in
pyproject.toml apply (strict on rollstream.shared.*) and errors name the source files.

    python tools/typecheck.py                 # the package
    python tools/typecheck.py -p chaos        # the package, and chaos imported against it
    python tools/typecheck.py bench tools     # scripts that import rollstream

Other arguments are mypy's own; the exit status is mypy's (0 clean, 1 errors).
"""

from __future__ import annotations

import os
import sys

from mypy import build
from mypy.errors import CompileError
from mypy.main import process_options
from mypy.modulefinder import BuildSource
from static_tree import mapped_modules


def main(argv: list[str]) -> int:
    modules = mapped_modules()
    # mypy's own option parsing (and pyproject.toml's [tool.mypy]); the package needs no
    # target of its own
    targets, options = process_options(argv, require_targets=False)
    # paths as the caller sees them, so that errors name the source files from where it runs
    sources = [BuildSource(os.path.relpath(path), module) for module, path in modules.items()]
    sources += [s for s in targets if s.module not in modules]
    try:
        result = build.build(sources, options)
    except CompileError as e:
        for line in e.messages:
            print(line, file=sys.stderr)
        return 2
    for line in result.errors:
        print(line)
    errors = [line for line in result.errors if ": error:" in line]
    if errors:
        files = len({line.split(":", 1)[0] for line in errors})
        print(f"Found {len(errors)} errors in {files} files (checked {len(sources)} source files)")
        return 1
    print(f"Success: no issues found in {len(sources)} source files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
