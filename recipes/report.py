"""What a BERT workflow's results folder says, as plots and one self-contained HTML page.

Reads what the rendered recipes leave in RESULTSDIR: the trainer's JSON log of every job
(``<job>-<id>/bert_phase{1,2}.jsonl``), the image every job ran in (``<job>-<id>/ran_in.json``,
which run.sub, dataset.sub and nccl.sub write; the trainer's log says it too), the NCCL
check's logs (``nccl-<id>.log``), and, when a driver such as ``./setup.sh demo`` wrote one,
``workflow.json`` (the jobs' states and times, the pinned image digests and squashfs).
Writes ``RESULTSDIR/report/``: ``loss.png``, ``mlm_accuracy.png``, ``throughput.png``,
``nccl_busbw.png`` and ``index.html`` with the plots inlined (one file to mail or open
anywhere), laid out to fit a 1280-pixel-wide window.
"""

from __future__ import annotations

import base64
import contextlib
import html
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imgpipe.base.files import atomic_path
from imgpipe.recipes.errors import RecipeError
from imgpipe.recipes.nccl import Run, check, parse, verdict_line

WORKFLOW_FILE = "workflow.json"


class ReportError(RecipeError):
    """The results folder holds nothing to report."""

    code = "report"


FILL_MASK_FILE = "fill_mask.json"
EXPORT_METADATA = "imgpipe_export.json"
RAN_IN_FILE = "ran_in.json"  # recipes/render.py RECORD_IMAGE writes it


@dataclass
class Results:
    steps: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # phase -> events
    nccl: list[tuple[Path, Run]] = field(default_factory=list)
    workflow: dict[str, Any] = field(default_factory=dict)
    # job folder (<name>-<id>) -> the image it ran in (its ran_in.json, or its trainer's log)
    ran_in: dict[str, str] = field(default_factory=dict)
    trained: set[str] = field(default_factory=set)  # job folders holding a trainer's log
    # job folder -> the profile it was rendered for ({"name", "busbw_gbs"}: its ran_in.json)
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)
    exports: list[tuple[Path, dict[str, Any]]] = field(default_factory=list)
    fill_mask: list[dict[str, Any]] = field(default_factory=list)


def read_results(folder: Path) -> Results:
    if not folder.is_dir():
        raise ReportError(f"results folder {folder} does not exist",
                          hint="give the RESULTSDIR the recipes wrote to")
    found = Results()
    for path in sorted(folder.glob(f"*/{RAN_IN_FILE}")):
        with contextlib.suppress(ValueError, OSError, AttributeError):
            record = json.loads(path.read_text())
            image = record.get("image_digest") or record.get("image")
            if image:
                found.ran_in[path.parent.name] = str(image)
            profile = record.get("profile")
            if isinstance(profile, dict) and isinstance(profile.get("busbw_gbs"), int | float):
                found.profiles[path.parent.name] = profile
    for phase in (1, 2):
        by_step: dict[int, dict[str, Any]] = {}
        for path in sorted(folder.glob(f"*/bert_phase{phase}.jsonl")):
            for line in path.read_text(errors="replace").splitlines():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict) and event.get("event") == "step":
                    by_step[int(event["step"])] = event  # a requeued job repeats steps
                elif isinstance(event, dict) and event.get("event") == "start":
                    found.trained.add(path.parent.name)
                    found.ran_in[path.parent.name] = str(event.get("image_digest")
                                                         or event.get("image")
                                                         or found.ran_in.get(path.parent.name)
                                                         or "not recorded")
        if by_step:
            found.steps[phase] = [by_step[s] for s in sorted(by_step)]
    for path in sorted(folder.glob("nccl-*.log")):
        runs = [r for r in parse(path.read_text(errors="replace")) if r.rows]
        if runs:
            found.nccl.append((path, runs[-1]))
    for meta in sorted(folder.glob(f"*/export-*/{EXPORT_METADATA}")):
        with contextlib.suppress(ValueError, OSError):
            found.exports.append((meta.parent, json.loads(meta.read_text())))
    fill = folder / FILL_MASK_FILE
    if fill.is_file():
        with contextlib.suppress(ValueError, OSError):
            found.fill_mask = list(json.loads(fill.read_text()))
    workflow = folder / WORKFLOW_FILE
    if workflow.is_file():
        try:
            found.workflow = json.loads(workflow.read_text())
        except ValueError as exc:
            raise ReportError(f"{workflow} is not JSON ({exc})") from None
    if not found.steps and not found.nccl:
        raise ReportError(f"{folder} holds no trainer log (*/bert_phase1.jsonl) and no NCCL "
                          "log (nccl-*.log)", hint="give the RESULTSDIR the recipes wrote to")
    return found


def _figure(title: str, ylabel: str) -> tuple[Any, Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.2), dpi=100)
    axes.set_title(title)
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    return plt, figure, axes


def _save(plt: Any, figure: Any, path: Path) -> Path:
    figure.tight_layout()
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png")
    plt.close(figure)
    return path


def plot_metric(results: Results, key: str, title: str, ylabel: str, path: Path) -> Path | None:
    """``key`` against step, one line per phase; phase 2 continues phase 1's step axis."""
    if not any(any(key in e for e in events) for events in results.steps.values()):
        return None
    plt, figure, axes = _figure(title, ylabel)
    offset = 0
    for phase, events in sorted(results.steps.items()):
        points = [(offset + e["step"], e[key]) for e in events if e.get(key) is not None]
        if points:
            axes.plot(*zip(*points, strict=True), marker=".",
                      label=f"phase {phase} (steps {offset + 1}-{offset + events[-1]['step']})")
        offset += events[-1]["step"] if events else 0
    axes.legend()
    return _save(plt, figure, path)


@dataclass(frozen=True)
class Expectation:
    """What the NCCL check is judged against, and why (the report's first word on it)."""

    busbw_gbs: float
    profile: str
    source: str  # "given" (report --profile), "recorded" (the job's), "default"

    @property
    def line(self) -> str:
        why = {"given": "as asked (--profile)",
               "recorded": "as the NCCL job recorded it (recipes render --profile)",
               "default": "the default: no job recorded a profile; pass --profile"}
        return (f"judged against profile {self.profile} ({self.busbw_gbs:g} GB/s expected), "
                f"{why[self.source]}")


def nccl_expectation(results: Results, given: tuple[str, float] | None = None) -> Expectation:
    """The profile the NCCL check is judged by: the one asked for, else the one the NCCL job
    was rendered for, else the workflow's own expectation, else the sandbox's."""
    if given is not None:
        return Expectation(given[1], given[0], "given")
    recorded = [results.profiles[job] for job in sorted(results.profiles)
                if job.startswith("nccl")] or [results.profiles[job]
                                               for job in sorted(results.profiles)]
    if recorded:
        return Expectation(float(recorded[-1]["busbw_gbs"]), str(recorded[-1].get("name")),
                           "recorded")
    if results.workflow.get("expected_busbw_gbs"):
        return Expectation(float(results.workflow["expected_busbw_gbs"]),
                           str(results.workflow.get("profile", "of the workflow")), "recorded")
    return Expectation(DEFAULT_BUSBW[1], DEFAULT_BUSBW[0], "default")


DEFAULT_BUSBW = ("local", 0.05)  # the sandbox's profile (profile_files/local.yaml)


def _embedded(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return (f'<figure><img alt="{html.escape(path.stem)}" '
            f'src="data:image/png;base64,{data}"><figcaption>{html.escape(path.name)}'
            "</figcaption></figure>")


@dataclass(frozen=True)
class Link:
    """A table cell that links to ``href`` (a path relative to the page)."""

    text: str
    href: str


def _cell(value: Any) -> str:
    """A table cell; one holding a word too long for a column (a digest, a path) may break
    anywhere, so the table keeps within the page instead of running off its edge."""
    text = value.text if isinstance(value, Link) else str(value)
    opening = "<td class='long'>" if any(len(word) > LONG_WORD for word in text.split()) \
        else "<td>"
    if isinstance(value, Link):
        return (f'{opening}<a href="{html.escape(value.href, quote=True)}">'
                f"{html.escape(value.text)}</a></td>")
    return f"{opening}{html.escape(text)}</td>"


def _table(headers: list[str], rows: list[list[Any]], css: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(_cell(c) for c in row) + "</tr>" for row in rows)
    return f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


LONG_WORD = 24  # characters; digests are 71, squashfs paths longer
# 74em: a 1280-pixel window less the margins, at the default 16-pixel font.
STYLE = """body{font-family:sans-serif;margin:2em;max-width:74em;overflow-wrap:break-word}
table{border-collapse:collapse;margin:1em 0;max-width:100%}td,th{border:1px solid #bbb;
padding:.3em .6em;text-align:left;vertical-align:top}td.long{overflow-wrap:anywhere}
th{background:#eee}img{max-width:100%}.pass{color:#070}.fail{color:#b00}"""

# Marks the page once every plot has decoded (what a headless browser check reads).
LOADED = """<script>window.addEventListener('load',function(){var i=document.images,n=0;
for(var k=0;k<i.length;k++){if(i[k].complete&&i[k].naturalWidth>0){n++;}}
document.body.setAttribute('data-plots-loaded',String(n));});</script>"""


def summary_of(results: Results, expectation: Expectation) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for phase, events in sorted(results.steps.items()):
        losses = [e["loss"] for e in events if "loss" in e]
        summary[f"phase{phase}"] = {"steps": events[-1]["step"], "first_loss": losses[0],
                                    "final_loss": losses[-1],
                                    "final_mlm_accuracy": events[-1].get("mlm_accuracy")}
    if results.nccl:
        path, run = results.nccl[-1]
        verdict = check([run], expectation.busbw_gbs)[0]
        summary["nccl"] = {"log": path.name, "verdict": verdict.status.upper(),
                           "line": verdict_line(verdict),
                           "peak_busbw_gbs": round(run.peak_busbw, 3),
                           "expected_busbw_gbs": expectation.busbw_gbs,
                           "profile": expectation.profile,
                           "judged_against": expectation.line}
    if results.exports:
        summary["exports"] = [str(path) for path, _ in results.exports]
    if results.ran_in:
        summary["ran_in"] = dict(sorted(results.ran_in.items()))
    if results.fill_mask:
        got = [guessed(item) for item in results.fill_mask]
        summary["fill_mask"] = {"sentences": len(got), "first": got.count(1),
                                "in_top": sum(1 for g in got if g)}
    return summary


def guessed(item: dict[str, Any]) -> int | None:
    """Where the masked word is among a fill-mask item's predictions (1 = first), or None."""
    word = str(item.get("word", "")).strip().lower()
    tokens = [str(p.get("token", "")).strip().lower() for p in item.get("predictions", [])]
    return tokens.index(word) + 1 if word and word in tokens else None


def _verdict(item: dict[str, Any]) -> str:
    rank = guessed(item)
    if rank == 1:
        return "yes"
    count = len(item.get("predictions", []))
    return f"{_ordinal(rank)} of {count}" if rank else f"no (not in the top {count})"


def _ordinal(rank: int) -> str:
    suffix = {1: "st", 2: "nd", 3: "rd"}.get(rank, "th")
    return f"{rank}{suffix}"


def _ran_in(results: Results, job_id: object) -> str:
    """The image the trainer of job ``job_id`` logged (its results folder ``*-<id>``)."""
    return next((image for name, image in results.ran_in.items()
                 if name.rsplit("-", 1)[-1] == str(job_id)), "")


def _provenance(results: Results, page_dir: Path) -> list[str]:
    """Jobs with the image each ran in, the pinned images (and any job that ran in another),
    the exported models and what they predict: results are never shown beside an image
    that did not produce them."""
    parts = []
    jobs = results.workflow.get("jobs", [])
    if jobs:
        parts.append("<h2>Jobs</h2>" + _table(
            ["job", "id", "state", "nodes", "elapsed", "runtime", "ran in"],
            [[j.get("name"), j.get("id"), j.get("state"), j.get("nodes"), j.get("elapsed"),
              j.get("runtime", ""), _ran_in(results, j.get("id"))] for j in jobs], "jobs"))
    elif results.ran_in:
        parts.append("<h2>Jobs</h2>" + _table(
            ["job", "ran in"], [[k, v] for k, v in sorted(results.ran_in.items())], "jobs"))
    pins = results.workflow.get("pins", {})
    if pins:
        parts.append("<h2>Pinned images</h2>" + _table(
            ["what", "value"], [[k, v] for k, v in pins.items()], "pins"))
        # "digest", or one per platform ("digest linux/arm64") where the jobs ran on several
        pinned = sorted(str(v) for k, v in pins.items() if k == "digest" or
                        k.startswith("digest "))
        other = {name: image for name, image in results.ran_in.items()
                 if pinned and name in results.trained and image.startswith("sha256:")
                 and image not in pinned}
        for name, image in sorted(other.items()):
            parts.append(f"<p class='fail image-mismatch'>{html.escape(name)} ran in "
                         f"{html.escape(image)}, not the pinned {html.escape(' or '.join(pinned))}"
                         ": its curves and exports are that image's</p>")
    if results.exports:
        parts.append("<h2>Exported models</h2>" + _table(
            ["folder", "layout", "phase", "step", "loss", "image"],
            [[Link(str(path), os.path.relpath(path / EXPORT_METADATA, page_dir)),
              m.get("layout"), m.get("phase"), m.get("step"), m.get("loss"),
              m.get("image_digest") or m.get("image")] for path, m in results.exports],
            "exports"))
    if results.fill_mask:
        rows = [[item.get("masked"), item.get("word"), ", ".join(
            f"{p.get('token')} ({float(p.get('score', 0)):.3f})"
            for p in item.get("predictions", [])), _verdict(item)]
            for item in results.fill_mask]
        parts.append("<h2>Fill-mask (the exported model, transformers' pipeline)</h2>"
                     + _table(["sentence", "masked word", "top predictions", "got it"], rows,
                              "fill-mask"))
    return parts


def write_report(folder: Path, output: Path | None = None,
                 profile: tuple[str, float] | None = None) -> dict[str, Any]:
    """Plots and index.html for the results in ``folder``; returns what the page says.  The
    NCCL check is judged against ``profile`` (name, expected bus bandwidth) when given, else
    against the profile the NCCL job was rendered for."""
    results = read_results(folder)
    out = output or folder / "report"
    out.mkdir(parents=True, exist_ok=True)
    expectation = nccl_expectation(results, profile)
    expected = expectation.busbw_gbs
    plots = [p for p in (
        plot_metric(results, "loss", "training loss", "loss", out / "loss.png"),
        plot_metric(results, "mlm_accuracy", "masked-LM accuracy", "accuracy",
                    out / "mlm_accuracy.png"),
        plot_metric(results, "sequences_per_s", "throughput", "sequences/s",
                    out / "throughput.png")) if p]
    if results.nccl:
        from imgpipe.recipes.plot import plot_busbw

        _, run = results.nccl[-1]
        [verdict] = check([run], expected)
        plots.append(plot_busbw(run, verdict, out / "nccl_busbw.png",
                                f"{run.collective} bus bandwidth"))
    summary = summary_of(results, expectation)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>imgpipe report: "
             f"{html.escape(folder.name)}</title><style>{STYLE}</style>{LOADED}</head><body>",
             f"<h1>BERT workflow: {html.escape(str(folder))}</h1>"]
    rows = [[f"phase {p[5:]}", s["steps"], s["first_loss"], s["final_loss"],
             s["final_mlm_accuracy"]] for p, s in summary.items() if p.startswith("phase")]
    if rows:
        parts.append("<h2>Training</h2>" + _table(
            ["phase", "steps", "first loss", "final loss", "final MLM accuracy"], rows,
            "training"))
    if "nccl" in summary:
        n = summary["nccl"]
        css = "pass" if n["verdict"] == "PASS" else "fail"
        parts.append(f"<h2>NCCL check</h2><p id='nccl-profile'>"
                     f"{html.escape(n['judged_against'])}</p><p class='{css}' "
                     f"id='nccl-verdict'>{html.escape(n['line'])}</p>")
    parts += _provenance(results, out)
    parts.append("<h2>Plots</h2>" + "".join(_embedded(p) for p in plots))
    parts.append("</body></html>\n")
    page = out / "index.html"
    with atomic_path(page) as tmp:
        tmp.write_text("".join(parts))
    return {"report": str(page), "plots": [str(p) for p in plots], "summary": summary}
