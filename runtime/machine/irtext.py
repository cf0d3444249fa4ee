"""LLVM IR written as text: the part of llvmlite.ir's builder API the lifter uses.

llvmlite.ir builds a Python object per instruction and formats them all again when the module
is printed; the JIT only wants the text, which `llvm.parse_assembly` reads.  Here each
instruction is one line, formatted once as it is emitted (a phi's and a switch's when the
module is printed, since cases and incoming values are added after them), which takes a few
times less Python work per eBPF instruction.  Pointers are opaque (``ptr``); a value is its
type and its reference (``%v3``, ``42``, ``@"name"``).
"""
from __future__ import annotations

import contextlib
import functools


class Type:
    def __call__(self, value) -> Constant:
        return Constant(self, value)

    def as_pointer(self) -> PointerType:
        return PointerType(self)


class IntType(Type):
    def __init__(self, width: int):
        self.width = width
        self._text = f"i{width}"

    def __str__(self) -> str:
        return self._text


class PointerType(Type):
    def __init__(self, pointee: Type | None = None):
        self.pointee = pointee        # what a call through it reads its type from

    def __str__(self) -> str:
        return "ptr"


class ArrayType(Type):
    def __init__(self, element: Type, count: int):
        self.element, self.count = element, count

    def __str__(self) -> str:
        return f"[{self.count} x {self.element}]"


class FunctionType(Type):
    def __init__(self, ret: Type, args: list[Type]):
        self.ret, self.args = ret, list(args)

    def __str__(self) -> str:
        return f"{self.ret} ({', '.join(map(str, self.args))})"


class StructType(Type):
    def __init__(self, elements: list[Type]):
        self.elements = elements

    def __str__(self) -> str:
        return "{" + ", ".join(map(str, self.elements)) + "}"


class Value:
    __slots__ = ("type", "ref")

    def __init__(self, type_: Type, ref: str):
        self.type, self.ref = type_, ref

    def __str__(self) -> str:
        return f"{self.type} {self.ref}"


class Constant(Value):
    __slots__ = ()

    def __init__(self, type_: Type, value):
        if isinstance(value, (bytes, bytearray)):
            ref = _byte_string(bytes(value))
        elif isinstance(type_, IntType) and type_.width == 1:
            ref = "true" if value & 1 else "false"
        else:
            ref = str(int(value))
        super().__init__(type_, ref)


@functools.lru_cache(maxsize=16)
def _byte_string(data: bytes) -> str:
    """An array constant's text (the same tables recur in every program that uses them)."""
    return 'c"' + "".join(chr(c) if 32 <= c < 127 and c not in (34, 92) else f"\\{c:02X}" for c in data) + '"'


class Instruction(Value):
    """An instruction's result; ``set_metadata`` and ``set_weights`` annotate its line."""
    __slots__ = ("block", "line")

    def __init__(self, type_: Type, ref: str, block: Block, line: int):
        super().__init__(type_, ref)
        self.block, self.line = block, line

    def set_metadata(self, kind: str, node: MetadataNode) -> None:
        self.block.lines[self.line] += f", !{kind} !{node.id}"

    def set_weights(self, weights: list[int]) -> None:
        node = self.block.function.module.add_metadata(['!"branch_weights"', *(f"i32 {w}" for w in weights)])
        self.set_metadata("prof", node)


class MetadataNode:
    def __init__(self, id_: int, operands: list[str]):
        self.id, self.operands = id_, operands


class _Phi(Instruction):
    __slots__ = ("incoming",)

    def __init__(self, type_, ref, block, line):
        super().__init__(type_, ref, block, line)
        self.incoming = []

    def add_incoming(self, value: Value, block: Block) -> None:
        self.incoming.append((value, block))

    def text(self) -> str:
        pairs = ", ".join(f"[{v.ref}, %{b.label}]" for v, b in self.incoming)
        return f"{self.ref} = phi {self.type} {pairs}"


class _Later:
    """A line written when the module is printed: a phi's, a switch's."""
    __slots__ = ("text",)

    def __init__(self, text):
        self.text = text

    def __str__(self) -> str:
        return self.text()


class _Switch:
    def __init__(self, value: Value, default: Block):
        self.value, self.default, self.cases = value, default, []

    def add_case(self, value: Value, block: Block) -> None:
        self.cases.append((value, block))

    def text(self) -> str:
        cases = " ".join(f"{v}, label %{b.label}" for v, b in self.cases)
        return f"switch {self.value}, label %{self.default.label} [{cases}]"


class Block:
    def __init__(self, function: Function, name: str):
        self.function, self.name = function, name
        self.label = f'"{name}"'
        self.lines: list = []
        self.terminated = False


class _Attributes:
    dereferenceable = 0


class Argument(Value):
    __slots__ = ("attributes",)

    def __init__(self, type_: Type, ref: str):
        super().__init__(type_, ref)
        self.attributes = _Attributes()


class Function(Value):
    __slots__ = ("module", "ftype", "name", "linkage", "args", "blocks", "_names", "_count")

    def __init__(self, module: Module, ftype: FunctionType, name: str):
        super().__init__(PointerType(ftype), f'@"{name}"')
        self.module, self.ftype, self.name = module, ftype, name
        self.linkage = "external"
        self.args = [Argument(t, f"%a{i}") for i, t in enumerate(ftype.args)]
        self.blocks: list[Block] = []
        self._names: set[str] = set()
        self._count = 0
        module.functions.append(self)

    def append_basic_block(self, name: str = "") -> Block:
        base, n = name or "b", 0
        while name in self._names or not name:
            n += 1
            name = f"{base}.{n}"
        self._names.add(name)
        bb = Block(self, name)
        self.blocks.append(bb)
        return bb

    def fresh(self) -> str:
        self._count += 1
        return f"%v{self._count}"

    def __str__(self) -> str:
        params = ", ".join(f"{a.type}{f' dereferenceable({a.attributes.dereferenceable})' if a.attributes.dereferenceable else ''}"
                           f" {a.ref}" for a in self.args)
        out = [f"define {self.linkage} {self.ftype.ret} {self.ref}({params})", "{"]
        for bb in self.blocks:
            out.append(f"{bb.label}:")
            out.extend(f"  {line}" for line in bb.lines)
        out.append("}")
        return "\n".join(out)


class GlobalVariable(Value):
    __slots__ = ("value_type", "name", "initializer", "global_constant", "linkage")

    def __init__(self, module: Module, value_type: Type, name: str):
        super().__init__(PointerType(value_type), f'@"{name}"')
        self.value_type, self.name = value_type, name
        self.initializer, self.global_constant, self.linkage = None, False, "external"
        module.globals.append(self)

    def __str__(self) -> str:
        kind = "constant" if self.global_constant else "global"
        return f"{self.ref} = {self.linkage} {kind} {self.initializer}"


class Module:
    def __init__(self, name: str = ""):
        self.name, self.triple = name, ""
        self.globals: list[GlobalVariable] = []
        self.functions: list[Function] = []
        self.declarations: dict[str, str] = {}
        self.metadata: list[MetadataNode] = []

    def add_metadata(self, operands: list) -> MetadataNode:
        node = MetadataNode(len(self.metadata), [str(o) for o in operands])
        self.metadata.append(node)
        return node

    def declare(self, name: str, ftype: FunctionType) -> Value:
        """An external function (an intrinsic), declared once."""
        self.declarations.setdefault(name, f'declare {ftype.ret} @"{name}"({", ".join(map(str, ftype.args))})')
        return Value(PointerType(ftype), f'@"{name}"')

    def __str__(self) -> str:
        out = [f'; ModuleID = "{self.name}"', f'target triple = "{self.triple}"', ""]
        out += [str(g) for g in self.globals]
        out += list(self.declarations.values())
        out += [str(f) for f in self.functions]
        out += [f"!{n.id} = !{{{', '.join(n.operands)}}}" for n in self.metadata]
        return "\n".join(out) + "\n"


_ICMP_UNSIGNED = {"==": "eq", "!=": "ne", "<": "ult", "<=": "ule", ">": "ugt", ">=": "uge"}
_ICMP_SIGNED = {"==": "eq", "!=": "ne", "<": "slt", "<=": "sle", ">": "sgt", ">=": "sge"}
I1 = IntType(1)


class IRBuilder:
    def __init__(self, block: Block | None = None):
        self.block = block

    def position_at_end(self, block: Block) -> None:
        self.block = block

    # -- emitting -------------------------------------------------------------------------------
    def _line(self, text: str, terminator: bool = False) -> int:
        bb = self.block
        bb.lines.append(text)
        if terminator:
            bb.terminated = True
        return len(bb.lines) - 1

    def _value(self, type_: Type, text: str) -> Instruction:
        ref = self.block.function.fresh()
        return Instruction(type_, ref, self.block, self._line(f"{ref} = {text}"))

    def _binary(self, op: str, a: Value, b: Value) -> Instruction:
        return self._value(a.type, f"{op} {a.type} {a.ref}, {b.ref}")

    def add(self, a, b): return self._binary("add", a, b)
    def sub(self, a, b): return self._binary("sub", a, b)
    def mul(self, a, b): return self._binary("mul", a, b)
    def and_(self, a, b): return self._binary("and", a, b)
    def or_(self, a, b): return self._binary("or", a, b)
    def xor(self, a, b): return self._binary("xor", a, b)
    def shl(self, a, b): return self._binary("shl", a, b)
    def lshr(self, a, b): return self._binary("lshr", a, b)
    def ashr(self, a, b): return self._binary("ashr", a, b)
    def udiv(self, a, b): return self._binary("udiv", a, b)
    def sdiv(self, a, b): return self._binary("sdiv", a, b)
    def urem(self, a, b): return self._binary("urem", a, b)
    def srem(self, a, b): return self._binary("srem", a, b)

    def neg(self, a):
        return self._binary("sub", Constant(a.type, 0), a)

    def not_(self, a):
        return self._binary("xor", a, Constant(a.type, -1))

    def icmp_unsigned(self, op: str, a: Value, b: Value) -> Instruction:
        return self._value(I1, f"icmp {_ICMP_UNSIGNED[op]} {a.type} {a.ref}, {b.ref}")

    def icmp_signed(self, op: str, a: Value, b: Value) -> Instruction:
        return self._value(I1, f"icmp {_ICMP_SIGNED[op]} {a.type} {a.ref}, {b.ref}")

    def select(self, cond: Value, a: Value, b: Value) -> Instruction:
        return self._value(a.type, f"select i1 {cond.ref}, {a}, {b}")

    def _cast(self, op: str, v: Value, to: Type) -> Instruction:
        return self._value(to, f"{op} {v} to {to}")

    def zext(self, v, to): return self._cast("zext", v, to)
    def sext(self, v, to): return self._cast("sext", v, to)
    def trunc(self, v, to): return self._cast("trunc", v, to)
    def inttoptr(self, v, to): return self._cast("inttoptr", v, to)

    def alloca(self, type_: Type, name: str = "") -> Instruction:
        ref = f'%"{name}"' if name else self.block.function.fresh()
        return Instruction(PointerType(type_), ref, self.block, self._line(f"{ref} = alloca {type_}"))

    def load(self, ptr: Value, typ: Type, align: int = 0) -> Instruction:
        """``align``: what the address is known to be a multiple of (0: the type's own alignment)."""
        return self._value(typ, f"load {typ}, ptr {ptr.ref}" + (f", align {align}" if align else ""))

    def store(self, value: Value, ptr: Value) -> None:
        self._line(f"store {value}, ptr {ptr.ref}")

    def gep(self, ptr: Value, indices: list[Value], inbounds: bool = False, source_etype: Type | None = None):
        source = source_etype or ptr.type.pointee
        idx = "".join(f", {i}" for i in indices)
        return self._value(PointerType(), f"getelementptr {'inbounds ' if inbounds else ''}{source}, ptr {ptr.ref}{idx}")

    def call(self, fn: Value, args: list[Value]) -> Instruction:
        ftype = fn.type.pointee
        return self._value(ftype.ret, f"call {ftype.ret} {fn.ref}({', '.join(map(str, args))})")

    def bswap(self, v: Value) -> Instruction:
        name = f"llvm.bswap.{v.type}"
        return self.call(self.block.function.module.declare(name, FunctionType(v.type, [v.type])), [v])

    def cmpxchg(self, ptr, cmp, new, ordering: str, failordering: str) -> Instruction:
        return self._value(StructType([cmp.type, I1]),
                           f"cmpxchg ptr {ptr.ref}, {cmp}, {new} {ordering} {failordering}")

    def extract_value(self, agg: Value, index: int) -> Instruction:
        return self._value(agg.type.elements[index], f"extractvalue {agg}, {index}")

    def atomic_rmw(self, op: str, ptr, value, ordering: str) -> Instruction:
        return self._value(value.type, f"atomicrmw {op} ptr {ptr.ref}, {value} {ordering}")

    def phi(self, type_: Type) -> _Phi:
        ref = self.block.function.fresh()
        bb = self.block
        phi = _Phi(type_, ref, bb, len(bb.lines))
        bb.lines.append(_Later(phi.text))
        return phi

    # -- control flow ---------------------------------------------------------------------------
    def branch(self, target: Block) -> None:
        self._line(f"br label %{target.label}", terminator=True)

    def cbranch(self, cond: Value, then: Block, else_: Block) -> Instruction:
        line = self._line(f"br i1 {cond.ref}, label %{then.label}, label %{else_.label}", terminator=True)
        return Instruction(I1, "", self.block, line)

    def switch(self, value: Value, default: Block) -> _Switch:
        sw = _Switch(value, default)
        self.block.lines.append(_Later(sw.text))
        self.block.terminated = True
        return sw

    def ret(self, value: Value) -> None:
        self._line(f"ret {value}", terminator=True)

    @contextlib.contextmanager
    def if_then(self, pred: Value, likely: bool | None = None):
        """As llvmlite's: a block run where ``pred`` holds, then on after it (with branch weights
        where ``likely`` is given)."""
        fn = self.block.function
        then, end = fn.append_basic_block(f"{self.block.name}.if"), fn.append_basic_block(f"{self.block.name}.endif")
        br = self.cbranch(pred, then, end)
        if likely is not None:
            br.set_weights([99, 1] if likely else [1, 99])
        self.position_at_end(then)
        yield end
        if not self.block.terminated:
            self.branch(end)
        self.position_at_end(end)
