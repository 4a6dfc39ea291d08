"""The plug-point protocols say everything their callers use, and their implementations provide it.

A protocol that is not kept drifts: a feature adds a member to one implementation, a caller uses it, and the
protocol no longer says what an implementation must have (the review of issue 56 found the scheduler calling five
``KVManager`` members the protocol lacked, the layer stack reading six of a backend's, the engine two of its
executor's). So, over every module of ``conveyor/`` (the KV manager, the executor, the attention backend, the served
engine, the batching policy and its waiting queue, the model router):

- every attribute read on a value typed with a plug-point protocol must be a member of that protocol. A value's
  type comes from where the code says it: a parameter's annotation, a function's declared return type (a call of
  it), a class's constructor, an ``__init__`` that stores one of those in ``self``; and it is followed through
  attributes of conveyor's own classes (``self.scheduler.kv`` is the scheduler's ``KVManager``). Where the code
  says nothing the value is not checked, so the protocols stay the place where the types are written down;
- ``getattr``/``hasattr`` is never asked of such a value (a capability is declared, not probed);
- every implementation has every member of its protocol.
"""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import pytest

import conveyor
from conveyor.core.interfaces import EngineExecutor, Executor, KVManager, KVTransfer
from conveyor.core.policies import SchedulingPolicy, WaitingQueue
from conveyor.engine.engine_client import ServedEngine
from conveyor.layers.attention.base import AttentionBackend, AttentionBackendType, LayerStackAttention
from conveyor.server.served_models import ModelRouter

PACKAGE_DIR = Path(conveyor.__file__).parent
PROTOCOLS = {p.__name__: p for p in (KVManager, Executor, KVTransfer, EngineExecutor, AttentionBackend,
                                     LayerStackAttention, AttentionBackendType, ServedEngine, SchedulingPolicy,
                                     WaitingQueue, ModelRouter)}


def members(protocol: type) -> set[str]:
    """What a protocol declares: its methods, properties and annotated attributes, its bases' included."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls in (object, typing.Protocol, typing.Generic):
            continue
        names |= {n for n in vars(cls) if not n.startswith("_")}
        names |= set(getattr(cls, "__annotations__", {}))
    return names


def annotation_type(node: ast.AST | None) -> str | None:
    """The one class a (string or expression) annotation names, ``X | None`` included; None for anything else."""
    if node is None:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        names = [annotation_type(side) for side in (node.left, node.right)]
        names = [n for n in names if n not in (None, "None")]
        return names[0] if len(names) == 1 else None
    if isinstance(node, ast.Constant) and node.value is None:
        return "None"
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


class Index:
    """Declared types across the package: classes' attributes, functions' return types."""

    def __init__(self, trees: dict[Path, ast.Module]) -> None:
        self.trees = trees
        self.classes: dict[str, ast.ClassDef] = {}
        self.returns: dict[str, str] = {}  # function or method name -> its declared return class
        for tree in trees.values():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, node)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    returned = annotation_type(node.returns)
                    if returned is not None and returned != "None":
                        self.returns.setdefault(node.name, returned)
        self.attrs: dict[str, dict[str, str]] = {}
        for _ in range(2):  # a second pass follows attributes typed through other classes' attributes
            self.attrs = {name: self._class_attrs(cls) for name, cls in self.classes.items()}

    def _class_attrs(self, cls: ast.ClassDef) -> dict[str, str]:
        attrs: dict[str, str] = {}
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if (t := annotation_type(node.annotation)) is not None:
                    attrs[node.target.id] = t
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list):
                    if (t := annotation_type(node.returns)) is not None:
                        attrs[node.name] = t
                if node.name == "__init__":
                    local = self.local_types(node, {})
                    for stmt in ast.walk(node):
                        for target, value, ann in _assignments(stmt):
                            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                                    and target.value.id == "self":
                                t = annotation_type(ann) if ann is not None else self.value_type(value, local)
                                if t is not None:
                                    attrs.setdefault(target.attr, t)
        return attrs

    def local_types(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, outer: dict[str, str]) -> dict[str, str]:
        types = dict(outer)
        args = fn.args
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            if (t := annotation_type(a.annotation)) is not None:
                types[a.arg] = t
        for stmt in ast.walk(fn):
            for target, value, ann in _assignments(stmt):
                if isinstance(target, ast.Name):
                    t = annotation_type(ann) if ann is not None else self.value_type(value, types)
                    if t is not None:
                        types.setdefault(target.id, t)
        return types

    def value_type(self, value: ast.AST | None, types: dict[str, str]) -> str | None:
        """The declared class of an expression, when the code says it."""
        if isinstance(value, ast.IfExp):
            branches = [self.value_type(v, types) for v in (value.body, value.orelse)]
            branches = [b for b in branches if b is not None]
            return branches[0] if len(set(branches)) == 1 else None
        if isinstance(value, ast.BoolOp) and isinstance(value.op, ast.Or):
            found = {self.value_type(v, types) for v in value.values} - {None}
            return found.pop() if len(found) == 1 else None
        if isinstance(value, ast.Call):
            name = value.func.id if isinstance(value.func, ast.Name) else \
                value.func.attr if isinstance(value.func, ast.Attribute) else None
            if name in self.classes or name in PROTOCOLS:
                return name
            return self.returns.get(name)
        return self.expr_type(value, types)

    def expr_type(self, node: ast.AST | None, types: dict[str, str]) -> str | None:
        if isinstance(node, ast.Name):
            return types.get(node.id)
        if isinstance(node, ast.Call):
            return self.value_type(node, types)
        if isinstance(node, ast.Attribute):
            base = self.expr_type(node.value, types)
            if base is not None and base in self.attrs:
                return self.attrs[base].get(node.attr)
        return None


def _assignments(stmt: ast.AST):
    """(target, value, annotation) of an assignment statement, tuple targets unpacked pairwise."""
    if isinstance(stmt, ast.AnnAssign):
        yield stmt.target, stmt.value, stmt.annotation
    elif isinstance(stmt, ast.Assign):
        for target in stmt.targets:
            if isinstance(target, ast.Tuple) and isinstance(stmt.value, ast.Tuple) \
                    and len(target.elts) == len(stmt.value.elts):
                yield from ((t, v, None) for t, v in zip(target.elts, stmt.value.elts))
            else:
                yield target, stmt.value, None


def functions(tree: ast.Module):
    """Every function with the types its enclosing class gives ``self``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield item, {"self": node.name}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, {}


@pytest.fixture(scope="module")
def index() -> Index:
    return Index({p: ast.parse(p.read_text()) for p in sorted(PACKAGE_DIR.rglob("*.py"))})


def uses(index: Index):
    """(where, protocol, member) of every attribute read on a protocol-typed value, and (where, protocol, None) of
    every getattr / hasattr asked of one."""
    for path, tree in index.trees.items():
        for fn, outer in functions(tree):
            types = index.local_types(fn, outer)
            for node in ast.walk(fn):
                where = f"{path.relative_to(PACKAGE_DIR)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.Attribute):
                    base = index.expr_type(node.value, types)
                    if base in PROTOCOLS:
                        yield where, base, node.attr
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                        and node.func.id in ("getattr", "hasattr") and node.args:
                    base = index.expr_type(node.args[0], types)
                    if base in PROTOCOLS:
                        yield where, base, None


def test_every_member_a_caller_uses_is_declared(index):
    undeclared = sorted({f"{where}: {proto}.{member}" for where, proto, member in uses(index)
                         if member is not None and member not in members(PROTOCOLS[proto])})
    assert not undeclared, "members used but not declared by the protocol:\n" + "\n".join(undeclared)


def test_no_plug_point_is_probed(index):
    probes = sorted(f"{where}: getattr/hasattr on a {proto}" for where, proto, member in uses(index)
                    if member is None)
    assert not probes, probes


def test_the_scan_sees_the_plug_points_it_checks(index):
    """The check above is only as good as the types it finds: each plug point's main callers are seen."""
    seen = {(where.split(":")[0], proto) for where, proto, _ in uses(index)}
    for file, proto in [("core/scheduler.py", "KVManager"), ("core/kv_eviction.py", "KVManager"),
                        ("sim/instance.py", "KVManager"), ("engine/llm_engine.py", "EngineExecutor"),
                        ("engine/kv_handoff.py", "KVTransfer"), ("models/native_stack.py", "LayerStackAttention"),
                        ("models/native_stack.py", "AttentionBackend"), ("layers/attention/__init__.py",
                                                                           "AttentionBackendType"),
                        ("runner/model_runner.py", "AttentionBackendType"), ("server/serving_common.py",
                                                                              "ServedEngine"),
                        ("core/scheduler.py", "SchedulingPolicy"), ("core/budget.py", "SchedulingPolicy"),
                        ("core/scheduler.py", "WaitingQueue"), ("server/app.py", "ModelRouter"),
                        ("server/ollama/routes.py", "ModelRouter")]:
        assert (file, proto) in seen, f"{file} is not seen using a {proto}"


def _lacks(obj, protocol: type) -> list[str]:
    return sorted(m for m in members(protocol) if not hasattr(obj, m))


def test_the_implementations_provide_every_member():
    from conveyor.core.config import PRIORITY_POLICIES, SchedulerConfig
    from conveyor.core.kv_manager import KVCacheManager
    from conveyor.core.policies import POLICIES, make_policy
    from conveyor.core.slab_manager import SlabKVManager
    from conveyor.layers.attention import backend_class
    from conveyor.layers.attention.native_cpu import NativeCpuAttention
    from conveyor.runner.model_runner import ModelRunner
    from conveyor.sim.held_kv import HeldKVManager
    from tests.layers.test_attention import make_step

    paged = KVCacheManager(8, 4)
    for kv in (paged, SlabKVManager(8, 4, 16), HeldKVManager(paged)):
        assert not _lacks(kv, KVManager), (type(kv).__name__, _lacks(kv, KVManager))
    assert not _lacks(ModelRunner, EngineExecutor)
    for name in POLICIES:  # every batching policy, and the waiting queue each makes
        for scheduling_policy in ("fcfs", "priority") if name in PRIORITY_POLICIES else ("fcfs",):
            policy = make_policy(SchedulerConfig(policy=name, scheduling_policy=scheduling_policy))
            queue = policy.waiting_queue()
            assert not _lacks(policy, SchedulingPolicy), (name, _lacks(policy, SchedulingPolicy))
            assert not _lacks(queue, WaitingQueue), (name, _lacks(queue, WaitingQueue))
    for name in ("reference", "cpu-torch", "cpu-native", "cuda"):
        cls = backend_class(name)
        assert not _lacks(cls, AttentionBackendType), (name, _lacks(cls, AttentionBackendType))
        assert inspect.ismethod(cls.for_step)  # a classmethod: the one constructor
    from conveyor.server.model_pool import ModelPool
    from conveyor.server.served_models import ServedModels

    for router in (ServedModels, ModelPool):  # (their members: methods, so the classes tell)
        assert not _lacks(router, ModelRouter), (router.__name__, _lacks(router, ModelRouter))
    meta = make_step(4, [(3, 1), (0, 5)])[0]
    native = NativeCpuAttention(meta, None)
    assert native.supports_layer_stack and not _lacks(native, LayerStackAttention)
    torch_step = backend_class("reference").for_step(meta, native.block_table.dtype)
    assert not _lacks(torch_step, AttentionBackend) and not torch_step.supports_layer_stack
