"""The NVIDIA GPU through NVML (nvidia-ml-py): memory used by this process and by others (per process where
the driver tells), free memory and utilisation. Used by the window's telemetry and by run records."""

from __future__ import annotations

import os
import time

import psutil

try:  # imported once, on the importing thread (the window imports it on the main thread)
    import pynvml
except ImportError:  # pragma: no cover
    pynvml = None

# Why NVML cannot be opened, by binding, once its shared library was not found: nvidia-ml-py tries to load the
# library (a dlopen) again at every nvmlInit while it is missing, and a dlopen on one thread while another builds or
# collects Qt objects can deadlock; so on a machine without the library it is tried once. Keyed by the binding
# object, as tests swap in a stand-in.
_library_missing: dict[int, str] = {}


def init() -> str:
    """pynvml.nvmlInit(): '' once it succeeded, else why NVML cannot be used (the library missing, no driver ...).
    Where the library was not found, it is not looked for again in this process (_library_missing)."""
    if pynvml is None:
        return "nvidia-ml-py is not installed"
    missing = _library_missing.get(id(pynvml))
    if missing is not None:
        return missing
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        note = f"no NVIDIA GPU ({str(exc) or type(exc).__name__})"
        if isinstance(exc, getattr(pynvml, "NVMLError_LibraryNotFound", ())):
            _library_missing[id(pynvml)] = note
        return note
    return ""


def cuda_handle(nv, index: int):
    """NVML's handle of the GPU CUDA calls device `index` in this process. NVML numbers every GPU of the machine, CUDA
    only those CUDA_VISIBLE_DEVICES lists, in its order: the machine's indices (NVML's where CUDA_DEVICE_ORDER is
    PCI_BUS_ID or the GPUs are alike) or UUIDs, whole or their start."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return nv.nvmlDeviceGetHandleByIndex(index)
    entries = [entry.strip() for entry in visible.split(",")] if visible.strip() else []
    if index >= len(entries):
        raise LookupError(f"CUDA_VISIBLE_DEVICES={visible!r} leaves this process no GPU {index}")
    entry = entries[index]
    if entry.isdigit():
        return nv.nvmlDeviceGetHandleByIndex(int(entry))
    try:  # a whole UUID: a GPU's, or a MIG instance's (GPU-..., MIG-...)
        return nv.nvmlDeviceGetHandleByUUID(entry)
    except Exception:
        pass
    for machine_index in range(nv.nvmlDeviceGetCount()):
        handle = nv.nvmlDeviceGetHandleByIndex(machine_index)
        uuid = nv.nvmlDeviceGetUUID(handle)
        if (uuid.decode() if isinstance(uuid, bytes) else str(uuid)).startswith(entry):
            return handle
    raise LookupError(f"no GPU's UUID starts with CUDA_VISIBLE_DEVICES's {entry!r}")


RETRIES = 12          # times NVML is opened again after it failed (not ready yet, a driver reload) before it is given up
RETRY_AFTER_S = 5.0   # seconds between those tries


class Nvml:
    """NVML through nvidia-ml-py, with the fallbacks nvitop uses across driver versions. Where it cannot be opened or
    stops answering, it is opened again RETRY_AFTER_S later, RETRIES times (the note says so), unless what is missing
    stays missing: nvidia-ml-py or its library (not looked for again: init), or the GPU CUDA_VISIBLE_DEVICES names.
    Tries after the first run on the sampling thread: the library is loaded by then (no dlopen there, see init)."""

    clock = staticmethod(time.monotonic)

    def __init__(self, index: int = 0):
        self.index = index
        self.handle = None
        self.note = ""
        self.name = ""
        self.nv = pynvml
        self.retrying = False  # whether NVML is opened again after the failure the note says
        self._tries_left = RETRIES
        self._retry_at = 0.0
        self._open()

    def _open(self) -> None:
        self.handle = None
        note = init()
        lasting = pynvml is None or id(pynvml) in _library_missing
        if not note:
            try:
                if pynvml.nvmlDeviceGetCount() == 0:
                    note = "NVML found no NVIDIA GPU"
                else:
                    handle = cuda_handle(pynvml, self.index)
                    name = pynvml.nvmlDeviceGetName(handle)
                    self.name = name.decode() if isinstance(name, bytes) else str(name)
                    self.handle = handle
            except LookupError as exc:  # CUDA_VISIBLE_DEVICES names no GPU of this machine: so it stays
                note, lasting = f"no NVIDIA GPU ({exc})", True
            except Exception as exc:
                note = f"no NVIDIA GPU ({str(exc) or type(exc).__name__})"
        if note:
            self._failed(note, lasting)
        else:
            self.note, self.retrying = "", False

    def _failed(self, note: str, lasting: bool = False) -> None:
        """No reading, for the reason `note`: tried again after RETRY_AFTER_S while tries are left."""
        self.retrying = not lasting and self._tries_left > 0
        if self.retrying:
            self._tries_left -= 1
            self._retry_at = self.clock() + RETRY_AFTER_S
            self.note = f"{note}; NVML is asked again in {RETRY_AFTER_S:.0f} s"
        elif lasting:
            self.note = note
        else:
            self.note = (f"{note}; NVML was asked {RETRIES + 1} times, {RETRY_AFTER_S:.0f} s apart, and is no longer "
                         "asked (restart MoE Workbench to read the GPU)")

    def _processes(self) -> list[tuple]:
        """Compute and graphics processes on the GPU (newest NVML call the binding has first), each with whether it
        computes: one only among the graphics processes draws the screen."""
        found, computing = {}, set()
        for kind in ("Compute", "Graphics"):
            for getter in (f"nvmlDeviceGet{kind}RunningProcesses_v3", f"nvmlDeviceGet{kind}RunningProcesses"):
                function = getattr(self.nv, getter, None)
                if function is None:
                    continue
                try:
                    for proc in function(self.handle):
                        found.setdefault(proc.pid, proc)
                        if kind == "Compute":
                            computing.add(proc.pid)
                    break
                except Exception:
                    continue
        return [(proc, pid in computing) for pid, proc in found.items()]

    def sample(self) -> dict | None:
        if self.handle is None and self.retrying and self.clock() >= self._retry_at:
            self._open()
        if self.handle is None:
            return None
        nv = self.nv
        try:
            memory = nv.nvmlDeviceGetMemoryInfo(self.handle)
        except Exception as exc:  # a driver reload, a GPU reset: its handle is opened again
            self.handle = None
            self._failed(f"NVML stopped answering ({exc})")
            return None
        self._tries_left = RETRIES
        try:
            util = float(nv.nvmlDeviceGetUtilizationRates(self.handle).gpu)
        except Exception:
            util = None
        me = os.getpid()
        this, top, known, listed_me = 0, [], True, False
        for proc, computes in self._processes():
            used = getattr(proc, "usedGpuMemory", None)
            if used is None:
                # the driver (or a container) hides its memory: the split is unknown only where a process that
                # computes is hidden, as one that only draws (the display server) is left out below whatever it holds
                known = known and not computes
                continue
            if proc.pid == me:
                this += int(used)
                listed_me = True
            elif computes:
                top.append({"pid": proc.pid, "name": _process_name(proc.pid), "bytes": int(used)})
            # else it only draws: the display server or compositor (drawing this window too), a browser's GPU process.
            # What it holds comes with the desktop, not work one would pause for the model. NVML's lists say so
            # whatever it is called, where names (Xorg, Xwayland, gnome-shell, kwin_wayland, sway, ...) miss those
            # not listed; a game draws only too, and goes unnamed
        if not listed_me and any(not psutil.pid_exists(p["pid"]) for p in top):
            # NVML gives the host's pids: in a container's pid namespace this process is listed under one this system
            # does not have, and which one is not known, so its memory must not be counted as the others'
            known, top = False, []
        top.sort(key=lambda p: -p["bytes"])
        used = int(memory.used)
        # "others" is all in use but this process's, what the card has left for it (the budget panel's); "listed" is
        # what NVML lists under other processes that compute, so without the driver's own reservations (no process's:
        # a few hundred MB with nothing running) nor the display's, which the contention warning must not read as
        # another workload
        return {"name": self.name, "total": int(memory.total), "used": used, "free": int(memory.free),
                "this": this, "others": max(0, used - this), "listed": sum(p["bytes"] for p in top), "util": util,
                "top": top[:5], "per_process": known}


INTERPRETERS = ("python", "node", "java", "perl", "ruby", "bash", "sh", "dotnet", "mono")


def describe(proc: psutil.Process, name: str) -> str:
    """A process as a person recognises it: 'python bench_qmoe_cpu.py' rather than 'python'."""
    if not name.lower().startswith(INTERPRETERS):
        return name
    try:
        args = proc.cmdline()[1:]
    except psutil.Error:
        return name
    for arg in args:
        if arg == "-c":  # inline code, not a script: its text named the process ('python  8); time.sleep(60)')
            return f"{name} -c"
        if arg == "-m":
            continue
        if not arg.startswith("-"):
            return f"{name} {arg.rsplit('/', 1)[-1]}"
    return name


def _process_name(pid: int) -> str:
    try:
        proc = psutil.Process(pid)
        return describe(proc, proc.name())
    except Exception:
        return f"pid {pid}"
