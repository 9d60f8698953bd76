"""The README's Python quick-start runs as written."""

import re
from pathlib import Path


def test_readme_quick_start_runs(capsys):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.search(r"## Python quick-start\n\n```python\n(.*?)```", readme, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md quick-start", "exec"), namespace)
    out = capsys.readouterr().out
    sparsity = float(re.search(r"realized sparsity after warmup: ([0-9.]+)", out).group(1))
    assert 0.3 < sparsity < 1.0
    assert namespace["logits"].shape[:2] == namespace["inputs"]["input_ids"].shape
    assert namespace["model"].config._attn_implementation == "sdpa"  # restored after remove()
