"""The contention test: a real document-indexing workload (text files into SQLite FTS5 shards by
worker processes) alone, inference alone, then both at once; each one's time and slowdown."""

from __future__ import annotations

import multiprocessing
import shutil
import sqlite3
import tempfile
import threading
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import platformdirs

from engine.errors import WorkbenchError
from engine.host_load import HostLoadMeter
from engine.sampling import SamplingParams, describe
from engine.units import counted, duration_text

_WORDS = ("expert router token layer memory bandwidth cache offload device budget prefill decode "
          "placement resident cold hot kernel thread index search query document corpus record sweep "
          "latency throughput model weight quantise scale block matrix vector attention context window "
          "report summary meeting invoice contract project schedule design review release build test").split()


def make_corpus(folder: Path, files: int = 2000, words_per_file: int = 1500, seed: int = 0) -> Path:
    """Deterministic text files (about 10 KB each) to index; reused when already complete."""
    folder = Path(folder)
    marker = folder / f".complete-{files}-{words_per_file}-{seed}"
    if marker.is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    vocabulary = np.array(_WORDS + [f"term{i}" for i in range(5000)])
    weights = 1.0 / np.arange(1, len(vocabulary) + 1) ** 1.1  # Zipf, like real text
    weights /= weights.sum()
    for index in range(files):
        words = rng.choice(vocabulary, words_per_file, p=weights)
        lines = [" ".join(words[i:i + 15]) + "." for i in range(0, words_per_file, 15)]
        (folder / f"doc{index:05d}.txt").write_text("\n".join(lines))
    marker.touch()
    return folder


def default_corpus() -> Path:
    return make_corpus(Path(platformdirs.user_cache_dir("moe-workbench")) / "contention-corpus")


def corpus_problem(corpus: Path) -> str | None:
    """What keeps `corpus` from being indexed; None where nothing does."""
    if not corpus.is_dir():
        return "a file, not a folder of .txt files" if corpus.exists() else "no such folder"
    if not any(corpus.glob("*.txt")):
        return "no .txt files to index"
    return None


def _index_shard(args: tuple[list[str], str]) -> int:
    """One worker: index its files into its own FTS5 database."""
    paths, database = args
    with closing(sqlite3.connect(database)) as db, db:
        db.execute("CREATE VIRTUAL TABLE IF NOT EXISTS docs USING fts5(path, body)")
        for path in paths:
            try:  # any text: the indexing is the load timed, not a search to be right
                body = Path(path).read_text(encoding="utf-8", errors="replace")
            except OSError as exc:  # (a WorkbenchError of one argument comes back from the worker whole)
                raise WorkbenchError(f"{path}: not readable ({exc.strerror or exc})") from None
            db.execute("INSERT INTO docs (path, body) VALUES (?, ?)", (path, body))
        db.execute("INSERT INTO docs(docs) VALUES ('optimize')")
    return len(paths)


MAX_WORKERS = 256  # indexing processes at most (the window's and the command line's): a process is spawned each


def index_folder(folder: Path, workers: int) -> tuple[int, float]:
    """Index every .txt file of `folder` with `workers` processes; (documents, seconds)."""
    paths = sorted(str(p) for p in Path(folder).glob("*.txt"))
    scratch = Path(tempfile.mkdtemp(prefix="moe-workbench-index-"))
    try:
        jobs = [(paths[i::workers], str(scratch / f"shard{i}.sqlite3")) for i in range(workers)]
        started = time.perf_counter()
        # spawn: the parent holds onnxruntime and Numba thread pools, which must not be forked.
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            documents = sum(pool.map(_index_shard, jobs))
        return documents, time.perf_counter() - started
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# said of a test on the simulated GPU, by the report and the window
STAND_IN = ("The CPU computes the simulated card's experts too, standing in for it: the inference times are the CPU's, "
            "not the card's.")


@dataclass
class ContentionReport:
    workers: int
    documents: int
    indexing_alone_s: float
    inference_alone_s: float
    indexing_with_inference_s: float
    inference_with_indexing_s: float
    # the CPU expert kernels' threads at the end of inference alone and beside the indexing (KernelThreads.state;
    # None where not given): the automatic count leaves the indexing's cores to it
    threads_alone: dict | None = None
    threads_together: dict | None = None
    # the share of the CPUs' time other processes (not this one, nor its indexing workers) used in each timed phase:
    # an "alone" phase beside other work is not alone (engine/host_load.py); None where not measured
    others_share: dict | None = None
    # how the inference's answers were asked for (schema.generation_settings); None where not given
    generation: dict | None = None
    # why the inference ran every expert on the CPU where the CUDA GPU asked for could not be used (the load's note,
    # as a run record's offload["device_fallback"]); None otherwise
    device_fallback: str | None = None
    # the model folder, and the device the inference ran on as a run record names it ("cpu", "simulated GPU, 8.0 GiB",
    # the card's name); None where not given
    model: str | None = None
    device: str | None = None
    # the device is the simulated GPU: the CPU computes the card's experts too, so the inference's times are the CPU's
    simulated: bool = False
    # the scenario the inference ran (scenarios.SCENARIOS): its row names it; None where not given
    scenario: str | None = None

    @property
    def indexing_slowdown(self) -> float:  # (time together / time alone: below 1 where faster together)
        return self.indexing_with_inference_s / self.indexing_alone_s

    @property
    def inference_slowdown(self) -> float:
        return self.inference_with_indexing_s / self.inference_alone_s

    @property
    def indexing(self) -> str:
        """The indexing workload, as the report's row and the window's table name it."""
        return f"indexing {counted(self.documents, 'file')}, {counted(self.workers, 'worker')}"

    @property
    def inference(self) -> str:
        """The inference workload, named by its scenario (a multiturn chat's six answers, or one), as the report's row
        and the window's table name it."""
        return f"inference ({self.scenario})" if self.scenario else "inference"

    def rows(self) -> tuple[tuple[str, float, float, float], ...]:
        """Each workload's (name, seconds alone, seconds together, together / alone), as the report's table and the
        window's give them."""
        return ((self.indexing, self.indexing_alone_s, self.indexing_with_inference_s, self.indexing_slowdown),
                (self.inference, self.inference_alone_s, self.inference_with_indexing_s, self.inference_slowdown))

    def as_dict(self) -> dict:
        return {**vars(self), "indexing_slowdown": self.indexing_slowdown,
                "inference_slowdown": self.inference_slowdown}

    def markdown(self) -> str:
        lines = []
        if self.model:
            where = "the CPU" if self.device == "cpu" else f"the {self.device}"
            stand_in = f" {STAND_IN}" if self.simulated else ""
            lines += [f"Model {self.model}, on {where}.{stand_in}", ""]
        lines += [f"| workload | alone | together | {RATIO_HEADER} |", "|---|---|---|---|"]
        for name, alone, together, ratio in self.rows():
            lines.append(f"| {name} | {duration_text(alone)} | {duration_text(together)} | {ratio_words(ratio, 'x')} |")
        if self.generation:
            reasoning = self.generation.get("reasoning")  # (None: the template's default)
            setting = f", reasoning setting {reasoning}" if reasoning else ""
            lines += ["", f"Answers: {answers_asked(self.generation)}{setting}, at most "
                          f"{self.generation['max_new_tokens']} tokens each."]
        if self.device_fallback:
            lines += ["", self.device_fallback]
        if self.others_share:
            shares = self.others_share
            lines += ["", f"Other processes used {shares['indexing_alone']:.0%} of the CPUs' time while the indexing ran "
                          f"alone, {shares['inference_alone']:.0%} while the inference ran alone and "
                          f"{shares['together']:.0%} while both ran."]
        if self.threads_alone and self.threads_together:
            alone, together = self.threads_alone, self.threads_together
            moved = together["cpu_threads_changes"] - alone["cpu_threads_changes"]
            lines += ["", f"CPU expert kernels: {alone['cpu_threads_in_force']} of {alone['cores']} threads at the end "
                          f"of inference alone, {together['cpu_threads_in_force']} at the end of inference beside the "
                          f"indexing" + (f" (cpu_threads automatic: it moved {counted(moved, 'time')} meanwhile)."
                                         if together["cpu_threads_automatic"] else ".")]
        return "\n".join(lines) + "\n"


# the table's last column: a "slowdown" of 0.65x read as slower, where the workload ran faster together
RATIO_HEADER = "time together / alone"


def ratio_words(ratio: float, times: str = "×") -> str:
    """A row's time together over its time alone, with which way it went: '0.65× (faster)', '1.50× (slower)'."""
    figures = f"{ratio:.2f}"
    way = "" if figures == "1.00" else " (faster)" if ratio < 1 else " (slower)"
    return f"{figures}{times}{way}"


def answers_asked(generation: dict) -> str:
    """'greedy', or the sampling settings and seed, of a record's generation settings."""
    if not generation["do_sample"]:
        return "greedy"
    sampling = SamplingParams(True, generation["temperature"], generation["top_k"], generation["top_p"],
                              generation["repetition_penalty"], generation["seed"])
    return f"sampled ({describe(sampling)}), seed {sampling.seed}"


# the phases in the order run_contention runs them; its progress(fraction) comes as each one ends
PHASES = ("warming up: inference", "warming up: indexing", "indexing alone", "inference alone",
          "indexing and inference at once")


def phase_after(fraction: float) -> str:
    """The phase that runs once run_contention has reported `fraction` ('done' after the last)."""
    index = round(fraction * len(PHASES))
    return PHASES[index] if index < len(PHASES) else "done"


class ContentionCancelled(WorkbenchError):
    """The contention test was stopped between two of its phases."""


def run_contention(run_inference, corpus: Path, workers: int, progress=None,
                   cancel: threading.Event | None = None, threads=None,
                   generation: dict | None = None, device_fallback: str | None = None, model: str | None = None,
                   device: str | None = None, simulated: bool = False, scenario: str | None = None) -> ContentionReport:
    """`run_inference()` runs one inference workload and returns its completion time in seconds; `threads()`, where
    given, the CPU expert kernels' thread count (KernelThreads.state), read after each timed inference; `generation`,
    how its answers are asked for (schema.generation_settings), `device_fallback`, why the inference runs every
    expert on the CPU where its CUDA GPU could not be used, and the `model` folder and the `device` it runs on
    (`simulated`: the simulated GPU), and the `scenario` it runs, kept in the report.

    `cancel` is checked between the phases (a warm-up of each, indexing alone, inference alone, both): a set
    event raises ContentionCancelled there (`run_inference` may watch it too, between tokens)."""
    def check() -> None:
        if cancel is not None and cancel.is_set():
            raise ContentionCancelled("the contention test was cancelled")

    def phase_done(fraction: float) -> None:
        if progress:
            progress(fraction)
        check()

    check()
    # Warm-up, not timed: a first pass pays one-time costs the timed ones would not share (the corpus read into
    # the page cache; compiled kernels loaded, weights paged in, buffers sized by the first inference). Without
    # it, "inference alone", timed first, came out slower than inference beside the indexing on the dev VM.
    # The inference's first: a multiturn scenario whose answers overflow the context is refused there, before the
    # indexing's warm-up (minutes on the default corpus) has kept the user waiting for nothing.
    run_inference()
    phase_done(1 / len(PHASES))
    index_folder(corpus, workers)
    phase_done(2 / len(PHASES))
    meter = HostLoadMeter(children=True)
    documents, indexing_alone = index_folder(corpus, workers)
    others = {"indexing_alone": meter.read().others}
    phase_done(3 / len(PHASES))
    meter = HostLoadMeter(children=True)
    inference_alone = run_inference()
    others["inference_alone"] = meter.read().others
    threads_alone = threads() if threads else None
    phase_done(4 / len(PHASES))
    together: dict[str, float] = {}

    def indexing() -> None:
        together["indexing"] = index_folder(corpus, workers)[1]

    meter = HostLoadMeter(children=True)
    thread = threading.Thread(target=indexing, name="contention-indexing")
    thread.start()
    time.sleep(0.2)  # let the workers start so inference runs under load from its first token
    together["inference"] = run_inference()
    threads_together = threads() if threads else None
    thread.join()
    others["together"] = meter.read().others
    phase_done(1.0)
    return ContentionReport(workers, documents, indexing_alone, inference_alone,
                            together["indexing"], together["inference"], threads_alone, threads_together, others,
                            generation, device_fallback, model, device, simulated, scenario)
