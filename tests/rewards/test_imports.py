"""mrl.rewards and mrl.data import no Ray, Megatron or SGLang (ARCHITECTURE.md, import rules)."""
import ast
from pathlib import Path

import mrl

FORBIDDEN = {"ray", "megatron", "sglang", "transformer_engine"}
ROOT = Path(mrl.__file__).parent


def _roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args \
                and isinstance(node.args[0], ast.Constant):
            roots.add(str(node.args[0].value).split(".")[0])
    return roots


def test_rewards_and_data_import_no_ray_megatron_sglang():
    files = sorted((ROOT / "rewards").rglob("*.py")) + sorted((ROOT / "data").rglob("*.py"))
    assert len(files) >= 5
    bad = {str(f.relative_to(ROOT)): sorted(_roots(f) & FORBIDDEN) for f in files}
    assert {k: v for k, v in bad.items() if v} == {}


def test_checker_catches_forbidden(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import ray\nfrom megatron.core import x\nimport importlib\nimportlib.import_module('sglang.srt')\n")
    assert _roots(f) & FORBIDDEN == {"ray", "megatron", "sglang"}


def test_lazy_exports_resolve():
    import mrl.rewards as R

    assert sorted(R.__all__) == sorted(R._EXPORTS)
    for name in R.__all__:
        assert getattr(R, name).__doc__, name
