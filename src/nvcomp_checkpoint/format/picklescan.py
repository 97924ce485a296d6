"""One simulation of the pickle machine, run over a pickle before anything of it is built.

Each caller states what it allows in a :class:`PicklePolicy` (budgets, globals whose calls are
checked, persistent ids); the scan refuses what would crash, exhaust or change the process.
"""

from __future__ import annotations

import enum
import pickletools
import struct
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import FormatError

__all__ = ["PicklePolicy", "scan_pickle", "builds_tensor", "is_enum_class", "loaded_global"]


def builds_tensor(name: str) -> bool:
    """Whether a global (``"module.name"``) builds a tensor or a storage.

    The ``torch._utils._rebuild_*`` functions (a view of a storage, a device copy of one: 1.1 KB of
    pickle took 8 GiB; sparse, nested, quantized tensors), the tensor and storage classes
    (``torch.FloatTensor(n)`` allocates ``n`` elements) and ``torch.nn.parameter``'s classes.
    """
    module, _, attr = name.rpartition(".")
    if module != "torch" and not module.startswith("torch."):
        return False
    return attr.startswith("_rebuild") or attr.endswith(("Tensor", "Storage")) or module == "torch.nn.parameter"


def is_enum_class(obj: Any) -> bool:
    """Whether calling ``obj`` returns one of its module-level members (an ``Enum`` class)."""
    return isinstance(obj, type) and issubclass(obj, enum.Enum)


@dataclass(frozen=True)
class PicklePolicy:
    """What one caller's pickles may do, checked by :func:`scan_pickle`.

    Attributes:
        subject: How messages name the pickle ("its pickle").
        suffix: Appended to every refusal ("; DCP never writes this").
        max_nesting: Containers nested deeper are refused (hashing a tuple 100,000 deep as a dict
            key recurses in C without a guard and kills the interpreter).
        copy_slack: What the calls of the pickle may copy (arguments and ``BUILD`` states, item
            by item), beyond one element per byte of the pickle.
        max_text_arg: Longest text (protocol 0) argument.
        max_digits: Longest decimal integer (Python's own limit for ``int(str)``).
        max_string_bytes: Longest string or bytes literal; None: the pickle's size.
        max_container_items: Most items one list, dict, set or tuple may receive; None: the pickle's size.
        max_memo: Most memo entries; None: the pickle's size.
        persistent_ids: Whether persistent ids (torch.save's storages) may appear.
        report_tensor_data: Whether the first global that builds a tensor or storage, or a
            persistent id, is returned (the caller refuses it once it knows where it is).
        resolve: The object a global names (None where unknown), to find the globals whose calls
            return module-level objects (enum classes); never imports what the pickle names.
        shared_results: Globals (``"module.name"``) whose calls return module-level objects.
        sized_calls: Globals refused when their first argument is an integer (``bytearray(n)``).
        literal_calls: Globals refused unless their first argument is a string literal
            (``_codecs.encode``: chained, each level doubles the bytes).
    """

    subject: str = "its pickle"
    suffix: str = ""
    max_nesting: int = 272
    copy_slack: int = 1 << 16
    max_text_arg: int = 1 << 20
    max_digits: int = 4300
    max_string_bytes: int | None = None
    max_container_items: int | None = None
    max_memo: int | None = None
    persistent_ids: bool = False
    report_tensor_data: bool = False
    resolve: Callable[[str, str], Any] = field(default_factory=lambda: loaded_global)
    shared_results: frozenset[str] = frozenset()
    sized_calls: frozenset[str] = frozenset({"builtins.bytearray", "__builtin__.bytearray"})
    literal_calls: frozenset[str] = frozenset({"_codecs.encode"})

    def global_tags(self, module: str, name: str) -> int:
        """What the value a GLOBAL of ``module.name`` pushes is: always a module-level object."""
        key = f"{module}.{name}"
        tags = _SHARED
        if key in self.sized_calls:
            tags |= _SIZED
        if key in self.literal_calls:
            tags |= _LITERAL
        if key in self.shared_results or is_enum_class(self.resolve(module, name)):
            tags |= _SHARED_RESULT
        return tags


def loaded_global(module: str, name: str) -> Any:
    """The object ``module.name`` is in a module this process has imported already, else None.

    Nothing is imported, and no module ``__getattr__`` runs: an unpickler finds an allowed global
    in a module imported by whoever allowed it; a name it would not find is refused by it anyway.
    Every split of the dotted path is tried (torch's weights-only unpickler matches
    ``module + "." + name`` as one string, so ``("a.b", "c.D")`` names ``a.b.c.D``).
    """
    parts = f"{module}.{name}".split(".")
    for cut in range(len(parts) - 1, 0, -1):
        obj: Any = sys.modules.get(".".join(parts[:cut]))
        for attr in parts[cut:]:
            if obj is None:
                break
            try:
                obj = vars(obj).get(attr)
            except Exception:  # noqa: BLE001 - no __dict__ (slots, C objects): not looked into
                obj = None
        if obj is not None:
            return obj
    return None


# A value of the simulated stack. A leaf (scalar, string, global) is an int: its literal's offset
# + 1 (0: none) << 48 | its size << 8 | tags. A container or a call's result is a list:
# [size (items, or what its call copied), nesting depth, its items if a tuple (a call's arguments) else None].
_INT, _STR, _SHARED, _SIZED, _LITERAL, _SHARED_RESULT = 1, 2, 4, 8, 16, 32
_SIZE_MASK = (1 << 40) - 1
_ONE = 1 << 8
_INT_LEAF = _ONE | _INT
#: Tags of a global whose calls :func:`scan_pickle` checks beyond their cost.
_CHECKED_CALL = _SIZED | _LITERAL | _SHARED_RESULT

_OPS = {op.code.encode("latin-1")[0]: op for op in pickletools.opcodes}
#: Per opcode byte, its argument: 0 none, n > 0 that many bytes, -1 a line (two for GLOBAL and INST),
#: -2..-5 a length of 1, 4 (signed), 4, 8 bytes then that many bytes; None for a byte that is no opcode.
_ARG: list[int | None] = [None] * 256
for _code, _op in _OPS.items():
    _ARG[_code] = 0 if _op.arg is None else _op.arg.n
_LENGTH_WIDTH = {-2: 1, -3: 4, -4: 4, -5: 8}
_INTS = frozenset(b"IJKML\x8a\x8b")
_SCALARS = frozenset(b"FGN\x88\x89")
_TEXTS = frozenset(b"STUV\x8cX\x8d")
_BYTES = frozenset(b"BC\x8e\x96")
_REFUSED = {
    0x50: "a persistent id",
    0x51: "a persistent id",
    0x82: "an extension code",
    0x83: "an extension code",
    0x84: "an extension code",
    0x97: "an out-of-band buffer",
    0x98: "an out-of-band buffer",
}


def _size(v: Any) -> int:
    return (v >> 8) & _SIZE_MASK if type(v) is int else v[0]


def scan_pickle(data: bytes, prefix: str, policy: PicklePolicy) -> str | None:
    """Refuse, before anything is built, a pickle that would crash or exhaust the process or change
    an object outside the ones it returns.

    One pass over the opcodes that simulates the unpickler's stack, each value with its size (items
    of a container, characters of a string), nesting depth and what it is. Refused: a length or
    frame that runs past the end (the C unpickler allocates the stated length before reading); a
    memo index beyond the next free one (it sizes its memo to twice the index); containers nested
    more than ``max_nesting`` deep; decimal integers longer than ``max_digits``; extension codes
    and out-of-band buffers, and persistent ids unless the policy allows them; calls that copy more
    than the pickle's size allows (each call and each ``BUILD`` is charged the size of its
    arguments or state and of their items, which a writer's pickle spells out once each; a
    memoized list handed to ``torch.Size`` again and again is not); the policy's sized and literal
    calls with other arguments; and ``BUILD``, ``SETITEM(S)``, ``APPEND(S)`` or ``ADDITEMS`` on a
    module-level object: a global itself (a class, a function, a dtype) or what a call of an enum
    class returns (its member). Loading such a pickle would change that object for the whole
    process. What is left, the caller's unpickler refuses by itself.

    Args:
        data: The pickle.
        prefix: Starts every message (the file, and what is refused).
        policy: The caller's rules.

    Returns:
        With ``policy.report_tensor_data``: what first builds tensor data ("calls torch.X", "refers
        to a tensor storage"), else None.

    Raises:
        FormatError: The pickle is refused, or is not a pickle.
    """
    found: str | None = None
    # One branch per opcode, the most frequent first: this runs over every byte of every object
    # tree and metadata file.
    stack: list[Any] = []
    push = stack.append
    pop = stack.pop
    marks: list[int] = []
    memo: list[Any] = []
    budget = len(data) + policy.copy_slack
    limit = policy.max_nesting
    end = len(data)
    max_memo = end if policy.max_memo is None else policy.max_memo
    max_items = end if policy.max_container_items is None else policy.max_container_items
    max_string = end if policy.max_string_bytes is None else policy.max_string_bytes
    pos = 0
    unpack_from = struct.unpack_from
    known: dict[str, int] = {}  # the tags of each global named, found once per scan

    def refuse(why: str) -> FormatError:
        return FormatError(f"{prefix}: {policy.subject} {why} (byte {pos}){policy.suffix}")

    def cost(v: Any) -> int:
        if type(v) is int:
            return (v >> 8) & _SIZE_MASK
        c = v[0]
        if v[2]:
            for item in v[2]:
                c += (item >> 8) & _SIZE_MASK if type(item) is int else item[0]
        return c

    def container(items: Any, tuple_items: bool) -> list[Any]:
        depth = 0
        for item in items:
            if type(item) is not int and item[1] > depth:
                depth = item[1]
        if depth >= limit:
            raise refuse(f"nests containers more than {limit} deep")
        if len(items) > max_items:
            raise refuse(f"builds a container of {len(items)} items, over {max_items}")
        return [len(items), depth + 1, tuple(items) if tuple_items else None]

    def over_budget() -> FormatError:
        return refuse(f"makes calls that copy more than its {end} bytes allow (memoized values handed on again and again)")

    def shared(why: str) -> FormatError:
        return refuse(
            f"{why} a module-level object (a class, a function or an enum member): loading it would change that "
            "object for the whole process, which no writer does"
        )

    def grow(items: list[Any], count: int) -> None:
        target = stack[-1]
        if type(target) is int:
            if target & _SHARED:
                raise shared("adds items to")
            raise refuse("adds items to something that is not a list, dict or set")
        if target[2] is not None:
            raise refuse("adds items to a tuple")
        target[0] += count
        if target[0] > max_items:
            raise refuse(f"builds a container of more than {max_items} items")
        for item in items:
            if type(item) is not int and item[1] >= target[1]:
                if item[1] >= limit:
                    raise refuse(f"nests containers more than {limit} deep")
                target[1] = item[1] + 1

    def to_mark() -> list[Any]:
        mark = marks.pop()
        items = stack[mark:]
        del stack[mark:]
        return items

    def first_of(args: Any) -> Any:
        if type(args) is int:
            return args
        return args[2][0] if args[2] else 0

    def call(func: Any, args: Any, charged: int) -> Any:
        """The value a call of ``func`` leaves: a module-level member, or a new object."""
        if type(func) is int:
            first = first_of(args)
            if func & _SIZED and type(first) is int and first & _INT:
                raise refuse("builds a bytearray from a size, which no writer does")
            if func & _LITERAL:
                if type(first) is not int or not first & _STR or first >> 48 == 0:
                    raise refuse("encodes something other than a string literal, which no writer does")
            if func & _SHARED_RESULT:
                return _ONE | _SHARED
        return [charged or 1, 0 if type(args) is int else args[1], None]

    def named(module: str, name: str) -> int:
        nonlocal found
        if policy.report_tensor_data and found is None and builds_tensor(f"{module}.{name}"):
            found = f"{policy.subject} calls {module[:100]}.{name[:100]}"
        key = f"{module}.{name}"
        tags = known.get(key)
        if tags is None:
            tags = known[key] = policy.global_tags(module, name)
        return _ONE | tags

    def text_of(v: Any) -> str | None:
        if type(v) is not int or not v & _STR or v >> 48 == 0:
            return None
        start = (v >> 48) - 1
        return data[start : start + ((v >> 8) & _SIZE_MASK)].decode("utf-8", "replace")

    try:
        while pos < end:
            code = data[pos]
            pos += 1
            # The opcodes of a torch.save tree by frequency (measured on an optimizer state:
            # BINGET, LONG_BINPUT, BININT2, TUPLE1, REDUCE, BININT1, MARK, SETITEMS, EMPTY_DICT).
            if code == 0x68:  # BINGET
                push(memo[data[pos]])
                pos += 1
            elif code == 0x72 or code == 0x71 or code == 0x94:  # LONG_BINPUT, BINPUT, MEMOIZE
                if code == 0x72:
                    index = unpack_from("<I", data, pos)[0]
                    pos += 4
                elif code == 0x71:
                    index = data[pos]
                    pos += 1
                else:
                    index = len(memo)
                if index == len(memo):
                    if index >= max_memo:
                        raise refuse(f"memoizes more than {max_memo} values")
                    memo.append(stack[-1])
                elif index < len(memo):
                    memo[index] = stack[-1]
                else:
                    raise refuse(f"puts memo index {index} after {len(memo)} memo entries")
            elif code == 0x4D or code == 0x4B or code == 0x4A:  # BININT2, BININT1, BININT
                pos += 2 if code == 0x4D else 1 if code == 0x4B else 4
                push(_INT_LEAF)
            elif code == 0x85:  # TUPLE1
                item = stack[-1]
                if type(item) is int:
                    stack[-1] = [1, 1, (item,)]
                else:
                    stack[-1] = container([item], True)
            elif code == 0x52 or code == 0x81:  # REDUCE, NEWOBJ: func(*args), cls.__new__(cls, *args)
                args = pop()
                func = stack[-1]
                if type(args) is int:
                    charged = (args >> 8) & _SIZE_MASK
                else:
                    charged = args[0]
                    for item in args[2] or ():
                        charged += (item >> 8) & _SIZE_MASK if type(item) is int else item[0]
                budget -= charged
                if budget < 0:
                    raise over_budget()
                if type(func) is int and func & _CHECKED_CALL:
                    stack[-1] = call(func, args, charged)
                else:
                    stack[-1] = [charged or 1, 0 if type(args) is int else args[1], None]
            elif code == 0x28:  # MARK
                marks.append(len(stack))
            elif code == 0x73:  # SETITEM
                value = pop()
                key = pop()
                grow([key, value], 1)
            elif code == 0x6A:  # LONG_BINGET
                push(memo[unpack_from("<I", data, pos)[0]])
                pos += 4
            elif code == 0x58 or code == 0x8C:  # BINUNICODE, SHORT_BINUNICODE
                if code == 0x58:
                    n = unpack_from("<I", data, pos)[0]
                    pos += 4
                else:
                    n = data[pos]
                    pos += 1
                if n > end - pos or n > max_string:
                    raise refuse(f"has a string of {n} bytes where {end - pos} are left")
                push(((pos + 1) << 48) | (n << 8) | _STR)
                pos += n
            elif code == 0x75:  # SETITEMS
                items = to_mark()
                grow(items, len(items) // 2)
            elif code == 0x7D or code == 0x5D or code == 0x8F:  # EMPTY_DICT, EMPTY_LIST, EMPTY_SET
                push([0, 1, None])
            elif code == 0x29:  # EMPTY_TUPLE
                push([0, 1, ()])
            elif code == 0x86 or code == 0x87:  # TUPLE2, TUPLE3
                k = code - 0x84
                items = stack[-k:]
                if len(items) != k or (marks and len(stack) - k < marks[-1]):
                    raise refuse("builds a tuple of missing items")
                del stack[-k:]
                push(container(items, True))
            elif code == 0x74:  # TUPLE
                push(container(to_mark(), True))
            elif code == 0x62:  # BUILD: the state goes into the object
                state = pop()
                budget -= cost(state)
                if budget < 0:
                    raise over_budget()
                target = stack[-1]
                if type(target) is int:
                    if target & _SHARED:
                        raise shared("sets the state of")
                elif type(state) is not int and state[1] >= target[1]:
                    if state[1] >= limit:
                        raise refuse(f"nests containers more than {limit} deep")
                    target[1] = state[1] + 1
            elif code == 0x61:  # APPEND
                item = pop()
                grow([item], 1)
            elif code == 0x65 or code == 0x90:  # APPENDS, ADDITEMS
                items = to_mark()
                grow(items, len(items))
            elif code == 0x47:  # BINFLOAT
                pos += 8
                push(_ONE)
            elif code == 0x4E or code == 0x88 or code == 0x89:  # None, True, False
                push(_ONE)
            elif code == 0x63:  # GLOBAL: module and name, a line each
                first = data.index(b"\n", pos, min(end, pos + policy.max_text_arg))
                second = data.index(b"\n", first + 1, min(end, first + 1 + policy.max_text_arg))
                module, name = data[pos:first].decode("utf-8", "replace"), data[first + 1 : second].decode("utf-8", "replace")
                pos = second + 1
                push(named(module, name))
            elif code == 0x93:  # STACK_GLOBAL
                name_text = text_of(pop())
                module_text = text_of(stack[-1])
                if module_text is None or name_text is None:
                    raise refuse("names a global by something other than string literals")
                stack[-1] = named(module_text, name_text)
            elif code == 0x51:  # BINPERSID: a storage in place of its id
                if not policy.persistent_ids:
                    raise refuse("has a persistent id")
                stack[-1] = _ONE
                if policy.report_tensor_data and found is None:
                    found = f"{policy.subject} refers to a tensor storage"
            elif code == 0x92:  # NEWOBJ_EX: cls.__new__(cls, *args, **kwargs)
                kwargs = pop()
                args = pop()
                charged = cost(args) + cost(kwargs)
                budget -= charged
                if budget < 0:
                    raise over_budget()
                stack[-1] = call(stack[-1], args, charged)
            elif code == 0x69 or code == 0x6F:  # INST, OBJ: cls(*items)
                func = None
                if code == 0x69:
                    first = data.index(b"\n", pos, min(end, pos + policy.max_text_arg))
                    second = data.index(b"\n", first + 1, min(end, first + 1 + policy.max_text_arg))
                    module, name = data[pos:first].decode("utf-8", "replace"), data[first + 1 : second].decode("utf-8", "replace")
                    pos = second + 1
                    func = named(module, name)
                items = to_mark()
                if code == 0x6F:
                    if not items:
                        raise refuse("calls nothing")
                    func = items.pop(0)
                charged = sum(cost(v) for v in items)
                budget -= charged
                if budget < 0:
                    raise over_budget()
                push(call(func, [len(items), 1, tuple(items)], charged))
            elif code == 0x30:  # POP
                if marks and len(stack) == marks[-1]:
                    marks.pop()  # as the C unpickler does: POP right after MARK drops the mark
                else:
                    pop()
            elif code == 0x31:  # POP_MARK
                to_mark()
            elif code == 0x32:  # DUP
                push(stack[-1])
            elif code == 0x95:  # FRAME: the C unpickler reads the whole frame first
                size = unpack_from("<Q", data, pos)[0]
                pos += 8
                if size > end - pos:
                    raise refuse(f"has a frame of {size} bytes where {end - pos} are left")
            elif code == 0x80:  # PROTO
                pos += 1
            elif code == 0x2E:  # STOP
                return found
            elif code in _REFUSED:
                raise refuse(f"has {_REFUSED[code]}")
            else:  # the rarer ones, by their argument
                width = _ARG[code]
                if width is None:
                    raise refuse(f"has {code:#04x}, which is no pickle opcode")
                start = pos
                if width == -1:  # text (protocol 0)
                    stop = data.find(b"\n", pos, min(end, pos + policy.max_text_arg))
                    if stop < 0:
                        raise refuse("has a text argument without its end")
                    pos = stop + 1
                    text = data[start:stop]
                    if code in (0x49, 0x4C) and len(text) > policy.max_digits:
                        raise refuse(f"has an integer of {len(text)} digits")
                    if code == 0x70 or code == 0x67:  # PUT, GET
                        index = int(text)
                        if code == 0x67:
                            push(memo[index])
                        elif index == len(memo):
                            if index >= max_memo:
                                raise refuse(f"memoizes more than {max_memo} values")
                            memo.append(stack[-1])
                        elif 0 <= index < len(memo):
                            memo[index] = stack[-1]
                        else:
                            raise refuse(f"puts memo index {index} after {len(memo)} memo entries")
                        continue
                    size = len(text)
                elif width < 0:  # a length, then that many bytes: the C unpickler allocates the length first
                    w = _LENGTH_WIDTH[width]
                    size = data[pos] if w == 1 else unpack_from("<i" if width == -3 else "<I" if w == 4 else "<Q", data, pos)[0]
                    pos += w
                    if size < 0 or size > end - pos or (size > max_string and code not in _INTS):
                        raise refuse(f"has a length of {size} bytes where {end - pos} are left")
                    start = pos
                    pos += size
                else:
                    pos += width
                    size = 1
                if code in _TEXTS:
                    push(((start + 1) << 48) | (size << 8) | _STR)
                elif code in _BYTES:
                    push(((start + 1) << 48) | (size << 8) | _STR)
                elif code in _INTS:
                    push(_ONE | _INT)
                elif code in _SCALARS:
                    push(_ONE)
                else:
                    raise refuse(f"has {_OPS[code].name}")
    except FormatError:
        raise
    except (IndexError, KeyError, ValueError, TypeError, struct.error) as exc:
        raise FormatError(
            f"{prefix}: {policy.subject} is malformed near byte {pos} ({type(exc).__name__}){policy.suffix}"
        ) from exc
    raise FormatError(f"{prefix}: {policy.subject} ends without STOP (truncated?){policy.suffix}")
