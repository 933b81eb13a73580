"""Run one decoder step: dense segments in onnxruntime, expert nodes in our engine.

`PartitionedDecoder` is the product; `OrtReferenceDecoder` runs the same model as one unmodified
onnxruntime session and serves as the oracle in tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import onnxruntime as ort
from onnx import helper

from engine.collection_hold import collection_held
from engine.decoder_state import DecoderState
from engine.dense_segment import DEVICE_ONNX_TYPES, DenseSegment, SegmentBindings, run_bound
from engine.errors import PromptError, WorkbenchError
from engine.expert_node import CpuExpertNode, ExpertNodeInfo
from engine.kernel_threads import KernelThreads
from engine.onnx_file import OnnxFile
from engine.offload import host_part_worker as worker_module
from engine.ort_env import CPU_DENSE, DenseDevice, dense_step_lock, session_options
from kernels.cpu.omp_pool import release_pool
from engine.partition import ExpertStep, Plan


# A "both" layer's host part left until the next layer is launched (PartitionedDecoder._run_steps; bench_offload_ab's
# dense.ahead=1). Off: on the H200 it showed no gain (0.87-0.94x in 16-layer A/Bs whose noise is about as wide,
# RESULTS.md fortieth session): the host's launches of the next layer (~77 µs a layer) outlast the GPU's merge, dense
# segment and routing (~50 µs) that they would hide behind, and the host's gap, measured longer, gives the CPU fewer
# cold pairs. The host-part worker (below), where it runs, takes its place.
launch_ahead = False

# A "both" layer's host part done by a worker thread in compiled code (engine/offload/host_part_worker.py) beside the
# engine's Python for the next layers, which the GPU orders behind the layer's gate (bench_offload_ab's
# dense.worker=0 turns it off). On the H200: 1.18x / 1.19x a Qwen3-30B-A3B-like decode at 0 / 25% resident (16-layer
# A/B, 9 rounds), gpt-oss-20b-like 54 / 39 / 49% -> 65 / 65 / 59% of the bound (RESULTS.md forty-first session).
# Where this machine cannot run it (host_part_worker.supported) or the dense part is not on the GPU, the decoder goes
# on without.
host_part_worker = True


class PartitionedDecoder:
    """Alternates dense segments and expert nodes; only the cut tensors flow between them."""

    vocabulary: int | None = None  # the token ids the model takes (None: unchecked)

    def __init__(self, source: OnnxFile, plan: Plan, experts: list[ExpertNodeInfo], logits_name: str,
                 threads: int | None = None, progress=None, dense: DenseDevice | None = CPU_DENSE,
                 vocabulary: int | None = None):
        """`dense=None` builds the expert runners only; open_dense() then creates the dense sessions
        (LoadedModel does so once the offload plan has taken its share of the GPU). `vocabulary`: the token ids the
        model takes (ModelFolder.vocabulary), a token past them refused before it reaches the embedding."""
        self.plan = plan
        self.logits_name = logits_name
        self.vocabulary = vocabulary
        self.source = source
        self.dense: DenseDevice | None = None
        by_name = {info.name: info for info in experts}
        self.steps: list = []  # DenseSegment, or an expert runner (CpuExpertNode, HybridExpertNode)
        self.on_step_end = None  # called after every step with its seconds and tokens: the safe point for placement
        # called before the step's last dense segment, whose run waits for the logits (the offload engine's accounts
        # taken while the GPU finishes the layers: OffloadEngine.settle_all_but)
        self.before_last_segment = None
        self.profile = {"steps": 0, "dense_s": 0.0, "experts_s": 0.0, "total_s": 0.0}  # where step time goes
        self.steps_run_again = 0  # steps run a second time after a late gate (_run_steps)
        self.layers_ahead = 0  # "both" layers whose host part ran with the next layer's work queued behind (_run_steps)
        self.layers_beside = 0  # "both" layers whose host part the worker did (_run_steps_beside)
        self._worker = None  # the host-part worker, made on first use (_host_part_worker)
        # whether this thread may hold an OpenMP pool (a CPU kernel ran here since it was last given back:
        # _run_steps_beside gives it back where the worker takes over, _hand_pool_over and _give_pool_back)
        self._pool_here = True
        self._worker_took = False  # whether the last step handed a layer's CPU part to the worker
        self._layers_done = None  # an event on the dense stream after the step's last layer (_mark_layers_done)
        self._expert_input_types: dict[str, int] = {}  # each expert node's activations' ONNX type (open_dense)
        self._progress, self._built = progress, 0
        for step in plan.steps:
            if isinstance(step, ExpertStep):
                self.steps.append(CpuExpertNode(by_name[step.node.name], source, threads))
                self._advance_progress()
            else:
                segment = DenseSegment(step, source)
                # every cut tensor but the logits is read within the step only: its buffer can be reused
                segment.bindings.fresh = {logits_name}
                self.steps.append(segment)
        # `threads`, or (None) automatic: every core less those other processes keep busy, moved at each step's end
        self.kernel_threads = KernelThreads([runner for runner in self.steps if isinstance(runner, CpuExpertNode)],
                                            threads or 0)
        if dense is not None:
            self.open_dense(dense)

    def _advance_progress(self) -> None:
        self._built += 1
        if self._progress:
            self._progress(self._built / len(self.plan.steps))

    def open_dense(self, dense: DenseDevice) -> None:
        """Create every dense segment's session on `dense`, in graph order (each segment's input
        types come from the sessions before it)."""
        types = {i.name: i.type.tensor_type.elem_type for i in self.source.proto.graph.input}
        for runner in self.steps:
            if isinstance(runner, DenseSegment):
                runner.open(types, dense)
                types.update(runner.output_types)
                self._advance_progress()
            else:
                info = runner.info
                types[info.output] = self._expert_input_types[info.name] = types[info.activation_inputs["input"]]
        self.dense = dense
        self.place_cut_tensors()

    def place_cut_tensors(self) -> None:
        """With the dense part on the GPU, leave in GPU memory every cut tensor whose readers all take device
        arrays there: later dense segments, and expert nodes that say so (HybridExpertNode with a CUDA store, which
        keeps a fully resident layer's routing and result on the device). Then a fully resident layer costs no copy
        to the host and no wait. The logits, which the caller reads, all but float tensors (DEVICE_ONNX_TYPES) and
        tensors a later segment reads in host memory (DenseSegment.host_inputs) stay on the host; so does everything
        with the dense part on the CPU."""
        on_gpu = self.dense is not None and self.dense.kind == "cuda"
        for position, runner in enumerate(self.steps):
            if not isinstance(runner, DenseSegment):
                continue
            names = set()
            for name in runner.segment.outputs if on_gpu else ():
                readers = [later for later in self.steps[position + 1:] if name in _inputs_of(later)]
                if (readers and name != self.logits_name and runner.output_types.get(name) in DEVICE_ONNX_TYPES
                        and all(name not in r.host_inputs if isinstance(r, DenseSegment)
                                else getattr(r, "takes_device_arrays", False) for r in readers)):
                    names.add(name)
            runner.bindings.on_device = frozenset(names)
            runner.bindings.clear()
            runner.decode_bindings = self._decode_bindings(runner) if on_gpu else None

    def _decode_bindings(self, runner: DenseSegment) -> SegmentBindings | None:
        """For the step's last segment on the GPU, where it makes the logits: decode steps' bindings that leave them in
        GPU memory as well. Its run (the LM head, a large read: 0.2-0.4 ms at the goal shapes on the H100) is then
        a replay the host does not wait for, and the step's end (the engine's accounts, placement's swaps) is taken
        while it runs; forward() copies the logits out last. A prompt's logits (tokens x vocabulary) still go straight
        to the host: kept on the device they would be copied there once more."""
        if (runner is not self._last_dense_segment() or runner.segment.on_host
                or runner.output_types.get(self.logits_name) not in DEVICE_ONNX_TYPES):
            return None
        bindings = SegmentBindings()
        bindings.fresh, bindings.total_lengths = runner.bindings.fresh, runner.bindings.total_lengths
        bindings.on_device = runner.bindings.on_device | {self.logits_name}
        return bindings

    @property
    def keeps_cut_tensors_on_device(self) -> bool:
        """Whether place_cut_tensors left any cut tensor in GPU memory."""
        return any(runner.bindings.on_device for runner in self.steps if isinstance(runner, DenseSegment))

    @property
    def state_backend(self):
        """Where a conversation's state buffers must live for these sessions (None: NumPy)."""
        return self.dense.backend if self.dense is not None else None

    def forward(self, state: DecoderState, token_ids) -> np.ndarray:
        """Logits [tokens, vocab] for the new tokens; the state advances past them."""
        started = time.perf_counter()
        self._check_tokens(token_ids)
        # a data file cut short or written to in place since the last step (the folder rewritten during an answer):
        # the step's kernels read its mapping, and a read past its new end kills the process (SIGBUS), while new bytes
        # would be other weights than the loaded model's; refused by name before any
        self.source.check_mapped_files()
        if self.dense is not None and state.backend.device_type != ("cuda" if self.dense.kind == "cuda" else "cpu"):
            raise WorkbenchError(f"the conversation's state is on the {state.backend.device_type} but the dense part "
                                 f"runs on the {self.dense.kind} (make the state with LoadedModel.new_state)")
        values: dict[str, np.ndarray] = state.step_inputs(token_ids)
        on_gpu = self.dense is not None and self.dense.kind == "cuda"
        decode = len(token_ids) == 1
        # the collection held off (collection_hold.py): a finalizer's device sync would wait for a gated merge
        with collection_held(), dense_step_lock(self.dense.device_id) if on_gpu else contextlib.nullcontext():
            worker = self._host_part_worker() if host_part_worker and on_gpu else None
            if worker is not None:
                worker.set_threads(worker_module.worker_threads(self.kernel_threads.in_force))  # automatic: it moves
                dense, experts, late = self._run_steps_beside(values, state, worker, decode)
            else:
                dense, experts, late = self._run_steps(values, state, launch_ahead, decode)
            if late:
                # a layer's gate was raised after its merge may have stopped waiting, with later layers queued behind
                # it: the step again (the state advances after it), each layer's host part done before the next
                # layer is launched. A step's KV is written in place at its positions and a swapped state's present
                # buffer whole, so running it twice changes nothing.
                values = state.step_inputs(token_ids)
                dense, experts, _ = self._run_steps(values, state, False, decode)
                self.steps_run_again += 1
        state.advance(len(token_ids))
        # (with the logits left on the device, the LM head still runs: every layer's work is done)
        if self.on_step_end is not None:
            self.on_step_end(time.perf_counter() - started, len(token_ids))
        self.kernel_threads.step_ended()
        logits = values[self.logits_name]
        last = self._last_dense_segment()
        if decode and last is not None and last.decode_bindings is not None:  # left on the GPU (_decode_bindings)
            logits = state.backend.copy_out(logits)
        profile = self.profile
        profile["steps"] += 1
        profile["dense_s"] += dense
        profile["experts_s"] += experts
        profile["total_s"] += time.perf_counter() - started
        return logits.reshape(len(token_ids), -1)

    def _check_tokens(self, token_ids) -> None:
        """A PromptError naming tokenizer.json where a prompt's token is past the model's vocabulary (a tokenizer
        with tokens added): onnxruntime's embedding Gather would fail naming neither the token nor the file."""
        if self.vocabulary is None or len(token_ids) == 0 or max(token_ids) < self.vocabulary:
            return
        token = next(int(token) for token in token_ids if token >= self.vocabulary)
        raise PromptError(f"{self.source.folder / 'tokenizer.json'}: the prompt holds token {token}, past the "
                          f"model's vocabulary of {self.vocabulary} tokens in {self.source.path.name}: the tokenizer "
                          "has tokens the model was not made with")

    def _run_steps(self, values: dict, state: DecoderState, ahead: bool,
                   decode: bool = False) -> tuple[float, float, bool]:
        """Every runner in order on `values` (updated in place); returns the seconds of (dense segments, experts) and
        whether the step must run again: a layer launched ahead raised its gate late (SplitStep.late), or a finished
        layer's merge gave up waiting for its gate (SplitStep.gave_up, read at the end).

        `ahead`: a "both" layer's host part (SplitStep.finish: the CPU's share, then the gate) waits until the next
        dense segment's replay and the next "both" layer are launched, queued behind its gated merge. The GPU then
        goes from the gate to the next layer's routing without waiting for the host's launches. Anything else (an
        onnxruntime run, another kind of layer) finishes the waiting layer first: it may wait for the GPU.

        `decode`: a one-token step, whose last segment may leave the logits on the device (_decode_bindings); this
        returns once every layer's work is done, the LM head's perhaps not."""
        dense = experts = 0.0
        late = False
        self._pool_here = True  # (its CPU kernels run on this thread)
        self._worker_took = False
        clock = time.perf_counter
        before = clock()
        waiting = launched = None  # a layer whose host part is left until the next one is launched, and that one
        behind = False  # whether work is queued behind the waiting layer's merge
        finished = []  # the "both" layers finished on this thread, whose merges may have waited for their gates
        last_dense = self._last_dense_segment()
        try:
            for runner in self.steps:  # one clock reading per runner: its end is the next one's start
                if isinstance(runner, DenseSegment):
                    if runner is last_dense and waiting is None and self.before_last_segment is not None:
                        self.before_last_segment()
                    last = decode and runner is last_dense
                    if last:
                        self._mark_layers_done(runner, state)
                    results = runner.run_again(values, state, last) if waiting is not None else None
                    if results is None:
                        late |= self._finish(waiting, behind, finished)
                        waiting = None
                        results = runner.run(values, state, last)
                    behind = waiting is not None
                    values.update(results)
                    now = clock()
                    dense += now - before
                else:
                    launched = runner.launch_ahead(values) if ahead and hasattr(runner, "launch_ahead") else None
                    late |= self._finish(waiting, behind or launched is not None, finished)
                    waiting, behind = None, False
                    result = None if launched is None else launched.result_ahead
                    if launched is None:
                        values[runner.info.output] = runner.run(values)
                        if getattr(runner, "last_split", None) is not None:  # a "both" step, finished in run()
                            finished.append(runner.last_split)
                    elif result is not None:
                        values[runner.info.output], waiting = result, launched
                    else:  # its merge is queued by its host part: nothing may be launched behind it
                        values[runner.info.output] = launched.finish(queued=True)
                    launched = None
                    now = clock()
                    experts += now - before
                before = now
            late |= self._finish(waiting, behind, finished)
            self._wait_layers_done()
            # The gates' lateness above is judged on the host's clock. The device's own word says whether a merge
            # gave up; read now, with every merge run, it catches what that judgement missed (a GPU test's step came
            # out wrong once, the cause not found: RESULTS.md, forty-eighth session)
            late |= any(step.gave_up for step in finished)
        except BaseException:
            for step in (waiting, launched):  # launched, not finished: the GPU is let go past their gates
                if step is not None:
                    step.abandon()
            raise
        return dense, experts, late

    def _run_steps_beside(self, values: dict, state: DecoderState, worker,
                          decode: bool = False) -> tuple[float, float, bool]:
        """_run_steps with each "both" layer's host part handed to the worker (its merge waits on the GPU for the
        worker's gate, so the next dense segment and layer are launched at once); returns as _run_steps, `late` where
        a gated merge gave up waiting for the worker or for this thread. A layer the worker cannot take, or that does
        not split, runs here once the worker's jobs are done (its CPU kernels would otherwise share the cores with the
        worker's)."""
        dense = experts = 0.0
        clock = time.perf_counter
        before = clock()
        taken = []
        here = []  # the "both" layers finished on this thread (the worker could not take them)
        ran_here = False  # whether a layer ran on this thread (its CPU kernels: this thread's OpenMP pool)
        step = None  # a layer launched and neither taken nor finished yet
        last_dense = self._last_dense_segment()
        try:
            for runner in self.steps:
                if isinstance(runner, DenseSegment):
                    if runner is last_dense:
                        # The host launches layers far ahead of the worker (16-19 of 24 on the H100 machine) and
                        # then waits in the last segment's run for the logits: the jobs done meanwhile, collected
                        # after it, left their accounts to the step's end, where the GPU idles (~30 µs each). They
                        # are taken here instead, while the worker computes the last layers.
                        if taken:
                            worker.drain(lambda: self._collect_and_settle(worker, taken), leave=1)
                            self._collect(worker)
                        if self.before_last_segment is not None:
                            self.before_last_segment()
                        if decode:
                            self._mark_layers_done(runner, state)
                    values.update(runner.run(values, state, decode and runner is last_dense))
                    now = clock()
                    dense += now - before
                else:
                    step = runner.launch_ahead(values) if hasattr(runner, "launch_ahead") else None
                    result = None if step is None else step.result_ahead
                    if result is not None and worker.take(step):
                        if not taken:
                            self._hand_pool_over()
                        values[runner.info.output] = result
                        taken.append(step)
                        self._collect(worker)
                    else:  # as _run_steps without launch ahead, once the worker's jobs are done
                        ran_here = True
                        worker.drain()
                        self._collect(worker)
                        values[runner.info.output] = runner.run(values) if step is None else step.finish_alone()
                        step = step or getattr(runner, "last_split", None)  # a "both" step, finished here
                        if step is not None:
                            here.append(step)
                    step = None
                    if taken:
                        taken[-1].node.engine.settle()  # earlier layers' accounts, whose launches are done
                    now = clock()
                    experts += now - before
                before = now
            worker.drain()
            self._collect(worker)
            self._wait_layers_done()
        except BaseException:
            worker.cancel()
            if step is not None:
                step.abandon()
            raise
        self.layers_beside += len(taken)
        self._worker_took = bool(taken)
        self._give_pool_back(ran_here)
        # (every merge has run: _wait_layers_done)
        return dense, experts, any(step.gave_up for step in taken + here)

    def _hand_pool_over(self) -> None:
        """A step's first layer handed to the worker where the step before handed it none (a switch to "both", a
        shape's first ungated launches, a prompt whose CPU experts ran here): this thread's OpenMP pool, whose threads
        still spin after its last region (GOMP_SPINCOUNT: ~0.2 s), is given back at once, not after the step, which it
        would slow throughout. (The slow steps after a switch, 131.8 ms against ~11, were its suspect; they stayed, at
        164 and 203 ms: RESULTS.md, forty-fourth session.) Where the step before handed the worker layers too, this
        thread's pool, if any, is one some layer keeps using."""
        if self._pool_here and not self._worker_took:
            release_pool()
            self._pool_here = False

    def _give_pool_back(self, ran_here: bool) -> None:
        """After a step beside the worker: where no layer ran here, this thread's OpenMP pool given back (its threads
        beside the worker's would throttle both: kernels/cpu/omp_pool.py); a step that ran one keeps it, as the next
        may too (a pool made again at every step costs its threads' start)."""
        if ran_here:
            self._pool_here = True
        elif self._pool_here:
            release_pool()
            self._pool_here = False

    def _mark_layers_done(self, last: DenseSegment, state: DecoderState) -> None:
        """Before the step's last segment, where its run leaves the logits on the device: an event on onnxruntime's
        stream (the state's), which every layer's result reached before this segment reads it."""
        if last.decode_bindings is not None:
            self._layers_done = state.backend.mark()

    def _wait_layers_done(self) -> None:
        """Until every layer's work is done on the GPU (the merges' words may then be read, the accounts taken and
        placement's copies made: they write no buffer the LM head reads); a step whose last run waited for its
        logits has no event to wait for."""
        if self._layers_done is not None:
            self._layers_done.synchronize()
            self._layers_done = None

    @staticmethod
    def _collect(worker) -> None:
        for job in worker.collect():
            job.step.node.host_part_done(job)

    def _last_dense_segment(self) -> DenseSegment | None:
        return next((runner for runner in reversed(self.steps) if isinstance(runner, DenseSegment)), None)

    def _collect_and_settle(self, worker, taken: list) -> None:
        """While the step's last jobs run: the jobs done so far collected, and an account whose device work is done
        taken (OffloadEngine.settle: oldest first)."""
        self._collect(worker)
        taken[-1].node.engine.settle(1)

    def _host_part_worker(self):
        """The host-part worker, made on first use where the model has "both"-capable layers and this machine runs
        the compiled loop; None otherwise."""
        if getattr(self, "_worker", None) is None and worker_module.supported():
            nodes = [runner for runner in self.steps if hasattr(runner, "launch_ahead")]
            if nodes:
                self._worker = worker_module.HostPartWorker(
                    worker_module.worker_threads(getattr(nodes[0].kernel, "num_threads", None)))
        return getattr(self, "_worker", None)

    def warm_host_part_loop(self) -> float:
        """The host-part worker's compiled loop made ready (compiled, or loaded from Numba's cache) for each kind of
        layer that may hand it a "both" step (host_part_loops); returns the seconds it took. Called by the offload
        benchmarks (kernel_warmup.warm_model compiles the same loops on a thread of its own), so that the first "both"
        step does not wait for it: its gates would come after the merges gave up and the step would run again."""
        loops = self.host_part_loops()
        if not loops:
            return 0.0
        started = time.perf_counter()
        for kernel, x_dtype in loops:
            worker_module.compile_loop(kernel, x_dtype)
        return time.perf_counter() - started

    def host_part_loops(self) -> list:
        """(CPU kernel, activations' NumPy dtype) of each kind of layer that may hand the host-part worker a "both"
        step, where the dense part is on the GPU and this machine runs the worker's loop; none otherwise."""
        if not (host_part_worker and self.dense is not None and self.dense.kind == "cuda"
                and worker_module.supported()):
            return []
        loops = {}
        for runner in self.steps:
            onnx_type = self._expert_input_types.get(runner.info.name) if hasattr(runner, "launch_ahead") else None
            if onnx_type is not None:
                kind = (getattr(runner.kernel, "compiled_for", id(runner.kernel)), onnx_type)
                loops.setdefault(kind, (runner.kernel, helper.tensor_dtype_to_np_dtype(onnx_type)))
        return list(loops.values())

    def _finish(self, step, behind: bool, finished: list) -> bool:
        """A layer whose host part was left (SplitStep), or None: that part done, with work queued behind its merge
        (`behind`) or not, and the step added to `finished`; whether its gate was raised late with work behind it."""
        if step is None:
            return False
        step.finish(ahead=behind, queued=True)
        finished.append(step)
        self.layers_ahead += behind
        return behind and step.late


def _inputs_of(runner) -> list[str]:
    if isinstance(runner, DenseSegment):
        return runner.segment.inputs
    return list(runner.info.activation_inputs.values())


class OrtReferenceDecoder:
    """The whole model, experts included, in one onnxruntime session fed the same way."""

    def __init__(self, source: OnnxFile, logits_name: str):
        self.logits_name = logits_name
        self.session = ort.InferenceSession(
            str(source.path), session_options(), providers=["CPUExecutionProvider"])

    def forward(self, state: DecoderState, token_ids) -> np.ndarray:
        if state.backend.device_type != "cpu":
            raise WorkbenchError("the onnxruntime reference runs on the CPU: give it a state in host memory")
        values = state.step_inputs(token_ids)
        inputs = [i.name for i in self.session.get_inputs()]
        outputs = [o.name for o in self.session.get_outputs()]
        logits = run_bound(self.session, inputs, outputs, values, state)[self.logits_name]
        state.advance(len(token_ids))
        return logits.reshape(len(token_ids), -1)
