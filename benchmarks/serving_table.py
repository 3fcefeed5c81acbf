"""The serving table (issue 26), one per GPU card, from the GPU kit's results files.

    python benchmarks/serving_table.py benchmarks/results/h*-serving*.json \
        --out benchmarks/results/serving-table.md

Each artifact the issue asks for is a row per workload: output tokens/s at each concurrency level
through its own deploy command, its ratio to the engine called directly with its defaults (the 0.95x
target), TTFT and ITL at one stream, the share of its bandwidth bound, the KV cache its server
allocated at the reservation it was given. Rows come from `bench_gpu.py run` and `serve-source`;
for each card and workload the latest file that served an artifact wins (files ordered by date,
then run number), a workload that failed, or a later run of only some of its levels (`CONCURRENCY`),
leaving an earlier row standing (the later run's ratios are named beside it); under each card, a
served artifact missing one of the two workloads, measured over a fixed window only or without a
project / raw ratio is listed with its gaps, and a workload below 30 % of its bound at one stream
with the kernels and mode it used.
An engine setting tried beside a command (`settings`) is a row of its own. An artifact no file
served is listed with the reason its latest row gives, or as never run."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SOURCE = "source (vLLM defaults)"  # bench_gpu.py serve-source's row
# (target, engine, what it is): the issue's artifacts, in the order the table shows them
EXPECTED: tuple[tuple[str, str, str], ...] = (
    (SOURCE, "vllm", "BF16 source, vLLM with its defaults"),
    ("gptq", "vllm", "GPTQ W4A16 g128 (llm-compressor)"),
    ("awq", "vllm", "AWQ W4A16 g128 (llm-compressor)"),
    ("gptq-gptqmodel", "vllm", "GPTQ W4A16 g128 (GPTQModel)"),
    ("awq-gptqmodel", "vllm", "AWQ W4A16 g128 (GPTQModel)"),
    ("modelopt-fp8", "vllm", "FP8 (ModelOpt)"),
    ("gptq", "sglang", "GPTQ W4A16 g128 (llm-compressor)"),
    ("awq", "sglang", "AWQ W4A16 g128 (llm-compressor)"),
    ("gguf-q8_0", "llama.cpp", "GGUF Q8_0"),
    ("gguf-q4_0", "llama.cpp", "GGUF Q4_0"),
    ("gguf-iq4_xs", "llama.cpp", "GGUF IQ4_XS (imatrix)"),
)
LEVELS = ("1", "8", "32", "128")
WORKLOADS = ("512/128", "2048/256")  # the issue's two, as the serving recipes run them
RUN = re.compile(r"(\d{4}-\d{2}-\d{2})(?:-serving)?(?:-run(\d+))?")


def file_order(path: Path) -> tuple[str, int]:
    """Date in the name, then its run number (a name without one is the day's first run)."""
    m = RUN.search(path.name)
    return (m.group(1), int(m.group(2) or 1)) if m else ("", 0)


def fewer_levels(later: Iterable[str], held: Iterable[str]) -> bool:
    """Whether a later run measured only some of the levels an earlier one did (`CONCURRENCY`):
    the earlier one's numbers stand."""
    return set(later) < set(held)


def load_rows(files: list[Path]) -> list[tuple[Path, dict[str, Any]]]:
    """Every result row with its file, oldest file first."""
    rows = []
    for path in sorted(files, key=file_order):
        got = json.loads(path.read_text())
        if isinstance(got, list):  # a results file (a collected manifest is a dict: skipped)
            rows += [(path, row) for row in got if isinstance(row, dict) and "target" in row]
    return rows


def _num(v: Any, f: str) -> str:
    return format(v, f) if isinstance(v, int | float) else "–"


def _ours(level: dict[str, Any]) -> dict[str, Any]:
    """The deploy command's side of a level (a serve-source level is the engine's own side)."""
    return level.get("project") or {} if "raw" in level else level


def _mark(level: dict[str, Any]) -> str:
    """`cut`: a time cap ended it with requests unfinished; `w`: measured over a fixed window,
    before levels ran whole waves (its numbers count what finished inside the window)."""
    if "planned" not in level:
        return " w"
    return " cut" if level.get("incomplete") else ""


def _range(ratios: list[float]) -> str | None:
    if not ratios:
        return None
    return f"{min(ratios):.3f}" if min(ratios) == max(ratios) else f"{min(ratios):.3f}–{max(ratios):.3f}"


def _ratio_range(levels: dict[str, Any]) -> str | None:
    """The range of a workload's project / raw ratios over its levels (None: none measured); then,
    where a cap cut a level, the range of what each side streamed inside it, named as such."""
    ratios = _range([lv["ratio"] for lv in levels.values() if isinstance(lv.get("ratio"), int | float)])
    cut = _range([r for lv in levels.values() if isinstance(r := lv.get("streamed_ratio"), int | float)])
    if cut is None:
        return ratios
    return f"{ratios or '–'}; cut, streamed: {cut}"


def _streamed(level: dict[str, Any]) -> str:
    """A cut level's tokens/s streamed inside its cap, finished requests or not (2026-12-07 on)."""
    streamed = level.get("streamed_tokens_per_s")
    return f" (streamed {streamed:,.1f})" if level.get("incomplete") and streamed is not None else ""


def _shape(load: dict[str, Any]) -> str:
    return f"{load['prompt_tokens']}/{load['output_tokens']}"


def _shape_order(shape: str) -> tuple[int, int]:
    """`512/128` before `2048/256`: by prompt, then output tokens."""
    prompt, _, output = shape.partition("/")
    return int(prompt), int(output)


def workload_line(
    label: str,
    engine: str,
    serving: dict[str, Any],
    run: dict[str, Any],
    source: str,
    earlier: tuple[str, str] | None = None,
) -> str:
    """The table line of one workload `run` of a passed serving record; where its raw side was not
    run, `earlier`'s ratios (a results file's name and the range it measured on this workload),
    named as such."""
    kv = serving.get("kv_cache") or {}
    setting = ", ".join(f"{k} {v}" for k, v in (serving.get("memory_setting") or {}).items())
    cache = f"{kv['tokens']:,} tokens" + (f" at {setting}" if setting else "") if kv else "–"
    load, levels = run["workload"], run.get("levels") or {}
    rates = []
    for c in LEVELS:
        level = levels.get(c)
        ours = _ours(level or {})
        tps = _num(ours.get("output_tokens_per_s"), ",.1f")
        rates.append(tps + _mark(ours) + _streamed(ours) if level else "–")
    ratio = _ratio_range(levels) or "–"
    if ratio == "–" and serving.get("raw_status") not in (None, "passed"):  # `close`: the lease ended
        ratio = f"raw {serving['raw_status']}"
        if earlier:
            ratio += f"; {earlier[1]} in {earlier[0]}"
    one = _ours(levels.get("1") or {})
    bound = run.get("decode_bound") or {}
    share = (
        f"{bound['share_c1']:.0%} of {bound['bound_tokens_per_s']:,.0f}"
        + (" (flagged)" if bound.get("flag") else "")
        if bound.get("share_c1") is not None
        else "–"
    )
    return (
        f"| {label} | {engine} | {load['prompt_tokens']}/{load['output_tokens']} | {' | '.join(rates)} | "
        f"{ratio} | {_num(one.get('ttft_ms_p50'), '.0f')} / {_num(one.get('ttft_ms_p99'), '.0f')} | "
        f"{_num(one.get('itl_ms_p50'), '.2f')} | {share} | {cache} | {source} |"
    )


def setting_lines(label: str, engine: str, settings: dict[str, Any], source: str) -> list[str]:
    """One line per engine setting tried: tokens/s per level of the first workload, each with its
    ratio to the command as recorded."""
    load = settings.get("workload") or {}
    shape = f"{load.get('prompt_tokens', '?')}/{load.get('output_tokens', '?')}"
    lines = []
    tried = settings.get("settings") or {}
    recorded = (tried.get("as recorded") or {}).get("levels") or {}  # each row's streamed ratio's base
    for name, s in tried.items():
        if s.get("status") != "passed":
            lines.append(
                f"| {label} | {engine} | {name} | {shape} | {s.get('status')}: {s.get('reason')} | | | | |"
            )
            continue
        # concurrency 1 is the row itself (tokens/s none where a cap cut it); the higher levels are
        # `levels`, or only the top one (`top`) in the sweeps before 2026-12-05's fourth session
        levels = {"1": {"output_tokens_per_s": s.get("output_tokens_per_s"), "ratio": s.get("ratio")}}
        levels |= s.get("levels") or ({str(s["top"]["concurrency"]): s["top"]} if s.get("top") else {})
        cells = [
            f"{_num(lv.get('output_tokens_per_s'), ',.1f')}{' cut' if lv.get('incomplete') else ''}"
            f" ({_num(lv.get('ratio'), '.3f')}{_setting_streamed(lv, recorded.get(c))})"
            if (lv := levels.get(c))
            else "–"
            for c in LEVELS
        ]
        lines.append(f"| {label} | {engine} | {name} | {shape} | {' | '.join(cells)} | {source} |")
    return lines


def _setting_streamed(level: dict[str, Any], recorded: dict[str, Any] | None) -> str:
    """Where a cap cut a setting's level or the same level as recorded: `; streamed R`, what the two
    servers streamed inside the cap (recorded from 2026-12-08; from the streamed tokens/s both
    levels kept in the files before)."""
    ratio = level.get("streamed_ratio")
    base = recorded or {}
    if ratio is None and (level.get("incomplete") or base.get("incomplete")):
        got, under = level.get("streamed_tokens_per_s"), base.get("streamed_tokens_per_s")
        ratio = (
            got / under if isinstance(got, int | float) and isinstance(under, int | float) and under else None
        )
    return f"; streamed {ratio:.3f}" if isinstance(ratio, int | float) else ""


def flagged_line(
    label: str, engine: str, target: str, serving: dict[str, Any], run: dict[str, Any], kernels: list[str]
) -> str:
    """A flagged workload: its share of the bound, the linear kernels its engine named while
    validating the artifact (the kit's `kernels`: vLLM names one, llama.cpp none) and the kernel and
    mode lines its benchmark server logged (`engine_mode`, recorded from 2026-12-07)."""
    bound = run["decode_bound"]
    named = "; ".join(kernels) if kernels else f"none named in {engine}'s validation logs"
    mode = serving.get("engine_mode")
    unrecorded = "not recorded (runs before 2026-12-07 12:05 UTC, when the kit began recording it)"
    logged = "; ".join(mode) if mode else "no such line" if mode is not None else unrecorded
    return (
        f"- {label} in {engine} (`{target}`), {_shape(run['workload'])}: {bound['share_c1']:.0%} of "
        f"{bound['bound_tokens_per_s']:,.0f} tok/s; kernel at validation: {named}; "
        f"its benchmark server logged: {logged}"
    )


def _why_not(row: dict[str, Any] | None) -> str:
    """Why an artifact has no serving numbers, from its latest row: its build or verdict, else its
    serving record."""
    if row is None:
        return "no results file holds a row for it"
    if row.get("status") not in (None, "passed"):
        return f"its latest row says {row['status']}: {row.get('reason')}"
    serving = row.get("serving") or {}
    if serving:
        return f"its latest serving record says {serving.get('status')}: {serving.get('reason')}"
    return "its latest row passed but holds no serving record"


def _without_paths(reason: object) -> str:
    """A failure's reason up to its first parenthesis: without the GPU host's log paths."""
    return str(reason).split(" (")[0]


# a workload's row: its file, the serving record, the run of that workload, the validation kernels
ServedRun = tuple[Path, dict[str, Any], dict[str, Any], list[str]]


def table(files: list[Path]) -> str:
    """The markdown: one section per card (its rows, its gaps, its settings sweeps), then what no
    card has served."""
    rows = load_rows(files)
    # card -> (target, engine) -> workload shape -> the latest file, serving record and run of it,
    # and its row's validation kernels (a later run of one workload leaves another's row standing)
    cards: dict[str, dict[tuple[str, str], dict[str, ServedRun]]] = {}
    with_raw: dict[str, dict[tuple[str, str, str], tuple[str, str]]] = {}  # latest measured ratios
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    attempts: dict[str, dict[tuple[str, str], str]] = {}  # card -> the latest failed serving record
    # every settings sweep, also one of a run that did not serve the artifact again (`settings`
    # without `serve`: its deploy command's numbers are an earlier file's)
    sweeps: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
    for path, row in rows:
        key = (row["target"], row.get("engine"))  # none: a build that never reached an engine
        latest[key] = row
        card = row.get("device") or "unknown card"
        if (row.get("settings") or {}).get("status") in ("passed", "partial"):
            sweeps.setdefault(card, []).append((path, row))
        serving = row.get("serving") or {}
        if serving.get("status") in ("failed", "error"):  # the reason a workload may still lack a row
            reason = _without_paths(serving.get("reason"))
            attempts.setdefault(card, {})[key] = f"{path.name}: {serving['status']}: {reason}"
        if serving.get("status") == "passed":
            for run in serving.get("workloads") or []:
                if not run.get("levels"):  # a workload that failed: an earlier run's row stands
                    why = _without_paths(run.get("reason") or run.get("error"))
                    attempts.setdefault(card, {})[key] = f"{path.name}: {_shape(run['workload'])}: {why}"
                    continue
                shape = _shape(run["workload"])
                runs = cards.setdefault(card, {}).setdefault(key, {})
                if shape not in runs or not fewer_levels(run["levels"], runs[shape][2]["levels"]):
                    runs[shape] = (path, serving, run, row.get("kernels") or [])
                if ratios := _ratio_range(run["levels"]):
                    with_raw.setdefault(card, {})[(*key, shape)] = (path.name, ratios)
    out = [
        "# The serving table, measured (issue 26)",
        "",
        "Written by `benchmarks/serving_table.py` from the GPU kit's results files; do not edit by hand.",
        "Output tokens/s per concurrency level through each artifact's own deploy command; `w` marks a",
        "level measured over a fixed 15 s window (before levels ran whole waves: not comparable), `cut` one",
        "whose time cap (60 s a level; 120 s in the 2026-12-07 GGUF runs) ended it with requests",
        "unfinished (its tokens/s counts the finished ones; `(streamed N)`, recorded from 2026-12-07, what",
        "the server streamed inside the cap, the cut requests included). Project / raw: the range over the",
        "levels of the deploy command's tokens/s over the engine called directly with its defaults, same",
        "checkpoint, same lease (`cut, streamed`: the same of what each streamed inside a cap that cut",
        "either). Share of bound: tokens/s at one stream over the memory-bandwidth bound (weights as",
        "stored plus 16-bit KV at the context, the card's spec bandwidth); below 30 % is flagged.",
    ]
    for card, served in sorted(cards.items()):
        out += ["", f"## {card}", ""]
        out += [
            "| artifact | engine | prompt/output | c=1 tok/s | c=8 | c=32 | c=128 | project / raw | "
            "TTFT p50 / p99 ms at 1 | ITL p50 ms at 1 | share of bound at 1 (tok/s) | KV cache at start | "
            "from |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        tried, flagged = [], []
        for target, engine, label in EXPECTED:
            for shape, (path, serving, run, kernels) in sorted(
                served.get((target, engine), {}).items(), key=lambda kv: _shape_order(kv[0])
            ):
                earlier = with_raw.get(card, {}).get((target, engine, shape))
                out += [workload_line(label, engine, serving, run, path.name, earlier)]
                if (run.get("decode_bound") or {}).get("flag"):
                    flagged.append(flagged_line(label, engine, target, serving, run, kernels))
            for path, row in sweeps.get(card, []):
                if (row["target"], row.get("engine")) == (target, engine):
                    tried += setting_lines(label, engine, row["settings"], path.name)
        if gaps := _gaps(served, with_raw.get(card, {}), attempts.get(card, {})):
            out += ["", "Served on this card, with gaps:", "", *gaps]
        if flagged:
            out += [
                "",
                "Below 30 % of the bound at one stream (flagged), with its kernels and mode:",
                "",
                *flagged,
            ]
        if tried:
            out += [
                "",
                "Engine settings, one at a time, each its own server (tokens/s, and its ratio to the"
                " command as recorded):",
                "",
                "| artifact | engine | setting | prompt/output | c=1 | c=8 | c=32 | c=128 | from |",
                "|---|---|---|---|---|---|---|---|---|",
                *tried,
            ]
    missing = [(t, e, label) for t, e, label in EXPECTED if not any((t, e) in s for s in cards.values())]
    if missing:
        out += ["", "## Not served on any card yet", ""]
        for target, engine, label in missing:
            why = _why_not(latest.get((target, engine)) or latest.get((target, None)))
            out.append(f"- {label} in {engine} (`{target}`): {why}")
    return "\n".join(out) + "\n"


def _gaps(
    served: dict[tuple[str, str], dict[str, ServedRun]],
    ratios: dict[tuple[str, str, str], tuple[str, str]],
    failed: dict[tuple[str, str], str],
) -> list[str]:
    """On one card: each served artifact's workloads it has no row for (with its latest failed
    serving record's reason, where one failed), those measured over a fixed window only (not
    comparable), and those without a project / raw ratio (the bf16 source's row is the engine with
    its defaults: it has no raw side)."""
    lines = []
    for target, engine, label in EXPECTED:
        runs = served.get((target, engine), {})
        if not runs:
            continue
        said = []
        if absent := [w for w in WORKLOADS if w not in runs]:
            attempt = failed.get((target, engine))
            why = f" (latest failed attempt, {attempt})" if attempt else ""
            said.append(f"{', '.join(absent)} not served{why}")
        shapes = sorted(runs, key=_shape_order)
        windowed = [
            w for w in shapes if any(_mark(_ours(lv)) == " w" for lv in runs[w][2]["levels"].values())
        ]
        if windowed:
            said.append(f"{', '.join(windowed)} measured over a fixed window only")
        unratioed = [w for w in shapes if (target, engine, w) not in ratios]
        if unratioed and target != SOURCE:
            said.append(f"no project / raw ratio at {', '.join(unratioed)}")
        if said:
            lines.append(f"- {label} in {engine} (`{target}`): {'; '.join(said)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    text = table(args.results)
    if args.out:
        args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
