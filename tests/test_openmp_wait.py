"""The engine's OpenMP wait default (engine/__init__.py): Numba's threads spin a while between the expert kernels'
calls instead of sleeping at once, unless the user chose a wait policy or a spin count."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _spincount_after_import(**env) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", "import os, engine; print(os.environ.get('GOMP_SPINCOUNT'))"],
                         env={**clean, **env}, cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_threads_spin_three_million_times_by_default():
    assert _spincount_after_import() == "3000000"


@pytest.mark.parametrize("env,expected", [({"OMP_WAIT_POLICY": "PASSIVE"}, "None"),
                                          ({"GOMP_SPINCOUNT": "1000"}, "1000")])
def test_a_users_own_wait_setting_wins(env, expected):
    assert _spincount_after_import(**env) == expected
