"""The package's shape as users meet it: light imports, a fast command line, capture failures
told apart from bugs, the transformers version check."""

import subprocess
import sys
import warnings

import pytest
import torch

from encoder_graphs.engine.capture import is_capture_failure
from encoder_graphs.models.transformers_seam import TESTED_RANGE, check_version


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
        ("from encoder_graphs.app.cli import main; main(['--help'])", set()),
        ("from encoder_graphs.app.cli import main; main(['caption'])", set()),
        ("from encoder_graphs.app.cli import main; main(['caption', '/no/such/path'])", set()),
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
