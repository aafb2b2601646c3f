"""The folders are stages and import only the stages before them; no import cycle, not even one
closed by an import inside a function; no compiler source named after an architecture."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from ggufc.frontend.archs import ARCHITECTURES

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("frontend", "ir", "passes", "codegen", "runtime", "driver")
# what each stage may import besides itself (the artifact format and the host CPU's features are
# runtime's, shared with codegen)
ALLOWED = {
    "ir": set(),
    "frontend": {"ir"},
    "passes": {"ir"},
    "codegen": {"ir", "runtime.artifact", "runtime.host", "runtime.plan_expr", "runtime.plan_format",
                "runtime.targets"},
    "runtime": set(),
    "driver": {"frontend", "ir", "passes", "codegen", "runtime"},
}
LEAVES = {"ggufc.version", "ggufc.messages"}  # importable from anywhere
# codegen's modules and subpackages from the bottom up: each imports only its own layer and those
# below it (the instruction-set table is a leaf the target description reads)
CODEGEN_LAYERS = (
    ("target", "tvm_util", "kernel_keys", "schedule", "cpu_int8.isa"),
    ("kernels",),  # the generic kernels
    ("formats",),  # weight block formats
    ("cpu_int8",),  # the CPU's 8-bit matmuls
    ("gpu",),  # GPU schedules, kernels, layout, plan, build
    ("lower_context", "kernel_knobs"),
    ("window_cache",),  # sliding-window layers' caches of a few cells
    ("families",),  # each op family's kernels (CPU and GPU) and lowering
    ("lower",),
    ("batch_rows",),
    ("build",),
)


def _modules() -> dict[str, Path]:
    mods = {}
    for stage in STAGES:
        for path in (ROOT / stage).rglob("*.py"):
            parts = ["ggufc", *path.relative_to(ROOT).with_suffix("").parts]
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in (ROOT / "ggufc").glob("*.py"):
        mods["ggufc" if path.stem == "__init__" else f"ggufc.{path.stem}"] = path
    return mods


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The ggufc modules `module` imports anywhere in its file (functions included)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]
            submodules = [n for n in names if n in known]
            out.update(submodules or ([target] if target in known else []))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
    return out - {module}


MODULES = _modules()
GRAPH = {m: _imports(m, p, MODULES) for m, p in MODULES.items()}


def _stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else None


def test_the_walk_sees_the_package() -> None:
    assert len(MODULES) > 90 and "ggufc.codegen.lower" in GRAPH["ggufc.codegen.build"]
    assert "ggufc.ir.graph" in GRAPH["ggufc.passes.dce"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_imports_only_the_stages_before_it(stage: str) -> None:
    bad = []
    for module, targets in GRAPH.items():
        if _stage(module) != stage:
            continue
        for target in targets:
            other = _stage(target)
            if other is None or other == stage or target in LEAVES:
                continue
            rest = target.split(".", 1)[1]
            if not any(rest == a or rest.startswith(a + ".") for a in ALLOWED[stage]):
                bad.append(f"{module} -> {target}")
    assert not bad, bad


def _codegen_layer(module: str) -> int:
    """The index in CODEGEN_LAYERS of a codegen module (the longest matching entry)."""
    rest = module.removeprefix("ggufc.codegen.")
    matches = [(len(name), i) for i, names in enumerate(CODEGEN_LAYERS) for name in names
               if rest == name or rest.startswith(name + ".")]
    assert matches, f"{module} is in no layer of CODEGEN_LAYERS"
    return max(matches)[1]


def test_codegen_subpackages_import_only_the_layers_below() -> None:
    codegen = [m for m in GRAPH if m.startswith("ggufc.codegen.")]
    assert {"ggufc.codegen.kernels.elementwise", "ggufc.codegen.cpu_int8.block32",
            "ggufc.codegen.families.moe_routing", "ggufc.codegen.gpu.schedules"} <= set(codegen)
    bad = [f"{m} -> {t}" for m in codegen for t in GRAPH[m]
           if t.startswith("ggufc.codegen.") and _codegen_layer(t) > _codegen_layer(m)]
    assert not bad, bad


# modules of frontend/ and passes/ that belong to no op family (shared blocks, formats, generic fusions)
NOT_A_FAMILY = {
    "frontend": {"blocks", "blocks_gemma", "gguf_file", "gguf_validate", "hparams", "load", "tokenizer_build",
                 "archs"},
    "ir_spelled": {"onnx"},  # ir/onnx_spelled.py: ops in standard ONNX, not a family's decompositions
    "passes": {"constant_fold", "dce", "fold_dequantize", "fuse_elementwise", "fuse_int8", "fusions", "matcher",
               "pipeline", "quantize_acts", "stats"},
}


def _stems(folder: Path) -> set[str]:
    """The module and subpackage names of a folder."""
    return {p.stem for p in folder.iterdir() if p.suffix == ".py" and p.stem != "__init__"} | {
        p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}


def test_pyproject_lists_every_package() -> None:
    """setuptools installs only the packages pyproject names: a folder left out is missing from a
    fresh install (an editable one too) while the source tree still imports."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {"ggufc"} | {".".join(["ggufc", *p.parent.relative_to(ROOT).parts])
                           for stage in STAGES for p in (ROOT / stage).rglob("__init__.py")}
    assert listed == on_disk, f"missing: {sorted(on_disk - listed)}; not a package: {sorted(listed - on_disk)}"


def test_op_families_share_one_stem() -> None:
    """An op family bears one name in every stage: its codegen file and its IR file (records, shape
    rules, references), its spelling in primitives (`ir/<family>_spelled`), its frontend blocks
    (`frontend/<family>`) and its fusion (`passes/fuse_<family>`)."""
    families = _stems(ROOT / "codegen" / "families")
    assert {"hyper_connections", "linear_attention", "moe_routing", "sparse_indexers"} <= families
    missing = [f"ir/{stem}.py" for stem in sorted(families) if not (ROOT / "ir" / f"{stem}.py").exists()]
    assert not missing, missing
    stray = [f"frontend/{m}" for m in sorted(_stems(ROOT / "frontend") - NOT_A_FAMILY["frontend"] - families)]
    stray += [f"passes/{m}" for m in sorted(_stems(ROOT / "passes") - NOT_A_FAMILY["passes"])
              if m.removeprefix("fuse_") not in families]
    stray += [f"ir/{m}" for m in sorted(_stems(ROOT / "ir")) if m.endswith("_spelled")
              and m.removesuffix("_spelled") not in families | NOT_A_FAMILY["ir_spelled"]]
    assert not stray, f"modules named after no op family (rename to the family's stem): {stray}"


def _family_op_tables() -> dict[str, dict[str, object]]:
    """Each op family's op table: the one `*_OPS` dict its ir/<family>.py exports."""
    out = {}
    for stem in sorted(_stems(ROOT / "codegen" / "families")):
        module = importlib.import_module(f"ggufc.ir.{stem}")
        tables = [v for k, v in vars(module).items() if k.endswith("_OPS") and isinstance(v, dict)]
        assert len(tables) == 1, f"ir/{stem}.py exports {len(tables)} op tables, not one *_OPS dict"
        out[stem] = tables[0]
    return out


def test_each_family_registers_its_own_ops() -> None:
    """A family's op is defined in its own ir/<family>.py (record, shape rule and reference; the
    generic helpers of ir/op_def.py aside) and registered in that file's table, which ir/ops.py
    merges; its decomposition is in ir/<family>_spelled.py; an op lowered by
    codegen/families/<family> is that family's, and a generic op (defined in ir/ops.py, decomposed
    in ir/decompose.py) is lowered outside the families."""
    from ggufc.codegen.lower import LOWERING
    from ggufc.ir.decompose import DECOMPOSITIONS
    from ggufc.ir.ops import OPS

    tables = _family_op_tables()
    owner = {name: stem for stem, table in tables.items() for name in table}
    assert {"hc_pre", "hc_sinkhorn", "moe_ffn", "gated_delta_net", "ple_hash", "head_matmul"} <= set(owner)
    assert all(OPS[name] is tables[stem][name] for name, stem in owner.items())
    families = "ggufc.codegen.families."
    misplaced = []
    for name, op in OPS.items():
        home = f"ggufc.ir.{owner[name]}" if name in owner else "ggufc.ir.ops"
        parts = {"record": op.attrs, "shape rule": op.infer, "reference": op.ref}
        misplaced += [f"{name}: its {what} is defined in {part.__module__}, not {home}" for what, part in parts.items()
                      if part.__module__ not in (home, "ggufc.ir.op_def")]
        spelled = getattr(DECOMPOSITIONS.get(name), "__module__", None)
        if spelled not in (None, f"{home}_spelled" if name in owner else home.replace("ops", "decompose")):
            misplaced.append(f"{name}: decomposed in {spelled}, registered in {home}")
        lowered = getattr(LOWERING.get(name), "__module__", "")
        family = lowered.removeprefix(families).split(".")[0] if lowered.startswith(families) else None
        if family != owner.get(name):
            misplaced.append(f"{name}: lowered in {lowered}, registered in {home}")
    assert not misplaced, misplaced


def _short_aliases(path: Path, module: str) -> dict[str, str]:
    """Upper-case aliases of up to three letters a file gives ggufc modules: alias -> module."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
            out.update({a.asname: f"{target}.{a.name}" for a in node.names
                        if a.asname and a.asname.isupper() and len(a.asname) <= 3})
    return out


def test_a_short_alias_names_one_module() -> None:
    """`HC` or `MR` means the same module in every file that uses it (a reader moving between
    frontend and codegen must not meet two meanings)."""
    meanings: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        for alias, target in _short_aliases(path, module).items():
            meanings.setdefault(alias, set()).add(target)
    assert "O" in meanings
    clashes = {alias: sorted(targets) for alias, targets in meanings.items() if len(targets) > 1}
    assert not clashes, clashes


def test_no_import_cycle() -> None:
    """Tarjan's strongly connected components over every import, those inside functions included."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in GRAPH:
        if module not in index:
            visit(module)
    assert not cycles, cycles


def test_only_architecture_files_are_named_after_architectures() -> None:
    named = [p.relative_to(ROOT).as_posix() for stage in STAGES for p in (ROOT / stage).rglob("*.py")
             if "archs" not in p.parts and any(arch in p.stem for arch in ARCHITECTURES)]
    assert not named, named


def test_the_api_imports_no_cli_code() -> None:
    """`ggufc.api` reaches `ggufc.cli` through no chain of imports (those inside functions included):
    the CLI parses and prints; what both need lives in the stages."""
    seen: set[str] = set()
    todo = ["ggufc.api"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += GRAPH[module]
    assert "ggufc.cli" in GRAPH and "ggufc.driver.models" in seen
    assert "ggufc.cli" not in seen
