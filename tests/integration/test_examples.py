"""The README's examples run as a new user would run them."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_your_own_model_example_serves_the_pyg_model_exactly(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "your_own_model.py"), "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "served precomputed rows differ from PyG by at most" in proc.stdout
    assert (tmp_path / "model" / "golden.pt").is_file()


def test_recommendation_example_serves_scores_and_top_k_as_pyg(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "recommendation.py"), "--workdir", str(tmp_path),
                           "--users", "400"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "served top-10 items of 20 users equal PyG's" in proc.stdout
    assert "precomputed top-10 of every item for 20 users equal" in proc.stdout
    assert "top-10 items (rated 5, mode full) equal" in proc.stdout
    err = float(proc.stdout.split("differ from PyG by at most ")[1].split()[0])
    assert err <= 1e-5
