"""Every Python file under scripts/ imports (without running its main): a script whose offspec imports moved or
vanished fails here instead of rotting until someone needs it."""

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").rglob("*.py"))


def test_there_are_scripts_to_check():
    assert len(SCRIPTS) >= 8, SCRIPTS  # scripts/*.py, scripts/replay/*.py, scripts/gpu/*.py


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_script_imports_without_running(path, monkeypatch):
    source = path.read_text(encoding="utf-8")
    if 'if __name__ == "__main__":' not in source:  # a helper module of other scripts: definitions only
        quiet = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign,
                 ast.AnnAssign)
        work = [n for n in ast.parse(source).body[1:] if not isinstance(n, quiet)]
        assert not work, f"{path.name}: its work (line {work[0].lineno}) must wait for a __main__ guard"
    # a script may put its folder or the repo root on sys.path: restored after the test
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", [str(path)])  # nothing at import may read pytest's arguments
    name = "script_" + "_".join(path.relative_to(ROOT / "scripts").with_suffix("").parts)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import does (dataclasses look their module up there)
    try:
        spec.loader.exec_module(module)  # the module's top level; `if __name__ == "__main__"` stays off
    finally:
        # siblings imported by their bare name (suffix_replay imports ceiling) do not stay for other tests
        for key, loaded in list(sys.modules.items()):
            if str(getattr(loaded, "__file__", None) or "").startswith(str(ROOT / "scripts")):
                del sys.modules[key]
    assert module.__file__ == str(path)
