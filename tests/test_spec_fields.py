"""Every job-spec field is read by some code outside `spec/`: a user who sets a field gets an effect, not silence.

The check reads the sources' syntax trees (not text): an attribute access ``<x>.<field>``
counts for a model only when ``<x>`` is known to hold that model — a name or attribute
annotated with the model's class anywhere in the package (``spec: JobSpec``,
``job: JobSpec``), a model field of that type (``spec.ps`` is a `PSSpec`), an element of
a dict/list field (``spec.sites[s]``, ``for s in spec.sites.values()``), or a name
assigned from one of those. ``getattr(x, "field")`` and ``x.model_dump()`` count too.
`test_an_unread_field_is_reported` proves the check fails for a field nobody reads.
"""

from __future__ import annotations

import ast
import typing
from pathlib import Path

from pydantic import BaseModel, create_model

from hybridfleet.spec import models
from tests.conftest import REPO

SOURCES = REPO / "src" / "hybridfleet"
# Fields read by code that is being written now; each entry names why it is here. Empty it as they land.
KNOWN_PENDING = {
}


def _model_of(annotation) -> type[BaseModel] | None:
    """The model class an annotation holds directly or as a dict value / list item / optional."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in reversed(typing.get_args(annotation)):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _all_models(root: type[BaseModel]) -> dict[str, type[BaseModel]]:
    found = {root.__name__: root}
    for info in root.model_fields.values():
        nested = _model_of(info.annotation)
        if nested is not None and nested.__name__ not in found:
            found.update(_all_models(nested))
    return found


def _is_container(annotation) -> bool:
    return typing.get_origin(annotation) in (dict, list, tuple)


class _Reads(ast.NodeVisitor):
    """Collects (model name, field) for every read it can type.

    ``typed``/``elements`` map identifiers to the model names they may hold (directly, or as
    the elements of a container); ``params`` maps function names to their parameter names, so
    a typed argument types the callee's parameter (``make_optimizer(spec.ps.optimizer)``).
    """

    def __init__(self, all_models: dict[str, type[BaseModel]], typed: dict[str, set[str]],
                 elements: dict[str, set[str]], params: dict[str, list[str]]):
        self.models, self.typed, self.elements, self.params = all_models, typed, elements, params
        self.reads: set[tuple[str, str]] = set()

    def _field_types(self, owners: set[str], attr: str, container: bool) -> set[str]:
        found = set()
        for owner in owners:
            info = self.models[owner].model_fields.get(attr)
            nested = _model_of(info.annotation) if info else None
            if nested is not None and _is_container(info.annotation) == container:
                found.add(nested.__name__)
        return found

    def type_of(self, node: ast.AST) -> set[str]:
        if isinstance(node, ast.Name):
            return self.typed.get(node.id, set())
        if isinstance(node, ast.Attribute):
            return self._field_types(self.type_of(node.value), node.attr, False) | self.typed.get(node.attr, set())
        if isinstance(node, ast.Subscript):
            return self.element_of(node.value)
        if isinstance(node, ast.Call):
            return self.type_of(node.func)
        return set()

    def element_of(self, node: ast.AST) -> set[str]:
        """The models held by the elements of a dict/list field (``spec.sites`` -> SiteSpec)."""
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("values", "items"):
            node = node.func.value
        if isinstance(node, ast.Attribute):
            return self._field_types(self.type_of(node.value), node.attr, True) | self.elements.get(node.attr, set())
        if isinstance(node, ast.Name):
            return self.elements.get(node.id, set())
        return set()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        for owner in self.type_of(node.value):
            if node.attr in self.models[owner].model_fields:
                self.reads.add((owner, node.attr))
            elif node.attr == "model_dump":
                self.reads.update((owner, f) for f in self.models[owner].model_fields)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2:
            name = node.args[1]
            for owner in self.type_of(node.args[0]):
                if isinstance(name, ast.Constant) and name.value in self.models[owner].model_fields:
                    self.reads.add((owner, name.value))
        callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        params = self.params.get(callee or "", [])
        bound = [(params[i], arg) for i, arg in enumerate(node.args) if i < len(params)]
        bound += [(kw.arg, kw.value) for kw in node.keywords if kw.arg]
        for param, arg in bound:
            self.typed.setdefault(param, set()).update(self.type_of(arg))
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        kinds = self.type_of(node.value)
        for target in node.targets:
            if kinds and isinstance(target, (ast.Name, ast.Attribute)):
                self.typed.setdefault(target.id if isinstance(target, ast.Name) else target.attr, set()).update(kinds)
        self.generic_visit(node)

    def _bind_loop(self, target: ast.AST, iterable: ast.AST) -> None:
        elements = self.element_of(iterable)
        is_items = isinstance(iterable, ast.Call) and getattr(iterable.func, "attr", "") == "items"
        if is_items and isinstance(target, ast.Tuple) and len(target.elts) == 2:
            target = target.elts[1]
        if elements and isinstance(target, ast.Name):
            self.typed.setdefault(target.id, set()).update(elements)

    def visit_For(self, node: ast.For) -> None:
        self._bind_loop(node.target, node.iter)
        self.generic_visit(node)

    def visit_comprehension(self, node: ast.comprehension) -> None:
        self._bind_loop(node.target, node.iter)
        self.generic_visit(node)

    def _visit_comprehension_first(self, node) -> None:
        for generator in node.generators:
            self.visit(generator)
        for field in ("elt", "key", "value"):
            if hasattr(node, field):
                self.visit(getattr(node, field))

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _visit_comprehension_first


def _models_named(annotation: ast.AST | None, all_models: dict[str, type[BaseModel]]) -> tuple[set[str], bool]:
    """The model names an annotation mentions, and whether it is a container of them."""
    if annotation is None:
        return set(), False
    text = ast.unparse(annotation)
    words = set(text.replace('"', " ").replace("'", " ").replace("[", " ").replace("]", " ").replace("|", " ")
                .replace(",", " ").split())
    container = any(c in text for c in ("dict[", "list[", "tuple[", "Mapping[", "Iterable[", "Sequence["))
    return {m for m in all_models if m in words}, container


def _declarations(trees: list[ast.AST], all_models: dict[str, type[BaseModel]]) -> tuple[dict, dict, dict]:
    """From annotations: identifiers holding a model, identifiers holding containers of one, and each
    function's parameter names (return annotations type the function's name, e.g. a property)."""
    typed: dict[str, set[str]] = {}
    elements: dict[str, set[str]] = {}
    params: dict[str, list[str]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            pairs = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
                params[node.name] = args[1:] if args[:1] in (["self"], ["cls"]) else args
                pairs.append((node.name, node.returns))
            elif isinstance(node, ast.arg):
                pairs.append((node.arg, node.annotation))
            elif isinstance(node, ast.AnnAssign):
                target = node.target
                pairs.append((target.id if isinstance(target, ast.Name) else getattr(target, "attr", ""),
                              node.annotation))
            for name, annotation in pairs:
                found, container = _models_named(annotation, all_models)
                if found:
                    (elements if container else typed).setdefault(name, set()).update(found)
    return typed, elements, params


def unread_fields(root: type[BaseModel], sources: list[Path]) -> list[tuple[str, str]]:
    """Every (model, field) under ``root`` that no source reads."""
    all_models = _all_models(root)
    trees = [ast.parse(path.read_text()) for path in sources]
    typed, elements, params = _declarations(trees, all_models)
    reads: set[tuple[str, str]] = set()
    for _ in range(3):  # typed arguments type their callees' parameters: a few passes reach a fixed point
        for tree in trees:
            visitor = _Reads(all_models, typed, elements, params)
            visitor.visit(tree)
            reads |= visitor.reads
    return sorted((name, field) for name, model in all_models.items() for field in model.model_fields
                  if (name, field) not in reads)


def _product_sources() -> list[Path]:
    """The package outside `spec/`, and the shipped training scripts (they read ``train`` and site ``data``)."""
    package = [p for p in SOURCES.rglob("*.py") if "spec" not in p.relative_to(SOURCES).parts[:1]
               and "_proto" not in p.parts]
    return package + sorted((REPO / "examples").rglob("*.py"))


def test_every_spec_field_is_read_outside_the_spec_package():
    unread = unread_fields(models.JobSpec, _product_sources())
    assert [f for f in unread if f not in KNOWN_PENDING] == []


def test_every_known_pending_field_still_exists_and_is_still_unread():
    """So the allowlist cannot go stale: once a pending field is read (or removed), its entry must go."""
    unread = set(unread_fields(models.JobSpec, _product_sources()))
    assert set(KNOWN_PENDING) <= unread


def test_an_unread_field_is_reported(tmp_path):
    # Prepare: the real models with one extra field nobody reads, and one that only the source below reads
    extra = create_model("CheckpointSpec", __base__=models.CheckpointSpec, zz_unread=(int, 0), zz_read=(int, 0))
    job = create_model("JobSpec", __base__=models.JobSpec, checkpoint=(extra, extra()))
    source = tmp_path / "reader.py"
    # names no product source uses: the reads are tracked by name across files, not per scope
    source.write_text("def zz_reader(zz_spec: JobSpec):\n    zz_checkpoint = zz_spec.checkpoint\n"
                      "    return zz_checkpoint.zz_read\n")

    # Execute
    unread = unread_fields(job, [*_product_sources(), source])

    # Assert
    assert ("CheckpointSpec", "zz_unread") in unread
    assert ("CheckpointSpec", "zz_read") not in unread
