"""The package's shape as users meet it: light imports, a fast command line, capture failures
told apart from bugs, the transformers version check."""

import ast
import re
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

from encoder_graphs.engine.capture import is_capture_failure
from encoder_graphs.seam import TESTED_RANGE, check_version


def loaded_after(code: str) -> set[str]:
    """Which of torch / transformers a fresh interpreter has loaded after running `code`."""
    probe = f"{code}\nimport sys\nprint('loaded:', *(m for m in ('torch', 'transformers') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(result.stdout.splitlines()[-1].split()[1:])


@pytest.mark.parametrize(
    "code, heavy",
    [
        ("import encoder_graphs", set()),
        ("import encoder_graphs.packing", set()),
        ("import encoder_graphs.protocols", {"torch"}),
        ("import encoder_graphs.models", set()),
        ("import encoder_graphs.report", set()),
        ("from encoder_graphs.models.registry import option_help; option_help('max_tiles')", set()),
        ("from encoder_graphs.app.cli import main; main(['--help'])", set()),
        ("from encoder_graphs.app.cli import main; main(['caption'])", set()),
        ("from encoder_graphs.app.cli import main; main(['caption', '/no/such/path'])", set()),
        # a dry run over a clip says which video decoder `auto` takes, without torch where it is the CPU's
        (("import tempfile, pathlib; d = pathlib.Path(tempfile.mkdtemp()); (d / 'a.mp4').write_bytes(b'x'); "
          "from encoder_graphs.app.cli import main; main(['caption', str(d), '--dry-run', '--out', str(d / 'o.jsonl')])"), set()),
    ],
)
def test_imports_stay_light(code, heavy):
    try:
        assert loaded_after(f"try:\n    {code}\nexcept SystemExit:\n    pass") == heavy
    except subprocess.CalledProcessError as error:
        pytest.fail(error.stderr)


def test_the_root_exports_its_names_lazily():
    assert loaded_after("from encoder_graphs import EncoderCudaGraphManager") == {"torch"}
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        import encoder_graphs

        encoder_graphs.nope  # noqa: B018


def test_only_capture_failures_drop_a_graph():
    assert is_capture_failure(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert is_capture_failure(RuntimeError("operation not permitted when stream is capturing"))
    assert is_capture_failure(RuntimeError("CUDA error: operation failed due to a previous error during capture"))
    assert not is_capture_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_capture_failure(ValueError("capture inputs of the wrong size"))
    assert not is_capture_failure(KeyError("pixel_values"))


def test_an_untested_transformers_version_warns_once_naming_the_range():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert check_version(TESTED_RANGE[0]) and check_version("5.23.4")
        assert not check_version("9.0.0") and not check_version("9.0.0")
        assert not check_version("5.16.2")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and all("5.17.0 to 5.23.x" in m for m in messages)
    assert "9.0.0 is untested" in messages[0]


ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("encoder_graphs.models.qwen", "encoder_graphs.models.internvl", "encoder_graphs.models.deepseek_ocr")
GATHERERS = {"models/registry.py", "encoder_graphs/presets/catalog.py"}  # they list every family


def package_imports(path: Path) -> set[str]:
    """The `encoder_graphs` modules a source file imports, at any depth (lazy imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.startswith("encoder_graphs")}


def sources(top: str) -> dict[str, set[str]]:
    """Each source file under `top` (a folder of the repository) and the package modules it imports."""
    return {str(path.relative_to(ROOT)): package_imports(path) for path in sorted((ROOT / top).rglob("*.py"))}


def model_sources() -> dict[str, set[str]]:
    return sources("models")


def test_models_hold_the_families_the_registry_and_common_only():
    """What is not one family's knowledge lives in `encoder_graphs/` under a name that says what it
    is (kernels, attention, rewrites, seam, presets, decoder/layers)."""
    entries = {path.name for path in (ROOT / "models").iterdir() if path.is_file() or any(path.rglob("*.py"))}
    assert entries == {"__init__.py", "registry.py", "common", "qwen", "internvl", "deepseek_ocr"}


def test_models_import_nothing_above_them():
    above = ("encoder_graphs.engine", "encoder_graphs.decoder", "encoder_graphs.app", "encoder_graphs.enable",
             "encoder_graphs.report")
    wrong = {path: sorted(n for n in names if n.startswith(above)) for path, names in model_sources().items()}
    assert not {path: names for path, names in wrong.items() if names}


@pytest.mark.parametrize("top", ["encoder_graphs/app", "encoder_graphs/decoder", "encoder_graphs/engine",
                                 "encoder_graphs/kernels",
                                 "encoder_graphs/attention", "encoder_graphs/rewrites", "encoder_graphs/seam",
                                 "models/common", "packing", "protocols"])
def test_what_serves_every_family_imports_no_family(top):
    wrong = {path: sorted(n for n in names if n.startswith(FAMILIES)) for path, names in sources(top).items()}
    assert not {path: names for path, names in wrong.items() if names}


FAMILY_NAMES = re.compile(r"qwen|internvl|deepseek", re.IGNORECASE)


@pytest.mark.parametrize("top", ["encoder_graphs/app", "encoder_graphs/decoder", "encoder_graphs/engine"])
def test_what_serves_every_family_names_none_in_its_code(top):
    """A family's knowledge (its sizing, help text, positions, generation overrides) comes through
    its hooks (`ModelFamily`, `CaptionInputs`, `models/<family>/help.py`): no string or name in
    the code here names a family; docstrings and comments may, to say why."""
    found = []
    for path in sorted((ROOT / top).rglob("*.py")):
        tree = ast.parse(path.read_text())
        owners = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        docstrings = {id(node.body[0].value) for node in ast.walk(tree) if isinstance(node, owners) and node.body
                      and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                text = node.value
            else:
                text = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
            if FAMILY_NAMES.search(text):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text[:60]!r}")
    assert not found, found


def test_families_import_no_other_family():
    for path, names in model_sources().items():
        if path in GATHERERS:
            continue
        own = "encoder_graphs." + ".".join(Path(path).parts[:2])
        others = [family for family in FAMILIES if family != own]
        assert not [n for n in names if n.startswith(tuple(others))], path


def test_kernels_import_only_their_guards_and_each_other():
    for path, names in sources("encoder_graphs/kernels").items():
        assert all(n.startswith("encoder_graphs.kernels") for n in names), (path, names)


def test_every_package_folder_ships_in_the_wheel_and_no_fixture_does():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {f"encoder_graphs.{p.parent.relative_to(ROOT).as_posix().replace('/', '.')}"
               for top in ("models", "protocols", "packing") for p in (ROOT / top).rglob("__init__.py")}
    folders |= {p.parent.relative_to(ROOT).as_posix().replace("/", ".") for p in (ROOT / "encoder_graphs").rglob("__init__.py")}
    assert folders <= set(project["packages"]), sorted(folders - set(project["packages"]))
    shipped = {p.name for top in ("encoder_graphs", "models", "protocols", "packing") for p in (ROOT / top).rglob("*.py")}
    assert not shipped & {"toy_vit.py", "synthetic_prompts.py", "tiny_internvl.py"}


def transformers_imports(path: Path) -> set[str]:
    """The transformers modules and names a source file imports (`transformers.x.Name` for names)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "transformers":
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "transformers"}
    return found


def test_transformers_internals_are_reached_only_through_the_seam():
    """Outside `encoder_graphs/seam/`: transformers' public top level (its model, config and processor
    classes), its output dataclasses and its logging; no registration, cache or generation
    internals, no modeling module."""
    public = ("transformers.modeling_outputs.", "transformers.utils.logging")
    internals = {"AttentionInterface", "Cache", "CacheLayerMixin", "DynamicCache", "GenerationMixin"}
    for top in ("encoder_graphs", "models", "protocols", "packing"):
        for path in (ROOT / top).rglob("*.py"):
            if "seam" in path.relative_to(ROOT).parts:
                continue
            for name in transformers_imports(path):
                module, _, imported = name.rpartition(".")
                assert module == "transformers" or name.startswith(public) or name == "transformers", (path, name)
                assert imported not in internals, (path, name)


def test_importing_the_decoder_registers_its_attention_implementations():
    """The packed prefill's and the decode step's attention are registered with transformers by
    importing the decoder, whatever else was imported first (the seam does it once)."""
    probe = (
        "import encoder_graphs.decoder.runner\n"
        "from transformers import AttentionInterface\n"
        "names = AttentionInterface()\n"
        "print(all(n in names for n in ('encoder_graphs_packed_causal', 'encoder_graphs_static_kv_decode')))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.split()[-1] == "True", result.stderr


def test_eager_reasons_are_members_counted_and_shown_by_their_text():
    """Reasons are enum members; the statistics' JSON and the report show each one's text, and a
    member and its text are the same key (a torchrun job merges its ranks' JSON by text)."""
    import json

    from encoder_graphs.packing.reasons import EagerReason, counts_by_text

    counted = counts_by_text(Counter({EagerReason.NO_CUDA: 2, EagerReason.CAPTURE_FAILED: 1}))
    assert json.loads(json.dumps(counted)) == {"no CUDA device": 2, "capture failed": 1}
    assert all(type(key) is str for key in counted)
    assert f"{EagerReason.GPU_BOUND}" == str(EagerReason.GPU_BOUND) == "GPU-bound size, not captured"
    assert {"eager measured faster": 1} == {EagerReason.EAGER_CHEAPER: 1}
    assert len({reason.value for reason in EagerReason}) == len(EagerReason.__members__)  # no alias
