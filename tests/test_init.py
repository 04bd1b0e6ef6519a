import subprocess
import sys

import slimact


def test_public_api():
    for name in ("convert", "revert", "summary", "profile", "Policy", "PRESETS", "Report"):
        assert name in slimact.__all__ and hasattr(slimact, name)


def test_import_is_light_and_never_touches_cuda():
    code = (
        "import sys, torch, slimact, slimact.nn, slimact.functional, slimact.quant\n"
        "assert not torch.cuda.is_initialized()\n"
        "heavy = [m for m in ('triton', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
