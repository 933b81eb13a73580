"""Run records as a user compares them: the answer settings and lengths they keep, the history file's own schema
version, and the columns its exports carry."""

from __future__ import annotations

import html
import json
import re

import pytest

from app.gui.record_report import compare_html, detail_html
from engine.generation import GenerationParams, LoadedModel
from engine.records.scenarios import run_scenario
from engine.records.schema import RunRecord
from engine.sampling import SamplingParams
from tests.conftest import fixture_folder

SAMPLED = GenerationParams(max_new_tokens=5, stop_strings=("zzz",), sampling=SamplingParams(
    do_sample=True, temperature=0.7, top_k=5, top_p=0.9, seed=3))


@pytest.fixture(scope="module")
def model():
    return LoadedModel.open(fixture_folder("gptoss"))


@pytest.fixture(scope="module")
def sampled(model):
    return run_scenario(model, "short", SAMPLED, label="sampled")


@pytest.fixture(scope="module")
def greedy(model):
    return run_scenario(model, "short", GenerationParams(max_new_tokens=3), label="greedy")


def plain(html_text: str) -> str:
    return html.unescape(re.sub(r"\s+", " ", re.sub("<[^>]+>", " ", html_text)))


def older(record: RunRecord) -> RunRecord:
    """As a record written before the answer settings were kept reads."""
    return RunRecord.from_dict({k: v for k, v in record.to_dict().items() if k != "generation"})


def test_a_record_keeps_how_its_answers_were_asked_for_and_how_long_they_were(sampled, greedy):
    assert sampled.generation == {"max_new_tokens": 5, "do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9,
                                  "repetition_penalty": 1.0, "seed": 3, "stop_strings": ["zzz"], "reasoning": None}
    assert RunRecord.from_dict(json.loads(json.dumps(sampled.to_dict()))) == sampled
    assert 1 <= sampled.generated_tokens <= 5 and greedy.generated_tokens == 3
    detail = plain(detail_html(sampled))
    assert " answer length limit 5 tokens an answer " in detail
    assert " sampling temperature 0.7, top-k 5, top-p 0.9, seed 3 " in detail
    assert " stop texts zzz " in detail and " reasoning setting the template's default " in detail
    assert " sampling greedy " in plain(detail_html(greedy))


def test_a_record_older_than_the_answer_settings_reads_and_says_they_are_not_recorded(sampled):
    old = older(sampled)
    assert old.generation == {}
    detail = plain(detail_html(old))
    assert " answer length limit not recorded " in detail and " sampling not recorded " in detail
    text = plain(compare_html(old, sampled))
    assert ("Not recorded in run A (a record older than them): answer length limit, sampling, stop texts, reasoning "
            "setting; whether the two runs asked for the same answers cannot be told.") in text
    assert "Not recorded in runs A and B" in plain(compare_html(old, old))
    assert "Not recorded" not in plain(compare_html(sampled, sampled))


def test_a_comparison_says_when_two_runs_asked_for_other_answers(sampled, greedy):
    text = plain(compare_html(greedy, sampled))
    assert "these runs differ in answer length limit, sampling, stop texts, tokens generated," in text
    assert " answer length limit 3 tokens an answer 5 tokens an answer " in text
    assert " sampling greedy temperature 0.7, top-k 5, top-p 0.9, seed 3 " in text
    assert f" tokens generated 3 {sampled.generated_tokens} " in text
    assert "Not like for like" not in plain(compare_html(sampled, sampled))


def test_record_says_how_many_tokens_its_answers_generated(tmp_path, capsys):
    from app.cli import main

    assert main(["record", str(fixture_folder("gptoss")), "--max-new-tokens", "4",
                 "--history", str(tmp_path / "h.sqlite3")]) == 0
    assert re.search(r"^short: run 1: 4 tokens generated \(at most 4 an answer\), load ", capsys.readouterr().out, re.M)
