"""Under the decode path "both": trials of the CPU's share of the cold pairs around the split's table (issue #4).

The table (kernels/cold_split.py: cpu_take_table) models a layer as the later of the CPU's part (the host's gap, the
call's fixed cost, its experts) and the GPU's reads from the tier. What it leaves out moved the best share on the H200
machine: the GPU's merge, the next dense segment and the next routing lie in series with whichever side finishes
last, and the CPU kernel beside the GPU's reads is not the CPU kernel alone. At Qwen3-30B-A3B-like 0% the table gave the
CPU 4 of 8 cold pairs a token at 21.1 ms a step where 3 ran at 18.0-19.0 ms (thirty-seventh session,
diag_path_trials.py), on a host where another hold had run the 4 at 16.9 ms, and where a third hold's trial kept the
table as made (19.96 ms a step against 20.10 with one fewer). So the steps decide: A-B-A trials (trials.py) of the table
as made, the CPU taking one pair fewer for every count of cold pairs, and one more, the table's own share in force
first and winning ties. The shift holds until the next trial; the table is made again from the rates meanwhile.

Where the GPU's decode kernels can split a pair by its rows (kernels/cold_split.py: split_tables), trials of their own
decide whether they do: the split's table prices each side's rows, and what it leaves out moved the answer between
models on one H100 host, where gpt-oss-20B-like at 0% resident ran 1.10x faster with the split and Qwen3-30B-A3B-like at
0% 1.14x slower, each against whole pairs from the same measured costs (bench_offload_ab, RESULTS.md sixty-seventh
session). Whole pairs are preferred; the split is kept where its steps run faster by the trials' margin. The two
trials take turns (OffloadEngine.end_step): neither times steps that the other's switch moves.
"""

from __future__ import annotations

import numpy as np

from engine.offload.trials import AbaTrials

AS_MADE, FEWER, MORE = "as made", "one fewer", "one more"
SHIFTS = {AS_MADE: 0, FEWER: -1, MORE: 1}
# each way in words (the placement view's sentence), and a shift chosen by its way's words
SHARE_WORDS = {AS_MADE: "the share the rates give", FEWER: "one pair fewer", MORE: "one pair more"}
SHIFT_WORDS = {SHIFTS[way]: SHARE_WORDS[way] for way in (FEWER, MORE)}


class SplitShareTrials(AbaTrials):
    """The table as made against one pair fewer and one more on the CPU; `shift` is the one in force."""

    def __init__(self, **settings):
        super().__init__(AS_MADE, FEWER, MORE, **settings)

    @property
    def shift(self) -> int:
        return SHIFTS[self.choice]


WHOLE_PAIRS, SPLIT_ROWS = "whole pairs", "a pair split by rows"


class RowSplitTrials(AbaTrials):
    """Whole pairs against a pair split by rows; `splits` says whether the split is in force."""

    def __init__(self, **settings):
        super().__init__(WHOLE_PAIRS, SPLIT_ROWS, **settings)

    @property
    def splits(self) -> bool:
        return self.choice == SPLIT_ROWS


def shifted(table: np.ndarray, shift: int) -> np.ndarray:
    """cpu_take with `shift` more pairs for the CPU at every count of cold pairs c (int32 [k + 1]), kept within 0..c."""
    if shift == 0:
        return table
    return np.clip(table + shift, 0, np.arange(table.size)).astype(np.int32)
