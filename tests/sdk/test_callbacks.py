"""gpuctl.callbacks without any framework: importing it pulls in none, and instantiating a
callback whose framework is missing raises an ImportError that names what to install."""

import subprocess
import sys
import textwrap

from sdkutil import sdk_env

FRAMEWORKS = ("torch", "lightning", "pytorch_lightning", "transformers", "numpy")


def _python(code, tmp_path):
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=sdk_env(tmp_path),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_importing_callbacks_imports_no_framework(tmp_path):
    out = _python("""
        import sys
        import gpuctl.callbacks
        from gpuctl.callbacks import GpuctlLightningCallback, GpuctlHFTrainerCallback
        print(sorted(m for m in sys.modules if m.split(".")[0] in %r))
    """ % (FRAMEWORKS,), tmp_path)
    assert out.strip() == "[]"


def test_instantiating_without_the_framework_names_the_package(tmp_path):
    # None in sys.modules makes an import fail even where the framework is installed
    out = _python("""
        import sys
        for m in ("lightning", "lightning.pytorch", "pytorch_lightning", "transformers"):
            sys.modules[m] = None
        from gpuctl.callbacks import GpuctlLightningCallback, GpuctlHFTrainerCallback
        for cls in (GpuctlLightningCallback, GpuctlHFTrainerCallback):
            try:
                cls()
            except ImportError as e:
                print(cls.__name__, "|", e)
            else:
                print(cls.__name__, "| no error")
    """, tmp_path)
    lines = out.strip().splitlines()
    assert lines[0] == ("GpuctlLightningCallback | GpuctlLightningCallback needs PyTorch "
                        "Lightning: pip install lightning")
    assert lines[1] == ("GpuctlHFTrainerCallback | GpuctlHFTrainerCallback needs Hugging Face "
                        "transformers: pip install transformers")


def test_scalars_keeps_only_float_convertible_values():
    from gpuctl.callbacks import _scalars

    class OneElement:  # what a 0-d tensor looks like to the callback
        def numel(self):
            return 1

        def item(self):
            return 0.25

    class Many(OneElement):
        def numel(self):
            return 3

    got = _scalars({"a": 1, "b": 2.5, "c": "x", "d": None, "e": True, "f": OneElement(),
                    "g": Many(), "h": [1.0]}.items())
    assert got == {"a": 1.0, "b": 2.5, "f": 0.25}
