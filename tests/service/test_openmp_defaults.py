"""The server's OpenMP defaults (service/openmp.py): set on import of the package, before torch loads
libgomp, and never over a value the environment already holds."""

import os
import subprocess
import sys

REPOSITORY_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRINT_SETTINGS = (
    "import sys, os, service; "
    "print('torch' in sys.modules, os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'])"
)


def _settings_after_import(**environment: str) -> list[str]:
    env = {
        name: value for name, value in os.environ.items() if name not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    }
    env.update(environment)
    completed = subprocess.run(
        [sys.executable, "-c", PRINT_SETTINGS],
        cwd=REPOSITORY_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return completed.stdout.split()


def test_importing_the_service_package_sets_the_defaults_before_torch_is_loaded():
    torch_loaded, wait_policy, spin_count = _settings_after_import()
    assert torch_loaded == "False"
    assert (wait_policy, spin_count) == ("ACTIVE", "300000")


def test_a_value_the_environment_sets_is_kept():
    _, wait_policy, spin_count = _settings_after_import(OMP_WAIT_POLICY="PASSIVE")
    assert (wait_policy, spin_count) == ("PASSIVE", "300000")
