"""`pipeline report RECIPE --html FILE`: one self-contained page per recipe. The artifact table
and two Vega-Lite plots made with Altair (size vs ΔPPL; serving throughput vs TTFT p99 per
concurrency level, per engine), with the Vega/Vega-Lite/vega-embed JavaScript inlined by
vl-convert, so the page opens offline. The rows are the recipe's DVC metrics files
(`Project.report()`), so targets built on a GPU host appear once their metrics are committed;
`--beside RECIPE` adds another recipe's rows (the GPU host's 7B serving recipes beside the CPU
host's), each row then naming its recipe, the plots on log scales.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeline.artifacts import write_text_atomic
from pipeline.constants import CONTENDED_SHARE, SERVING_METRICS, serving_metrics_head
from pipeline.errors import PipelineError


def serving_key(head: str) -> re.Pattern[str]:
    """A serving level's metrics key under `head` (`serving`: the primary engine's; `serving_sglang`:
    another engine's): the first workload's, or a further one's (its prompt x output tokens)."""
    return re.compile(rf"^{re.escape(head)}_(?:(\d+x\d+)_)?c(\d+)_({'|'.join(SERVING_METRICS)})$")


# Chart ids in the page; a test counts each chart's marks by them.
SIZE_CHART, SERVING_CHART = "size-vs-ppl", "throughput-vs-ttft"


@dataclass(frozen=True)
class ServingPoint:
    """One concurrency level of one artifact's serving benchmark."""

    concurrency: int
    workload: str | None = None  # prompt/output tokens; None: the first workload of an older record
    ttft_ms_p50: float | None = None
    ttft_ms_p99: float | None = None
    itl_ms_p50: float | None = None
    itl_ms_p99: float | None = None
    output_tokens_per_s: float | None = None
    streamed_tokens_per_s: float | None = None  # a cut level's cut requests' tokens included
    peak_rss_mib: float | None = None
    peak_gpu_mib: float | None = None  # device-wide: an engine's reservation shows here
    others_cpu_share: float | None = None  # other processes' share of the host's CPUs meanwhile
    incomplete: int | None = None  # requests the level's time cap cut off (its tokens/s undercounts)


@dataclass(frozen=True)
class ReportRow:
    """One target's numbers as its metrics file holds them."""

    target: str
    engine: str
    quant: str
    status: str | None
    host: str  # the build host whose metrics file it is: cpu, or gpu (the GPU host's DVC project)
    size_mib: float | None
    ppl_delta_pct: float | None
    kld_mean: float | None
    kld_topk_mean: float | None
    token_agreement: float | None
    tokens_per_s: float | None
    tokens_per_s_others_cpu_share: float | None = None
    serving_status: str | None = None
    serving: list[ServingPoint] = field(default_factory=list)  # the first workload's levels
    more_serving: list[ServingPoint] = field(default_factory=list)  # further workloads' levels
    serving_device: str | None = None  # where the serving benchmark ran (a GPU's name, or cpu)
    bound_share_c1: float | None = None  # concurrency 1's share of the bandwidth bound
    recipe: str | None = None  # the recipe it belongs to, where a page shows several

    @classmethod
    def from_metrics(cls, record: dict[str, Any], engine: str | None = None) -> ReportRow:
        """The primary engine's row, or (`engine`) another engine's that the serving benchmark
        measured too (`engines: all`): its verdict and serving numbers, no quality columns (the
        metrics hold the primary verdict's)."""
        primary = engine is None or engine == record.get("engine")
        head = serving_metrics_head(record.get("engine") if primary else engine, record.get("engine"))
        key = serving_key(head)
        levels: dict[tuple[str | None, int], dict[str, float]] = {}
        for name, value in record.items():
            if (m := key.match(name)) is not None:
                levels.setdefault((m[1], int(m[2])), {})[m[3]] = value
        first = record.get(f"{head}_workload")

        def points(further: bool) -> list[ServingPoint]:
            """The first workload's levels, or the further ones' (by prompt, output, concurrency)."""
            keys = [k for k in levels if (k[0] is not None) == further]
            keys.sort(key=lambda k: ([int(n) for n in k[0].split("x")] if k[0] else [], k[1]))
            return [ServingPoint(c, w.replace("x", "/") if w else first, **levels[(w, c)]) for w, c in keys]

        quality = record if primary else {}
        engine = record.get("engine") if primary else engine
        return cls(
            target=record["target"],
            engine=engine or "-",
            quant=record.get("quant") or "-",
            status=record.get("status") if primary else (record.get("verdicts") or {}).get(engine),
            host=record.get("host") or "cpu",
            size_mib=record.get("size_mib"),
            ppl_delta_pct=quality.get("ppl_delta_pct"),
            kld_mean=quality.get("kld_mean"),
            kld_topk_mean=quality.get("kld_topk_mean"),
            token_agreement=quality.get("token_agreement"),
            tokens_per_s=quality.get("tokens_per_s"),
            tokens_per_s_others_cpu_share=quality.get("tokens_per_s_others_cpu_share"),
            serving_status=record.get(f"serving_{engine}"),
            serving=points(further=False),
            more_serving=points(further=True),
            serving_device=record.get(f"{head}_device"),
            bound_share_c1=record.get(f"{head}_bound_share_c1"),
        )

    @property
    def measured_on(self) -> str:
        """Where its serving numbers come from, for the table and the chart's series."""
        return self.serving_device or f"{self.host} host"

    @property
    def label(self) -> str:
        """The target's name, prefixed with its recipe's where the page shows several."""
        return f"{self.recipe}: {self.target}" if self.recipe else self.target

    def at(self, concurrency: int | None) -> ServingPoint | None:
        """The level measured at `concurrency` (the lowest one for None)."""
        if not self.serving:
            return None
        if concurrency is None:
            return self.serving[0]
        return next((p for p in self.serving if p.concurrency == concurrency), None)


def report_rows(records: list[dict[str, Any]], recipe: str | None = None) -> list[ReportRow]:
    """A row per target, and one more per other engine its serving benchmark measured (each naming
    `recipe`, for a page of several)."""
    rows: list[ReportRow] = []
    for record in records:
        rows.append(ReportRow.from_metrics(record))
        primary = record.get("engine")
        others = [e for e in record.get("verdicts") or {} if e != primary]
        rows += [
            ReportRow.from_metrics(record, e)
            for e in others
            if record.get(f"{serving_metrics_head(e, primary)}_workload")
        ]
    return [replace(r, recipe=recipe) for r in rows] if recipe else rows


def write_html(recipe: str, rows: list[ReportRow], path: Path) -> Path:
    """Write the report page of `recipe` (the recipes' names, for a page of several) to `path`
    (atomically); a one-line error where the plotting libraries are missing or nothing was built."""
    if not rows:
        raise PipelineError(f"nothing to report for {recipe}: no target has metrics yet (run pipeline build)")
    try:
        import altair as alt
        import vl_convert
        from altair.utils._importers import vl_version_for_vl_convert
    except ImportError as exc:
        raise PipelineError(
            f"the report page needs altair and vl-convert-python ({exc.name} is missing): run make setup"
        ) from None
    charts = {SIZE_CHART: _size_chart(alt, rows), SERVING_CHART: _serving_chart(alt, rows)}
    bundle = vl_convert.javascript_bundle(vl_version=vl_version_for_vl_convert())
    page = _page(recipe, rows, {k: c.to_dict() for k, c in charts.items() if c is not None}, bundle)
    write_text_atomic(path, page)
    return path


def _size_chart(alt: Any, rows: list[ReportRow]) -> Any:
    values = [
        {"target": r.label, "engine": r.engine, "quant": r.quant, "status": r.status or "-",
         "size_mib": r.size_mib, "ppl_delta_pct": r.ppl_delta_pct}
        for r in rows if r.size_mib is not None and r.ppl_delta_pct is not None
    ]  # fmt: skip
    if not values:
        return None
    # models of several recipes differ by orders of magnitude in size
    size = alt.Scale(type="log") if _several_recipes(rows) else alt.Scale(zero=False)
    base = alt.Chart(alt.Data(values=values)).encode(
        x=alt.X("size_mib:Q", title="size (MiB)", scale=size),
        y=alt.Y("ppl_delta_pct:Q", title="ΔPPL vs reference (%)"),
    )
    points = base.mark_point(size=90, filled=True).encode(
        color=alt.Color("engine:N"),
        shape=alt.Shape("status:N"),
        tooltip=["target:N", "engine:N", "quant:N", "status:N", "size_mib:Q", "ppl_delta_pct:Q"],
    )
    labels = base.mark_text(align="left", dx=7, dy=-7).encode(text="target:N")
    return (points + labels).properties(title="Size vs quality", width=520, height=320)


def _serving_chart(alt: Any, rows: list[ReportRow]) -> Any:
    values = [
        {"target": r.label, "engine": r.engine, "concurrency": p.concurrency,
         "ttft_ms_p99": p.ttft_ms_p99, "output_tokens_per_s": p.output_tokens_per_s,
         "itl_ms_p99": p.itl_ms_p99, "measured_on": r.measured_on, "series": f"{r.label} ({r.measured_on})"}
        for r in rows for p in r.serving
        if p.ttft_ms_p99 and p.output_tokens_per_s  # (none or zero: nothing finished, no point)
    ]  # fmt: skip
    if not values:
        return None
    # a CPU host's small model beside a GPU's 7B: tokens/s and latency orders of magnitude apart
    scale = alt.Scale(type="log") if _several_recipes(rows) else alt.Scale()
    base = alt.Chart(alt.Data(values=values)).encode(
        x=alt.X("ttft_ms_p99:Q", title="TTFT p99 (ms)", scale=scale),
        y=alt.Y("output_tokens_per_s:Q", title="output tokens/s", scale=scale),
        color=alt.Color("series:N", title="target (measured on)", legend=alt.Legend(labelLimit=420)),
    )
    lines = base.mark_line(point=True).encode(
        order="concurrency:Q",
        tooltip=["target:N", "engine:N", "measured_on:N", "concurrency:Q", "ttft_ms_p99:Q", "itl_ms_p99:Q",
                 "output_tokens_per_s:Q"],
    )  # fmt: skip
    labels = base.mark_text(align="left", dx=6, dy=8, fontSize=10).encode(
        text=alt.Text("concurrency:Q", format="d")
    )
    return (
        (lines + labels)
        .properties(width=420, height=300)
        .facet(column=alt.Column("engine:N", title="engine"))
        .properties(title="Serving: throughput vs TTFT p99 (point labels: concurrency)")
    )


def _several_recipes(rows: list[ReportRow]) -> bool:
    return len({r.recipe for r in rows}) > 1


def _head(several: bool, columns: tuple[str, ...]) -> str:
    """A table's header row, led by a recipe column on a page of several recipes."""
    named = ("recipe", *columns) if several else columns
    return "".join(f"<th>{html.escape(c)}</th>" for c in named)


TABLE_COLUMNS = (
    "target", "engine", "quant", "status", "built on", "size MiB", "ΔPPL %", "KLD", "KLD top-k ≥",
    "agreement", "tok/s (1 stream)", "serving", "served on", "TTFT p99 ms (lowest c)",
    "output tok/s (highest c)", "bandwidth bound (c=1)",
)  # fmt: skip


def _cell(value: Any, spec: str = "") -> str:
    return "–" if value is None else html.escape(format(value, spec))


def _contended(others_cpu_share: float | None) -> str:
    """A mark for a number measured while other processes used the host (CONTENDED_SHARE)."""
    if others_cpu_share is None or others_cpu_share <= CONTENDED_SHARE:
        return ""
    title = f"other processes used {others_cpu_share:.0%} of the CPUs"
    return f' <span class="contended" title="{title}">contended</span>'


def _cut(incomplete: int | None, streamed: float | None = None) -> str:
    """A mark for a level its time cap ended with requests unfinished (not counted in its tokens/s),
    with what the server streamed inside the window, those requests included, where recorded."""
    if not incomplete:
        return ""
    title = (
        f"the time cap cancelled {incomplete} requests in flight: finished ones only, over the whole window"
    )
    mark = f' <span class="contended" title="{title}">cut</span>'
    return mark + (f" (streamed {streamed:.1f})" if streamed is not None else "")


def _table(rows: list[ReportRow]) -> str:
    several = _several_recipes(rows)
    head = _head(several, TABLE_COLUMNS)
    body = []
    for r in rows:
        low, high = r.at(None), (r.serving[-1] if r.serving else None)
        cells = (
            *((_cell(r.recipe),) if several else ()),
            _cell(r.target), _cell(r.engine), _cell(r.quant), _cell(r.status), _cell(f"{r.host} host"),
            _cell(r.size_mib, ".1f"),
            _cell(r.ppl_delta_pct, "+.2f"), _cell(r.kld_mean, ".4f"), _cell(r.kld_topk_mean, ".4f"),
            _cell(r.token_agreement, ".3f"),
            _cell(r.tokens_per_s, ".1f") + _contended(r.tokens_per_s_others_cpu_share),
            _cell(r.serving_status), _cell(r.measured_on if r.serving else None),
            _cell(low and low.ttft_ms_p99, ".0f") + (f" (c={low.concurrency})" if low else "")
            + _contended(low and low.others_cpu_share) + _cut(low and low.incomplete),
            _cell(high and high.output_tokens_per_s, ".1f") + (f" (c={high.concurrency})" if high else "")
            + _contended(high and high.others_cpu_share) + _cut(high and high.incomplete),
            _cell(r.bound_share_c1, ".0%"),
        )  # fmt: skip
        body.append(f'<tr class="status-{html.escape(r.status or "none")}">' + "".join(
            f"<td>{c}</td>" for c in cells) + "</tr>")  # fmt: skip
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


LEVEL_COLUMNS = (
    "target", "engine", "served on", "prompt/output tokens", "concurrency", "TTFT p50 / p99 ms",
    "ITL p50 / p99 ms", "output tok/s", "peak GPU MiB", "peak RSS MiB",
)  # fmt: skip


def _levels_table(rows: list[ReportRow]) -> str:
    """Every serving level of every target: latency percentiles, throughput and peak memory."""
    several = _several_recipes(rows)
    body = []
    for r in rows:
        for p in [*r.serving, *r.more_serving]:
            cells = (
                *((_cell(r.recipe),) if several else ()),
                _cell(r.target), _cell(r.engine), _cell(r.measured_on), _cell(p.workload),
                _cell(p.concurrency),
                f"{_cell(p.ttft_ms_p50, '.0f')} / {_cell(p.ttft_ms_p99, '.0f')}",
                f"{_cell(p.itl_ms_p50, '.1f')} / {_cell(p.itl_ms_p99, '.1f')}",
                _cell(p.output_tokens_per_s, ".1f") + _contended(p.others_cpu_share)
                + _cut(p.incomplete, p.streamed_tokens_per_s),
                _cell(p.peak_gpu_mib, ",.0f"), _cell(p.peak_rss_mib, ",.0f"),
            )  # fmt: skip
            body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    if not body:
        return ""
    head = _head(several, LEVEL_COLUMNS)
    return f'<table class="levels"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _page(recipe: str, rows: list[ReportRow], specs: dict[str, dict[str, Any]], bundle: str) -> str:
    """The HTML: the table, one div per chart, the inlined JS bundle, and a vegaEmbed call per chart
    (SVG renderer) that marks the body `data-rendered` with the charts drawn, or `data-error`."""
    missing = {
        SIZE_CHART: "no target has both a size and a ΔPPL yet",
        SERVING_CHART: "no serving numbers yet (serving_benchmark is off, or no artifact passed)",
    }
    divs = "".join(
        f'<div class="chart" id="{cid}"></div>' if cid in specs else f'<p class="empty">{missing[cid]}</p>'
        for cid in (SIZE_CHART, SERVING_CHART)
    )
    # "</" must not end the <script> early: JSON-escaped slashes keep specs inert.
    embed = json.dumps(specs).replace("</", "<\\/")
    script = f"""
const specs = {embed};
Promise.all(Object.entries(specs).map(([id, spec]) =>
  vegaEmbed('#' + id, spec, {{renderer: 'svg', actions: false}})))
  .then(() => {{ document.body.dataset.rendered = Object.keys(specs).length; }})
  .catch(e => {{ document.body.dataset.error = String(e); console.error(e); }});
"""
    title = html.escape(f"pipeline report: {recipe}")
    text_columns = 4 + _several_recipes(rows)  # left-aligned: the recipe's, target's, engine's...
    inline_js = bundle.replace("</script", "<\\/script")
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; margin-bottom: 2em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }}
th:nth-child(-n+{text_columns}), td:nth-child(-n+{text_columns}) {{ text-align: left; }}
tr.status-failed td {{ background: #fde8e8; }}
.chart {{ margin-bottom: 2em; }}
.empty {{ color: #666; font-style: italic; }}
</style>
<script>{inline_js}</script>
</head><body>
<h1>{title}</h1>
<p>{len(rows)} rows. ΔPPL, KLD and agreement against the recipe's fp32 transformers reference;
KLD top-k ≥ is the lower bound from an engine's top-64 logprobs; serving numbers from the recipe's
serving benchmark (GuideLLM under each artifact's serve command), each on the host that measured it
(a target built on both the CPU host and the GPU host is a row each); the bandwidth bound is
concurrency 1's output tokens/s over what the GPU's memory bandwidth allows (pipeline.decode_bound).
Below it, every serving level of every workload (the table above and the plots: the first
workload's; peak GPU memory is device-wide, so an engine's reservation shows there).</p>
{_table(rows)}
{_levels_table(rows)}
{divs}
<script>{script}</script>
</body></html>
"""
