import subprocess
import sys


def test_core_imports_no_torch():
    code = (
        "import sys, conveyor.core, conveyor.core.scheduler, conveyor.core.kv_manager, conveyor.core.policies\n"
        "import conveyor\n"
        "bad = [m for m in ('torch', 'numpy', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
