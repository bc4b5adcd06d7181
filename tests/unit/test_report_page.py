"""The report page of a results folder as the jobs write it: every job's image, the fill-mask
table with the masked word and whether the model got it (tests/e2e/test_report.py opens such
a page in Chromium at 1280 pixels)."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from imgpipe.recipes.report import write_report
from tests.report_layout import DIGEST, IMAGE, JOBS, jobs_results


class _Tables(HTMLParser):
    """Each <table class=...>'s rows, as lists of cell texts."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self._table: str | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self._table = dict(attrs).get("class") or ""
            self.tables[self._table] = []
        elif tag == "tr" and self._table is not None:
            self.tables[self._table].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._table is not None:
            self.tables[self._table][-1].append("".join(self._cell))
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    """The results folder, and the report written for it as it is (what write_report
    returned, the page), once for the tests that only read them."""
    results = jobs_results(tmp_path_factory.mktemp("report"))
    made = write_report(results)
    return results, made, Path(made["report"]).read_text()


def test_each_job_script_records_its_image_where_the_report_reads_it(
        written: tuple[Path, dict, str]) -> None:
    results, made, page = written
    for _, name, job_id, _ in JOBS:
        record = json.loads((results / f"{name}-{job_id}" / "ran_in.json").read_text())
        assert record == {"job": name, "id": job_id, "image": IMAGE, "image_digest": DIGEST,
                          "profile": {"name": "local", "busbw_gbs": 0.05, "gpus_per_node": 2}}
    parser = _Tables()
    parser.feed(page)
    jobs = parser.tables["jobs"]
    assert jobs[0] == ["job", "id", "state", "nodes", "elapsed", "runtime", "ran in"]
    assert {row[5] for row in jobs[1:]} == {"pyxis"}  # the runtime each job ran under
    assert [(row[0], row[-1]) for row in jobs[1:]] == [(label, DIGEST) for *_, label in JOBS]
    assert made["summary"]["ran_in"] == {f"{name}-{job_id}": DIGEST
                                         for _, name, job_id, _ in JOBS}


def test_the_fill_mask_table_says_what_was_masked_and_whether_the_model_got_it(
        written: tuple[Path, dict, str]) -> None:
    _, made, page = written
    parser = _Tables()
    parser.feed(page)
    table = parser.tables["fill-mask"]
    assert table[0] == ["sentence", "masked word", "top predictions", "got it"]
    assert [(row[1], row[3]) for row in table[1:]] == [
        ("license", "yes"), ("warranty", "2nd of 2"), ("person", "no (not in the top 2)")]
    assert made["summary"]["fill_mask"] == {"sentences": 3, "first": 1, "in_top": 2}


def test_a_job_that_ran_in_another_image_is_named(tmp_path: Path) -> None:
    results = jobs_results(tmp_path)
    older = "sha256:" + "1" * 64
    log = results / "bert-pretrain-102" / "bert_phase1.jsonl"
    log.write_text(log.read_text().replace(DIGEST, older))
    (results / "bert-dataset-101" / "ran_in.json").write_text(json.dumps(
        {"job": "bert-dataset", "id": "101", "image": "x", "image_digest": older}))
    page = Path(write_report(results)["report"]).read_text()
    # the trainer's job is flagged (its curves are that image's); the dataset's shows its image
    assert page.count("image-mismatch") == 1 and "bert-pretrain-102 ran in " + older in page
    parser = _Tables()
    parser.feed(page)
    assert parser.tables["jobs"][1][-1] == older


def test_nccl_is_judged_by_the_profile_its_job_was_rendered_for(
        written: tuple[Path, dict, str], tmp_path: Path) -> None:
    """The NCCL job records its profile; the report judges by it and says so first, unless
    asked for another (an H100 fabric is never judged by the sandbox's 0.05 GB/s unasked)."""
    results, made, _ = written
    recorded = made["summary"]["nccl"]
    assert recorded["judged_against"] == ("judged against profile local (0.05 GB/s expected), "
                                          "as the NCCL job recorded it (recipes render "
                                          "--profile)")
    asked = write_report(results, tmp_path / "asked",
                         profile=("dgx-h100", 360.0))["summary"]["nccl"]
    assert asked["verdict"] == "FAIL" and asked["expected_busbw_gbs"] == 360.0
    assert asked["judged_against"].startswith("judged against profile dgx-h100 (360 GB/s")
    page = Path(write_report(results, tmp_path / "again")["report"]).read_text()
    assert "judged against profile local" in page
