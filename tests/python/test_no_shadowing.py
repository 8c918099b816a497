"""No test folder hides a package (issue 26): pytest puts tests/ on
sys.path, so tests/torch was imported as `torch` wherever torch was not
installed, and the suites failed instead of skipping."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tests/conftest.py by its path ("conftest" is tests/python's in sys.modules)
_spec = importlib.util.spec_from_file_location("gs_tests_conftest",
                                               os.path.join(TESTS, "conftest.py"))
tests_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tests_conftest)


def test_no_folder_under_tests_is_named_like_a_package():
    tests_conftest.check_no_shadowing()  # raises naming the folder


def test_a_folder_named_like_a_package_is_an_error(tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "test_x.py").write_text("")
    (tmp_path / "python").mkdir()
    (tmp_path / "jax" / "__pycache__").mkdir(parents=True)  # left behind by a rename: harmless
    with pytest.raises(pytest.UsageError, match=r"tests/torch\b"):
        tests_conftest.check_no_shadowing(str(tmp_path))


def test_tests_dir_on_the_path_does_not_resolve_a_package_to_a_test_folder():
    # what `import torch` finds with tests/ first on sys.path, in a fresh
    # interpreter: the installed package or nothing, never a folder of tests/
    code = ("import importlib.util, sys; sys.path.insert(0, sys.argv[1]);"
            "import json; print(json.dumps({n: (s.submodule_search_locations and "
            "list(s.submodule_search_locations)) if (s := importlib.util.find_spec(n)) "
            "else None for n in sys.argv[2:]}))")
    p = subprocess.run([sys.executable, "-c", code, TESTS, *tests_conftest.PACKAGES],
                       capture_output=True, text=True, check=True)
    for name, where in json.loads(p.stdout).items():
        for loc in where or []:
            assert not os.path.abspath(loc).startswith(TESTS + os.sep), (name, loc)
    assert importlib.util.find_spec("gradsync") is not None
