"""The CPU kernels' Numba cache folder follows their source (kernels/cpu/numba_cache.py); a cached function that
calls a parallel kernel launches Numba's threading layer before its entry loads."""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import shutil

import numba
from numba.core.caching import FunctionCache
from numba.core.cpu import ParallelOptions
from numba.core.dispatcher import Dispatcher

import engine
import kernels
from kernels.cpu import numba_cache


def test_cache_folder_changes_with_any_kernel_source(tmp_path, monkeypatch):
    copy = tmp_path / "cpu"
    shutil.copytree(numba_cache.HERE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(numba_cache, "HERE", copy)
    before = numba_cache.source_digest()
    assert before == numba_cache.source_digest()
    simd = copy / "simd.py"
    simd.write_text(simd.read_text() + "\n# an edit to the intrinsics alone\n")
    assert numba_cache.source_digest() != before


def test_cache_goes_under_numba_cache_dir_when_set(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(numba.config, "CACHE_DIR", numba.config.CACHE_DIR)
    folder = numba_cache.configure()
    assert folder.parent == tmp_path and folder.name == f"cpu-kernels-{numba_cache.source_digest()}"
    assert numba.config.CACHE_DIR == str(folder)


def _jitted_functions() -> dict[str, Dispatcher]:
    """Every Numba function defined in kernels/ and engine/, by its module's name and its own."""
    found = {}
    for package in (kernels, engine):
        for module_info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            module = importlib.import_module(module_info.name)
            found.update({f"{module.__name__}.{name}": value for name, value in vars(module).items()
                          if isinstance(value, Dispatcher) and value.py_func.__module__ == module.__name__})
    return found


def _callees(function) -> set[Dispatcher]:
    """The Numba functions `function` names: its globals, its closure's cells, attributes of the modules it names."""
    names, codes = set(), [function.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(const for const in code.co_consts if inspect.iscode(const))
    values = [function.__globals__[name] for name in names if name in function.__globals__]
    values += [cell.cell_contents for cell in function.__closure__ or ()]
    values += [getattr(value, name) for value in values if inspect.ismodule(value) for name in names
               if hasattr(value, name)]
    return {value for value in values if isinstance(value, Dispatcher)}


def _parallel(function: Dispatcher) -> bool:
    return ParallelOptions(function.targetoptions.get("parallel", False)).enabled


def _reaches_parallel(function: Dispatcher, seen: set) -> bool:
    for callee in _callees(function.py_func) - seen:
        seen.add(callee)
        if _parallel(callee) or _reaches_parallel(callee, seen):
            return True
    return False


def test_every_cached_function_that_calls_a_parallel_one_launches_the_threading_layer_before_it_loads():
    """Numba writes such a function's entry without its threading-layer hook where the writing process loaded the
    parallel callee from the cache; loaded as a process's first kernel call, it died (numba_cache.calls_parallel)."""
    functions = _jitted_functions()
    needing = {name for name, function in functions.items() if isinstance(function._cache, FunctionCache)
               and not _parallel(function) and _reaches_parallel(function, set())}
    marked = {name for name, function in functions.items()
              if isinstance(function._cache, numba_cache.ThreadsFirstCache)}
    assert not needing - marked, f"not marked @calls_parallel: {', '.join(sorted(needing - marked))}"
    assert marked == needing  # and nothing marked that calls no parallel kernel
    # the scan sees through a call: _cpu_part calls moe_gemv, run_host_parts calls _cpu_part
    assert sorted(needing) == ["kernels.cpu.host_parts._cpu_part", "kernels.cpu.host_parts.run_host_parts"]
