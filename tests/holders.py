"""What keeps an object alive that a test expects gone: the chain of references from a root (a module's globals, a
running thread's frame, an object the collector does not track) down to it, for the test's failure message. A test
that drops a model and finds it alive (tests/test_offload_cuda.py) failed once in a whole GPU run and never in its
file alone: its message now says what held the model."""

from __future__ import annotations

import gc
import sys
import types

MAX_DEPTH = 8
MAX_CHAINS = 3


def _name(obj) -> str:
    """A referrer in a few words: its type and, where it has one, the name that says which."""
    if isinstance(obj, types.FrameType):
        return f"frame of {obj.f_code.co_name} ({obj.f_code.co_filename.rsplit('/', 1)[-1]}:{obj.f_lineno})"
    if isinstance(obj, types.ModuleType):
        return f"module {obj.__name__}"
    if isinstance(obj, (types.FunctionType, types.MethodType)):
        return f"{type(obj).__name__} {getattr(obj, '__qualname__', '?')}"
    if isinstance(obj, dict):
        owner = next((m.__name__ for m in list(sys.modules.values()) if getattr(m, "__dict__", None) is obj), None)
        return f"globals of {owner}" if owner else f"dict of {len(obj)}"
    if isinstance(obj, (list, tuple, set)):
        return f"{type(obj).__name__} of {len(obj)}"
    return type(obj).__qualname__


def _key(holder, held) -> str:
    """How `holder` refers to `held`: the dict key or attribute, where one does."""
    if isinstance(holder, dict):
        for key, value in holder.items():
            if value is held:
                return f"[{key!r}]"
    return ""


def holders(target, skip=()) -> str:
    """Up to MAX_CHAINS chains "root -> ... -> target's type" found by walking referrers breadth first, MAX_DEPTH deep;
    `skip`: objects the caller holds (its own lists and frame) that are not the reason."""
    ignored = {id(obj) for obj in skip} | {id(sys._getframe())}
    # a running frame is a root; a finished one lives on only through what holds it (a traceback kept in a cycle, a
    # younger frame's f_back), which the chain goes on to say
    running = set()
    for frame in sys._current_frames().values():
        while frame is not None:
            running.add(id(frame))
            frame = frame.f_back
    seen = {id(target)}
    level = [(target, [])]
    ignored.add(id(level[0]))
    chains = []
    for _ in range(MAX_DEPTH):
        next_level = []
        for obj, path in level:
            referrers = gc.get_referrers(obj)
            ignored.add(id(referrers))
            for holder in referrers:
                if id(holder) in ignored or id(holder) in seen or holder is level or holder is next_level:
                    continue
                seen.add(id(holder))
                step = path + [f"{_name(holder)}{_key(holder, obj)}"]
                if isinstance(holder, types.ModuleType) or id(holder) in running or not gc.get_referrers(holder):
                    chains.append(" -> ".join(reversed(step)) + f" -> {_name(target)}")
                    if len(chains) == MAX_CHAINS:
                        return "; ".join(chains)
                else:
                    entry = (holder, step)
                    ignored.add(id(entry))  # (the walk's own tuples refer to what it walks: not holders)
                    next_level.append(entry)
        if not next_level:
            break
        level = next_level
    # no root: the target is held in a cycle a collection would free; one path into it, from its far end
    deepest = " -> ".join(reversed(level[0][1])) + " -> " if level and level[0][1] else ""
    return "; ".join(chains) or f"no root found within {MAX_DEPTH} references (a cycle the collector would free?): " \
                                f"{deepest}{_name(target)}"
