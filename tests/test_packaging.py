"""Packaging and build files agree with each other (fast; no build runs here).

The wheels themselves are built, installed into a fresh venv and run by scripts/check_wheel.sh
(CI, after the tests); the Bazel files are linted by scripts/lint_bazel.sh.
"""

from __future__ import annotations

import glob
import os
import re
import tomllib

import jax_cake_gdn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def _pyproject() -> dict:
    return tomllib.loads(_read("pyproject.toml"))


def test_project_metadata():
    p = _pyproject()["project"]
    assert p["name"] == "jax-cake-gdn"
    assert p["version"] == jax_cake_gdn.__version__
    assert p["license"] == "MIT" and p["license-files"] == ["LICENSE"]
    assert "MIT License" in _read("LICENSE")
    assert p["readme"] == "README.md"
    assert "Typing :: Typed" in p["classifiers"]
    assert not any(c.startswith("License ::") for c in p["classifiers"])  # PEP 639: expression only
    assert os.path.isfile(os.path.join(ROOT, "jax_cake_gdn", "py.typed"))


def test_no_cuda_env_makes_a_pure_wheel():
    sk = _pyproject()["tool"]["scikit-build"]
    assert sk["wheel"]["packages"] == ["jax_cake_gdn"]  # every file of the package, py.typed too
    (override,) = [o for o in sk["overrides"] if "JAX_CAKE_GDN_NO_CUDA" in o["if"].get("env", {})]
    assert override["if"]["env"]["JAX_CAKE_GDN_NO_CUDA"] is True
    assert override["wheel"]["cmake"] is False


def test_cmake_and_bazel_build_the_same_kernels():
    """CMakeLists.txt lists the .cu files; BUILD.bazel globs cuda/*.cu: the lists must match."""
    cmake = _read("CMakeLists.txt")
    listed = re.search(r"set\(JCG_CUDA_SOURCES\s+(.*?)\)", cmake, re.S).group(1).split()
    on_disk = sorted(os.path.relpath(p, ROOT)
                     for p in glob.glob(os.path.join(ROOT, "cuda", "*.cu")))
    assert sorted(listed) == on_disk
    build = _read("BUILD.bazel")
    assert 'glob(["cuda/*.cu"])' in build and 'glob(["cuda/*.cuh"])' in build
    assert '"bindings/module.cc"' in build and '"bindings/handlers.inc"' in build
    assert 'name = "jax_cake_gdn/_cuda"' in build  # lands next to the package, as CMake installs it


def test_bazel_module_declares_its_rules_and_version():
    module = _read("MODULE.bazel")
    deps = dict(re.findall(r'bazel_dep\(name = "([^"]+)", version = "([^"]+)"\)', module))
    for rule in ("rules_cc", "rules_python", "rules_cuda", "nanobind_bazel"):
        assert rule in deps, rule
    version = re.search(r'module\(\s*name = "jax_cake_gdn",\s*version = "([^"]+)"', module).group(1)
    assert version == jax_cake_gdn.__version__


def test_bazel_requirements_pin_the_jax_pyproject_asks_for():
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", _read("bazel", "requirements_lock.txt"),
                           re.M))
    assert pins["jax"] == pins["jaxlib"]
    (jax_req,) = [d for d in _pyproject()["project"]["dependencies"] if d.startswith("jax>=")]
    minimum = tuple(int(x) for x in jax_req.split(">=")[1].split("."))
    assert tuple(int(x) for x in pins["jax"].split(".")) >= minimum


def test_ci_runs_the_readme_test_command_then_the_wheel_check():
    ci = _read(".ci", "run")
    readme = _read("README.md")
    assert "bash scripts/test.sh" in readme and "bash scripts/test.sh" in ci
    assert ci.index("scripts/test.sh") < ci.index("scripts/check_wheel.sh")
    assert "scripts/lint_bazel.sh" in ci
